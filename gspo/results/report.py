"""The tables of `gspo compare`: markdown (compare.md) and the console report.

Cells: `a±b` is mean ± sample std over seeds; accuracy columns show the mean and its 95%
Student-t interval `a [lo, hi]`; the pairwise table shows each group's difference from
the baseline with a Welch 95% interval. The numbers come from gspo/results/compare.py.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    from gspo.results.groups import CompareResult, Stat
    from gspo.results.stats import Bootstrap, Paired, Welch


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
    ("kl/old > 0.1", lambda r: "—" if not r.get("spiked") else
     f"{r['spiked'][0]}/{r['spiked'][1]} ({r['spiked'][2]} step{'' if r['spiked'][2] == 1 else 's'})"),
    ("mismatch KL", lambda r: _fmt(r["mismatch_kl"], "{:.3g}".format)),
    ("routing mismatch", lambda r: _fmt(r["routing_mismatch"], _pct)),
    ("routing vol.", lambda r: _fmt(r["routing_volatility"], _pct)),
    ("s/step", lambda r: _fmt(r["step_s"], "{:.3g}".format)),
    ("completions", lambda r: _fmt(r["completions"], "{:,.0f}".format)),
    ("collapsed", lambda r: f"{r['collapsed']}/{r['runs']}"),
    ("machines", lambda r: _machines(r)),
]


def _machines(r: dict) -> str:
    """The machines a group's runs ran on, with counts where several (`provenance.label`)."""
    ran = r.get("machines") or {}
    if len(ran) == 1:
        return next(iter(ran))
    return "; ".join(f"{m} x{c}" for m, c in sorted(ran.items(), key=lambda mc: -mc[1])) or "—"

LEGEND = ("a±b: mean ± sample std over seeds; [lo, hi]: 95% confidence interval of the mean over seeds "
          "(Student t, n − 1 degrees of freedom). Final acc: each run's last eval/accuracy after step 0; "
          "final acc by seed: the runs' final accuracies in seed order; eval SE: the binomial standard error "
          "of one run's final evaluation, sqrt(p (1 − p) / n) over the n problems it scored (eval/n), mean over "
          "runs: the noise of the evaluation alone, beside the spread over seeds; "
          "best acc: its highest after step 0 (the step-0 base is not counted); final reward: mean "
          "reward/mean over a run's last 10% of steps; clip/frac, clip low / high, kl/old, routing vol., "
          "s/step: mean over training steps; mismatch KL: mean rollout/mismatch_kl, k3 KL(sampler ‖ trainer) per "
          "token, over the steps that computed it; kl/old > 0.1: the runs with a training step whose kl/old passed "
          "0.1 (of the runs that logged it) and how many such steps they had in all; routing mismatch: mean "
          "rollout/routing_mismatch, the share of (token, layer) expert sets on which the sampler's routing and "
          "the trainer's disagree, over the steps that logged it; max ratio: the largest policy/ratio_max of the run; "
          "completions: the completions a run sampled over its training steps (groups drawn x group size: more "
          "than the batch where dynamic sampling redraws), mean over runs; machines: where the runs ran (CPU "
          "model, vendor family/model/stepping, its widest float unit; the GPU where there was one; summary.json's "
          "machine), with how many runs ran on each.")


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


def _paired(p: "Paired | None") -> str:
    if p is None:
        return "— (needs ≥ 2 shared seeds)"
    return f"{p.diff:+.3f} [{p.low:+.3f}, {p.high:+.3f}] ({p.n} pairs)"


def _boot(b: "Bootstrap | None", fmt: str = "{:+.3f}") -> str:
    return "—" if b is None else f"{fmt.format(b.estimate)} [{fmt.format(b.low)}, {fmt.format(b.high)}]"


def _improvement(p, n: dict) -> str:
    """P(improvement) with its bootstrap interval; a dash below 2 seeds on a side, where resampling one seed gives
    an interval of zero width that reads as certainty."""
    if min(n[p.group], n[p.baseline]) < 2:
        return "— (needs ≥ 2 seeds in both groups)"
    return _boot(p.improvement, "{:.2f}")


def _detectable(p) -> str:
    """The smallest difference detected at 80% power, unpaired (Welch's design) / paired by seed."""
    cells = [f"{x:.3f}" if x is not None else "—" for x in (p.detectable, p.detectable_paired)]
    return " / ".join(cells)


def _needed(p) -> str:
    if p.power_delta is None:
        return ""
    cells = [str(n) if n is not None else "> 10,000" if d is not None else "—"
             for n, d in ((p.seeds_needed, p.detectable), (p.seeds_needed_paired, p.detectable_paired))]
    return " / ".join(cells)


PAIR_COLUMNS: list[tuple[str, Callable[[Any, dict], str]]] = [
    ("group", lambda p, n: p.group),
    ("seeds (group / baseline)", lambda p, n: f"{n[p.group]} / {n[p.baseline]}"),
    ("Δ final acc [95% CI]", lambda p, n: _diff(p.stats["final_acc"])),
    ("Δ final acc paired by seed [95% CI]", lambda p, n: _paired(p.paired)),
    ("Δ best acc [95% CI]", lambda p, n: _diff(p.stats["best_acc"])),
    ("Δ final acc, all comparisons together [95%]", lambda p, n: _diff(p.stats["final_acc_family"])),
    ("paired, all together [95%]", lambda p, n: _paired(p.paired_family)),
    ("P(improvement) [95%]", lambda p, n: _improvement(p, n)),
    ("detectable at 80% power (unpaired / paired)", lambda p, n: _detectable(p)),
    ("Δ on the same problems [95%] (n)", lambda p, n: "—" if p.problems is None else
     f"{_boot(p.problems)} ({p.problems_n})"),
]

PAIR_LEGEND = ("Δ: group mean − baseline mean; [lo, hi]: Welch 95% interval (unequal variances, "
               "Welch–Satterthwaite df). An interval that excludes 0 is a difference at the 5% level; "
               "seeds: runs with the statistic in each group. Paired by seed: the mean of the per-seed differences "
               "over the seeds both groups ran on the same machine, with its t interval (n − 1 df): the same seed "
               "draws the same prompts in every arm, so pairing removes the spread the arms share. All comparisons "
               "together: intervals at the Bonferroni level 1 − 0.05 / m for the table's m comparisons, which hold "
               "together with 95% probability; a difference is settled when this interval excludes 0. "
               "P(improvement): the probability that a seed's final accuracy in the group exceeds one in the "
               "baseline (Mann–Whitney U / (n_a n_b), ties ½), with a stratified bootstrap interval (from 2 seeds a "
               "side). Detectable at "
               "80% power: the smallest true difference a two-sided 5% t test finds 80% of the time with these "
               "seeds and this spread (the pooled std of the two groups; paired: the std of the differences; "
               "exact noncentral t): a null rules out differences about this large, not smaller ones. On the same "
               "problems: the difference in the share of held-out problems the runs' final evaluations answered, "
               "each problem's rate averaged over a group's runs, problems resampled (paired bootstrap): the "
               "evaluation's noise on these problems, not the seeds'.")


def _pair_columns(result: "CompareResult") -> list[tuple[str, Callable[[Any, dict], str]]]:
    """The comparison table's columns, with the seeds a difference needs where `--power` asked."""
    delta = next((p.power_delta for p in result.pairwise if p.power_delta is not None), None)
    if delta is None:
        return PAIR_COLUMNS
    return [*PAIR_COLUMNS, (f"seeds for Δ = {delta:g} at 80% power (unpaired / paired)", lambda p, n: _needed(p))]


def _pair_cells(result: "CompareResult") -> list[list[str]]:
    n = {r["group"]: r["final_acc"].n for r in result.rows}
    return [[cell(p, n) for _, cell in _pair_columns(result)] for p in result.pairwise]


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
        lines += ["| " + " | ".join(name for name, _ in _pair_columns(result)) + " |",
                  "|" + "---|" * len(_pair_columns(result))]
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


def _points(x: float | None, signed: bool = False) -> str:
    return "—" if x is None else f"{100 * x:+.1f}" if signed else f"{100 * x:.1f}"


def _brief_acc(r: dict) -> str:
    stat = r["final_acc"]
    if stat.mean is None:
        return "—"
    return _points(stat.mean) if stat.ci is None else \
        f"{_points(stat.mean)} [{_points(stat.mean - stat.ci)}, {_points(stat.mean + stat.ci)}]"


def _brief_diff(p) -> str:
    """The difference from the baseline in points: paired by seed (*) where the groups share seeds, else Welch."""
    if p is None:
        return "baseline"
    d = p.paired if p.paired is not None else p.stats["final_acc"]
    if d is None:
        return "—"
    return f"{_points(d.diff, True)} [{_points(d.low, True)}, {_points(d.high, True)}]" + (
        "*" if p.paired is not None else "")


def _brief_power(p) -> str:
    if p is None:
        return ""
    x = p.detectable_paired if p.paired is not None else p.detectable
    return _points(x)


# What a reader decides from, in the terminal's width: dropped from the end while the table does not fit
BRIEF: list[tuple[str, Callable[[dict, Any], str]]] = [
    ("group", lambda r, p: str(r["group"])),
    ("seeds", lambda r, p: str(r["runs"])),
    ("final acc % [95%]", lambda r, p: _brief_acc(r)),
    ("Δ points [95%]", lambda r, p: _brief_diff(p)),
    ("80% power", lambda r, p: _brief_power(p)),
    ("collapsed", lambda r, p: f"{r['collapsed']}/{r['runs']}"),
    ("clip", lambda r, p: _fmt(r["clip_frac"], _pct).split("±")[0]),
    ("kl/old", lambda r, p: _fmt(r["kl_old"], "{:.3g}".format).split("±")[0]),
]
BRIEF_LEGEND = ("final acc: mean over seeds of the last held-out accuracy, in %, with its 95% t interval; Δ: the "
                "difference from the baseline in points, paired by seed (*) where the groups share seeds, else "
                "Welch's, 95%; 80% power: the smallest difference these seeds and this spread detect 80% of the "
                "time (a null rules out no smaller one); clip, kl/old: means over training steps.")


def brief_table(result: "CompareResult", width: int) -> tuple[list[str], list[list[str]]]:
    """The brief table's column names and cells for a terminal `width` columns wide: the columns of BRIEF that fit,
    in order (the Δ and power columns only with a baseline), every cell whole on one line."""
    by_group = {p.group: p for p in result.pairwise}
    columns = [c for c in BRIEF if result.baseline is not None or c[0] not in ("Δ points [95%]", "80% power")]
    cells = [[cell(r, by_group.get(r["group"])) for _, cell in columns] for r in result.rows]
    widths = [max([len(name)] + [len(row[i]) for row in cells]) for i, (name, _) in enumerate(columns)]
    keep = len(columns)
    while keep > 3 and sum(w + 2 for w in widths[:keep]) > width:
        keep -= 1
    return [name for name, _ in columns[:keep]], [row[:keep] for row in cells]


def print_report(result: "CompareResult", console: Any = None, wide: bool = False) -> None:
    """The report on the console: by default the brief table in the terminal's width (what a reader decides
    from), where the runs ran, the legend, collapsed runs, warnings and unreadable dirs; `wide`: every column, and
    the comparison with the baseline in full (as compare.md has them)."""
    from rich import box
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    if console is None:  # a pipe or a log: 120 columns (or $COLUMNS), not rich's fold to 80 nor a 260-column line
        console = Console() if sys.stdout.isatty() else Console(width=int(os.environ.get("COLUMNS", 120)))
    if wide and not console.is_terminal:  # every column: as wide as it takes, where no terminal folds it
        console.width = max(console.width, 260)

    def table(title: str, names: list[str], rows: list[list[str]], fold: bool) -> Table:
        # escape: "[lo, hi]" and "[95% CI]" would otherwise be read as rich markup and vanish
        t = Table(title=escape(title), box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True)
        for name in names:
            t.add_column(escape(name), justify="left" if name == "group" else "right",
                         overflow="fold" if fold else "ellipsis", no_wrap=not fold or name in ("group", "steps"))
        for cells in rows:
            t.add_row(*map(escape, cells))
        return t

    title = f"gspo compare — grouped by {result.by}" + (
        f", against {result.baseline}" if result.baseline is not None else "")
    if wide:
        console.print(table(title, [n for n, _ in COLUMNS], format_rows(result.rows), True))
        console.print(LEGEND, markup=False)
        console.print(result.target_note, markup=False)
        if _critic_rows(result):
            console.print(table("critic", [n for n, _ in CRITIC_COLUMNS], _critic_rows(result), True))
            console.print(CRITIC_LEGEND, markup=False)
        if result.baseline is not None:
            console.print(table(f"against the baseline {result.baseline}", [n for n, _ in _pair_columns(result)],
                                _pair_cells(result), True))
            console.print(PAIR_LEGEND, markup=False)
    else:
        names, cells = brief_table(result, console.width)
        console.print(table(title, names, cells, False))
        ran = {m for r in result.rows for m in (r.get("machines") or {})}
        if len(ran) == 1:
            console.print(f"ran on: {next(iter(ran))}", markup=False, soft_wrap=True)
        else:
            for r in result.rows:
                console.print(f"ran on ({r['group']}): {_machines(r)}", markup=False, soft_wrap=True)
        needed = [p for p in result.pairwise if p.power_delta is not None]
        for p in needed:
            console.print(f"{p.group}: seeds a difference of {100 * p.power_delta:g} points needs at 80% power "
                          f"(unpaired / paired): {_needed(p)}", markup=False)
        console.print(BRIEF_LEGEND, markup=False)
    # each finding one line, however long (soft wrap: the terminal folds it, a pipe or a grep reads it whole)
    for g in result.groups:
        for r in g.runs:
            if r.collapse:
                console.print(f"[red]collapsed[/] {escape(f'{g.label} {r.path}: {r.collapse}')}", soft_wrap=True)
    for w in result.warnings:
        console.print(f"[yellow]warning:[/] {escape(w)}", soft_wrap=True)
    for b in result.broken:
        console.print(f"[red]skipped[/] {escape(f'{b.path}: {b.reason}')}", soft_wrap=True)
    for f in [*result.figures, result.table_path]:
        if f is not None:
            console.print(f"wrote {f}" + (" (every column: --wide)" if f == result.table_path and not wide else ""))
