"""The figure of `gspo compare`: one panel per metric, a mean line and a ±1 std band per
group, every seed faint, collapses marked."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from gspo.runs import ACC, CLIP, CLIP_HIGH, CLIP_LOW, ENTROPY, KL_OLD, KL_REF, LENGTH, REWARD, ROUTING

if TYPE_CHECKING:  # compare imports this module (for the figure), not the other way round
    from gspo.compare import Group


PANELS = [  # title, [(metric, line style)], y scale
    ("reward/mean", [(REWARD, "-")], "linear"),
    ("eval/accuracy", [(ACC, "-")], "linear"),
    ("clip fraction (— frac, -- low, ·· high)", [(CLIP, "-"), (CLIP_LOW, "--"), (CLIP_HIGH, ":")], "symlog"),
    ("KL (— kl/ref, -- kl/old)", [(KL_REF, "-"), (KL_OLD, "--")], "linear"),
    ("policy/entropy", [(ENTROPY, "-")], "linear"),
    ("response/len_mean", [(LENGTH, "-")], "linear"),
    ("moe/routing_volatility", [(ROUTING, "-")], "linear"),
]


def plot_groups(groups: Sequence["Group"], out_dir: Path, stem: str = "compare") -> list[Path]:
    """One panel per metric present; mean ± std band per group, each seed faint."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    present = {k for g in groups for r in g.runs for k in r.metrics}
    panels = [p for p in PANELS if any(k in present for k, _ in p[1])]
    ncols = 4 if len(panels) > 6 else 3 if len(panels) > 4 else 2
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(5.2 * ncols, 3.5 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    colors = [f"C{i % 10}" for i in range(len(groups))]
    for ax, (title, keys, scale) in zip(axes, panels):
        positive = []
        for group, color in zip(groups, colors):
            first = True
            for key, style in keys:
                curve = group.curve(key)
                if curve is None:
                    continue
                marker = "o" if key == ACC else None
                if first:  # the panel's main metric: every seed faint, and the band
                    for s, v in curve.runs:
                        ax.plot(s, v, color=color, alpha=0.25, lw=0.8, marker=marker, ms=2)
                    lo = curve.mean - curve.std
                    ax.fill_between(curve.steps, np.maximum(lo, 0) if scale == "symlog" else lo,
                                    curve.mean + curve.std, color=color, alpha=0.15, lw=0)
                ax.plot(curve.steps, curve.mean, style, color=color, lw=1.6, marker=marker, ms=3)
                positive += [v for _, vals in curve.runs for v in vals if v > 0 and math.isfinite(v)]
                first = False
            if keys[0][0] == REWARD:  # mark where each collapsed seed collapsed
                for r in group.runs:
                    if r.collapse_step is not None:
                        s, v = r.series(REWARD)
                        y = v[s == r.collapse_step]
                        ax.plot([r.collapse_step], [y[0] if len(y) and math.isfinite(y[0]) else 0.0],
                                "x", color=color, ms=8, mew=2)
        if scale == "symlog":  # linear below the smallest non-zero value, so 0 stays visible
            smallest = max(min(positive, default=1e-4), 1e-8)
            ax.set_yscale("symlog", linthresh=10 ** math.floor(math.log10(smallest)))
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    handles = [_legend_line(c) for c in colors]
    labels = [f"{g.label} (n={len(g.runs)}"
              + (f", {sum(r.collapse is not None for r in g.runs)} collapsed ×" if any(r.collapse for r in g.runs) else "")
              + ")" for g in groups]
    fig.legend(handles, labels, loc="outside upper center", ncols=min(len(groups), 6), frameon=False)
    fig.supxlabel("line: mean over seeds · band: ± 1 sample std · faint: each seed · ×: collapse", fontsize=9)
    paths = [out_dir / f"{stem}.png", out_dir / f"{stem}.svg"]
    fig.savefig(paths[0], dpi=120)
    fig.savefig(paths[1])
    return paths


def _legend_line(color: str):
    from matplotlib.lines import Line2D

    return Line2D([], [], color=color, lw=2)
