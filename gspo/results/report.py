"""The tables of `gspo compare`: markdown (compare.md) and the console report.

Cells: `a±b` is mean ± sample std over seeds; accuracy columns show the mean and its 95%
Student-t interval `a [lo, hi]`; the pairwise table shows each group's difference from
the baseline with a Welch 95% interval. The numbers come from gspo/results/compare.py.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    from gspo.results.groups import CompareResult, Stat
    from gspo.results.stats import Welch


def _fmt(stat: "Stat", fmt: Callable[[float], str]) -> str:
    if stat.mean is None:
        return "—"
    return fmt(stat.mean) if stat.std is None else f"{fmt(stat.mean)}±{fmt(stat.std)}"


def _ci(stat: "Stat") -> str:
    """mean [low, high]: the 95% t interval over seeds (just the mean with one seed)."""
    if stat.mean is None:
        return "—"
    if stat.ci is None:
        return f"{stat.mean:.3f}"
    return f"{stat.mean:.3f} [{stat.mean - stat.ci:.3f}, {stat.mean + stat.ci:.3f}]"


def _pct(x: float) -> str:
    return f"{100 * x:.3g}%"


def _low_high(r: dict) -> str:
    lo, hi = r["clip_frac_low"].mean, r["clip_frac_high"].mean
    return "—" if lo is None or hi is None else f"{_pct(lo)} / {_pct(hi)}"


COLUMNS: list[tuple[str, Callable[[dict], str]]] = [
    ("group", lambda r: str(r["group"])),
    ("seeds", lambda r: str(r["runs"])),
    ("steps", lambda r: (f"{r['steps_max']}" if r["steps_min"] == r["steps_max"]
                         else f"{r['steps_min']}–{r['steps_max']}")
     + (f" ({r['partial']} partial)" if r["partial"] else "")),
    ("base acc", lambda r: _fmt(r["base_acc"], "{:.3f}".format)),
    ("final acc [95% CI]", lambda r: _ci(r["final_acc"])),
    ("final acc by seed", lambda r: " / ".join(f"{acc:.3f}" for _, acc in r["final_by_seed"]) or "—"),
    ("eval SE", lambda r: "—" if r["final_eval_se"].mean is None else f"{r['final_eval_se'].mean:.3f}"),
    ("best acc [95% CI]", lambda r: _ci(r["best_acc"])),
    ("steps to target", lambda r: "—" if r["target"] is None else
     f"{_fmt(r['steps_to_target'], '{:.0f}'.format)} ({r['steps_to_target'].n}/{r['runs']})"),
    ("final reward", lambda r: _fmt(r["final_reward"], "{:.3f}".format)),
    ("clip/frac", lambda r: _fmt(r["clip_frac"], _pct)),
    ("clip low / high", _low_high),
    ("kl/old", lambda r: _fmt(r["kl_old"], "{:.3g}".format)),
    ("max ratio", lambda r: _fmt(r["ratio_max"], "{:.3g}".format)),
    ("mismatch KL", lambda r: _fmt(r["mismatch_kl"], "{:.3g}".format)),
    ("routing vol.", lambda r: _fmt(r["routing_volatility"], _pct)),
    ("s/step", lambda r: _fmt(r["step_s"], "{:.3g}".format)),
    ("completions", lambda r: _fmt(r["completions"], "{:,.0f}".format)),
    ("collapsed", lambda r: f"{r['collapsed']}/{r['runs']}"),
]

LEGEND = ("a±b: mean ± sample std over seeds; [lo, hi]: 95% confidence interval of the mean over seeds "
          "(Student t, n − 1 degrees of freedom). Final acc: each run's last eval/accuracy after step 0; "
          "final acc by seed: the runs' final accuracies in seed order; eval SE: the binomial standard error "
          "of one run's final evaluation, sqrt(p (1 − p) / n) over the n problems it scored (eval/n), mean over "
          "runs: the noise of the evaluation alone, beside the spread over seeds; "
          "best acc: its highest after step 0 (the step-0 base is not counted); final reward: mean "
          "reward/mean over a run's last 10% of steps; clip/frac, clip low / high, kl/old, routing vol., "
          "s/step: mean over training steps; mismatch KL: mean rollout/mismatch_kl, k3 KL(sampler ‖ trainer) per "
          "token, over the steps that computed it; max ratio: the largest policy/ratio_max of the run; "
          "completions: the completions a run sampled over its training steps (groups drawn x group size: more "
          "than the batch where dynamic sampling redraws), mean over runs.")


def format_rows(rows: Sequence[dict]) -> list[list[str]]:
    return [[cell(r) for _, cell in COLUMNS] for r in rows]


def _diff(w: "Welch | None") -> str:
    if w is None:
        return "— (needs ≥ 2 seeds in both groups)"
    if w.df is None:
        return f"{w.diff:+.3f} [{w.low:+.3f}, {w.high:+.3f}] (no spread)"
    return f"{w.diff:+.3f} [{w.low:+.3f}, {w.high:+.3f}] (df {w.df:.1f})"


# PPO's critic: a table of its own, for the groups that have one (`algo=ppo`)
CRITIC_COLUMNS: list[tuple[str, Callable[[dict], str]]] = [
    ("group", lambda r: str(r["group"])),
    ("value loss", lambda r: _fmt(r["value_loss"], "{:.3g}".format)),
    ("explained var. (last 10%)", lambda r: _fmt(r["explained_variance"], "{:.3f}".format)),
    ("value mean", lambda r: _fmt(r["value_mean"], "{:.3g}".format)),
    ("value clip", lambda r: _fmt(r["value_clip"], _pct)),
]

CRITIC_LEGEND = ("Critic (PPO's value model): value loss (critic/value_loss, the clipped value loss), value mean "
                 "(critic/value_mean) and value clip (critic/clip_frac, tokens whose clipped value loss was the "
                 "larger) averaged over training steps; explained variance 1 − Var(R − V) / Var(R) of the returns by "
                 "the values before each step's update (critic/explained_variance), over the last 10% of steps.")


def _critic_rows(result: "CompareResult") -> list[list[str]]:
    return [[cell(r) for _, cell in CRITIC_COLUMNS] for r in result.rows if r["value_loss"].mean is not None]


PAIR_COLUMNS: list[tuple[str, Callable[[Any, dict], str]]] = [
    ("group", lambda p, n: p.group),
    ("seeds (group / baseline)", lambda p, n: f"{n[p.group]} / {n[p.baseline]}"),
    ("Δ final acc [95% CI]", lambda p, n: _diff(p.stats["final_acc"])),
    ("Δ best acc [95% CI]", lambda p, n: _diff(p.stats["best_acc"])),
    ("Δ final acc, all comparisons together [95%]", lambda p, n: _diff(p.stats["final_acc_family"])),
]

PAIR_LEGEND = ("Δ: group mean − baseline mean; [lo, hi]: Welch 95% interval (unequal variances, "
               "Welch–Satterthwaite df). An interval that excludes 0 is a difference at the 5% level; "
               "seeds: runs with the statistic in each group. All comparisons together: Welch intervals at the "
               "Bonferroni level 1 − 0.05 / m for the table's m comparisons, which hold together with 95% "
               "probability; a difference is settled when this interval excludes 0.")


def _pair_cells(result: "CompareResult") -> list[list[str]]:
    n = {r["group"]: r["final_acc"].n for r in result.rows}
    return [[cell(p, n) for _, cell in PAIR_COLUMNS] for p in result.pairwise]


def tables_markdown(result: "CompareResult") -> list[str]:
    """The comparison's tables with their legends, as markdown lines: what compare.md shows and what a results
    page embeds (gspo/results/pages.py)."""
    lines = ["| " + " | ".join(name for name, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cells) + " |" for cells in format_rows(result.rows)]
    lines += ["", f"{LEGEND} {result.target_note} (k/n) = runs that reached it. See docs/compare.md.", ""]
    if _critic_rows(result):
        lines += ["## Critic", "", "| " + " | ".join(name for name, _ in CRITIC_COLUMNS) + " |",
                  "|" + "---|" * len(CRITIC_COLUMNS)]
        lines += ["| " + " | ".join(cells) + " |" for cells in _critic_rows(result)] + ["", CRITIC_LEGEND, ""]
    if result.baseline is not None:
        lines += [f"## Against the baseline `{result.baseline}`", ""]
        lines += ["| " + " | ".join(name for name, _ in PAIR_COLUMNS) + " |", "|" + "---|" * len(PAIR_COLUMNS)]
        lines += ["| " + " | ".join(cells) + " |" for cells in _pair_cells(result)]
        lines += ["", PAIR_LEGEND, ""]
    return lines


def write_markdown(result: "CompareResult", path) -> None:
    lines = [f"# gspo compare — grouped by `{result.by}`", "", *tables_markdown(result)]
    lines += [f"![comparison]({f.name})" for f in result.figures if f.suffix == ".png"]
    collapsed = [(g.label, r) for g in result.groups for r in g.runs if r.collapse]
    if collapsed:
        lines += ["", "## Collapsed runs", ""] + [f"- {lab} `{r.path}`: {r.collapse}" for lab, r in collapsed]
    if result.warnings:
        lines += ["", "## Warnings", ""] + [f"- {w}" for w in result.warnings]
    if result.broken:
        lines += ["", "## Unreadable run directories (skipped)", ""]
        lines += [f"- `{b.path}`: {b.reason}" for b in result.broken]
    path.write_text("\n".join(lines) + "\n")


def print_report(result: "CompareResult", console: Any = None) -> None:
    """The table on the console, the baseline comparison, then collapsed runs, warnings and unreadable dirs."""
    from rich import box
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    # in a log or a pipe rich would fold the table to 80 columns; a wide table reads better there
    console = console or (Console() if sys.stdout.isatty() else Console(width=260))

    def table(title: str, names: list[str], rows: list[list[str]]) -> Table:
        # escape: "[lo, hi]" and "[95% CI]" would otherwise be read as rich markup and vanish
        t = Table(title=escape(title), box=box.SIMPLE_HEAD, padding=(0, 1))
        for name in names:
            t.add_column(escape(name), justify="left" if name == "group" else "right", overflow="fold",
                         no_wrap=name in ("group", "steps"))
        for cells in rows:
            t.add_row(*map(escape, cells))
        return t

    console.print(table(f"gspo compare — grouped by {result.by}", [n for n, _ in COLUMNS], format_rows(result.rows)))
    console.print(LEGEND, markup=False)
    console.print(result.target_note, markup=False)
    if _critic_rows(result):
        console.print(table("critic", [n for n, _ in CRITIC_COLUMNS], _critic_rows(result)))
        console.print(CRITIC_LEGEND, markup=False)
    if result.baseline is not None:
        console.print(table(f"against the baseline {result.baseline}", [n for n, _ in PAIR_COLUMNS],
                            _pair_cells(result)))
        console.print(PAIR_LEGEND, markup=False)
    for g in result.groups:
        for r in g.runs:
            if r.collapse:
                console.print(f"[red]collapsed[/] {escape(f'{g.label} {r.path}: {r.collapse}')}")
    for w in result.warnings:
        console.print(f"[yellow]warning:[/] {escape(w)}")
    for b in result.broken:
        console.print(f"[red]skipped[/] {escape(f'{b.path}: {b.reason}')}")
    for f in [*result.figures, result.table_path]:
        if f is not None:
            console.print(f"wrote {f}")
