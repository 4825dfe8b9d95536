"""The figure of `gspo compare`: one panel per metric, a mean line and a ±1 std band per
group, every seed faint, collapses marked."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from gspo.results.runs import (ACC, CLIP, CLIP_HIGH, CLIP_LOW, ENTROPY, EXPLAINED_VAR, KL_OLD, KL_REF, LENGTH, REWARD,
                               ROUTING)

if TYPE_CHECKING:  # compare imports this module (for the figure), not the other way round
    from gspo.results.groups import Group


@dataclass(frozen=True)
class Panel:
    """One panel: its metrics (key, line style, legend label), y scale, display unit and valid range.

    `scale` multiplies the logged value for display (100: a fraction shown in %, as the table of
    gspo/results/report.py shows it); `valid` is the range of the displayed value, which clips the ±std band
    (a fraction's mean minus its std is no fraction below 0).
    """

    title: str
    keys: tuple[tuple[str, str, str], ...]
    yscale: str = "linear"
    scale: float = 1.0
    valid: tuple[float | None, float | None] = (None, None)


PANELS = [
    Panel("reward/mean", ((REWARD, "-", "reward/mean"),)),
    Panel("eval/accuracy (held-out, fraction)", ((ACC, "-", "eval/accuracy"),), valid=(0.0, 1.0)),
    Panel("clip fraction (% of tokens)", ((CLIP, "-", "clip/frac"), (CLIP_LOW, "--", "clip/frac_low (A < 0)"),
                                          (CLIP_HIGH, ":", "clip/frac_high (A > 0)")),
          yscale="symlog", scale=100.0, valid=(0.0, 100.0)),
    # two panels, not one: kl/old is orders of magnitude below kl/ref, a flat line on kl/ref's axis; symlog,
    # since k3 of a rare token that an update made likely spikes 1000x above the typical step
    Panel("kl/ref (k3, to the reference; β > 0)", ((KL_REF, "-", "kl/ref"),), yscale="symlog", valid=(0.0, None)),
    Panel("kl/old (k3, to the rollout policy)", ((KL_OLD, "-", "kl/old"),), yscale="symlog", valid=(0.0, None)),
    Panel("policy/entropy (nats per token)", ((ENTROPY, "-", "policy/entropy"),), valid=(0.0, None)),
    Panel("response/len_mean (tokens)", ((LENGTH, "-", "response/len_mean"),), valid=(0.0, None)),
    Panel("moe/routing_volatility (% of expert choices)", ((ROUTING, "-", "moe/routing_volatility"),),
          scale=100.0, valid=(0.0, 100.0)),
    Panel("critic/explained_variance (PPO's value model)", ((EXPLAINED_VAR, "-", "critic/explained_variance"),),
          valid=(None, 1.0)),
]


def plot_groups(groups: Sequence["Group"], out_dir: Path, stem: str = "compare") -> list[Path]:
    """The figure (`figure`) written as out_dir/stem.png and .svg."""
    fig = figure(groups)
    paths = [out_dir / f"{stem}.png", out_dir / f"{stem}.svg"]
    fig.savefig(paths[0], dpi=120)
    fig.savefig(paths[1])
    return paths


def figure(groups: Sequence["Group"]):
    """One panel per metric present; mean ± std band per group, each seed faint; a matplotlib Figure."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    present = {k for g in groups for r in g.runs for k in r.metrics}
    panels = [p for p in PANELS if any(k in present for k, _, _ in p.keys)]
    ncols = 4 if len(panels) > 6 else 3 if len(panels) > 4 else 2
    nrows = math.ceil(len(panels) / ncols)
    spare = nrows * ncols > len(panels)  # a free slot holds the legend instead of staying empty
    fig = Figure(figsize=(5.2 * ncols, 3.5 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    colors = [f"C{i % 10}" for i in range(len(groups))]
    for ax, panel in zip(axes, panels):
        positive, drawn = [], {}
        for group, color in zip(groups, colors):
            first = True
            for key, style, label in panel.keys:
                curve = group.curve(key)
                if curve is None:
                    continue
                drawn[key] = (style, label)
                marker = "o" if key == ACC else None
                mean, std = curve.mean * panel.scale, curve.std * panel.scale
                if first:  # the panel's main metric: every seed faint, and the band
                    for st, v in curve.runs:
                        ax.plot(st, v * panel.scale, color=color, alpha=0.25, lw=0.8, marker=marker, ms=2)
                    lo, hi = panel.valid
                    ax.fill_between(curve.steps, np.clip(mean - std, lo, hi), np.clip(mean + std, lo, hi),
                                    color=color, alpha=0.15, lw=0)
                ax.plot(curve.steps, mean, style, color=color, lw=1.6, marker=marker, ms=3)
                positive += [panel.scale * v for _, vals in curve.runs for v in vals if v > 0 and math.isfinite(v)]
                first = False
            if panel.keys[0][0] == REWARD:  # mark where each collapsed seed collapsed
                for r in group.runs:
                    if r.collapse_step is not None:
                        st, v = r.series(REWARD)
                        y = v[st == r.collapse_step]
                        ax.plot([r.collapse_step], [y[0] if len(y) and math.isfinite(y[0]) else 0.0],
                                "x", color=color, ms=8, mew=2)
        notes = []
        if panel.yscale == "symlog":  # linear below (about) the smallest non-zero value, so 0 stays visible
            smallest = max(float(np.percentile(positive, 1)) if positive else 1e-4, 1e-8)  # not one outlier's decades
            linthresh = 10 ** math.floor(math.log10(smallest))
            ax.set_yscale("symlog", linthresh=linthresh)
            ax.axhline(0.0, color="0.5", lw=0.6)
            ax.set_ylim(bottom=-0.3 * linthresh)  # a curve at 0 sits above the frame, not on it
            zero = [g.label for g in groups if _all_zero(g, panel.keys[0][0])]
            if zero:  # a line on the 0 axis reads like missing data: say it is 0
                notes.append(f"0 at every step: {', '.join(zero)}")
        notes += [f"{a} and {b} coincide" for a, b in _coinciding(groups, panel.keys[0][0])]
        if notes:
            ax.text(0.02, 0.97, "\n".join(notes), transform=ax.transAxes, fontsize=7, va="top", color="0.25")
        if len(panel.keys) > 1:  # what each line style is: under the panel, off the data
            order = [k for k, _, _ in panel.keys if k in drawn]
            ax.legend([_legend_line("0.3", drawn[k][0]) for k in order], [drawn[k][1] for k in order],
                      fontsize=7, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=len(order))
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in axes[len(panels):]:
        ax.set_axis_off()
    handles = [_legend_line(c) for c in colors]
    labels = [f"{g.label} (n={len(g.runs)}"
              + (f", {sum(r.collapse is not None for r in g.runs)} collapsed ×" if any(r.collapse for r in g.runs) else "")
              + ")" for g in groups]
    if spare:  # the legend fills the free slot
        axes[len(panels)].legend(handles, labels, loc="center", frameon=False, title="groups", fontsize=8)
    else:
        fig.legend(handles, labels, loc="outside upper center", ncols=min(len(groups), 6), frameon=False)
    fig.supxlabel("colour: group · line: mean over seeds · band: ± 1 sample std, clipped to the metric's range · "
                  "faint: each seed · ×: collapse", fontsize=9)
    return fig


def _all_zero(group: "Group", key: str) -> bool:
    curve = group.curve(key)
    return curve is not None and bool(np.all(np.nan_to_num(curve.mean) == 0.0))


def _coinciding(groups: Sequence["Group"], key: str) -> list[tuple[str, str]]:
    """Pairs of groups whose mean curves of `key` are identical (one hides the other in the figure)."""
    curves = [(g.label, g.curve(key)) for g in groups]
    curves = [(label, c) for label, c in curves if c is not None and len(c.steps) > 1]
    curves = [(label, c) for label, c in curves if not np.all(np.nan_to_num(c.mean) == 0.0)]  # (said as 0)
    return [(a, b) for i, (a, ca) in enumerate(curves) for b, cb in curves[i + 1:]
            if np.array_equal(ca.steps, cb.steps) and np.array_equal(ca.mean, cb.mean, equal_nan=True)]


def _legend_line(color: str, style: str = "-"):
    from matplotlib.lines import Line2D

    return Line2D([], [], color=color, lw=2 if style == "-" else 1.6, linestyle=style)
