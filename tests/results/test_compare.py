"""gspo compare on synthetic run directories written here (no training)."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf
from tests.conftest import REPO

from gspo.results.compare import CompareError, Run, compare, detect_collapse, load_runs, print_report
from gspo.results.groups import aggregate

BASE_CFG = {
    "algo": {"name": "grpo", "eps_low": 0.2, "eps_high": 0.2},
    "model": {"name": "tiny-moe", "hidden_size": 64, "attn_implementation": "sdpa"},
    "task": {"name": "addition", "digits": 2},
    "reward": {"name": "tinyzero"},
    "rollout": {"group_size": 8, "prompts_per_step": 16, "max_new_tokens": 8, "temperature": 1.0},
    "train": {"steps": 20, "minibatches": 4, "lr": 1e-3},
    "hardware": {"name": "cpu", "device": "cpu"},
    "logger": {"name": "jsonl", "wandb": False},
    "seed": 0,
}


def merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and key in out else value
    return out


def write_run(path: Path, cfg: dict | None = None, lines: list[dict] | None = None,
              summary: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / ".hydra").mkdir(exist_ok=True)
    (path / ".hydra" / "config.yaml").write_text("not: the one we read\n")
    if cfg is not None:
        OmegaConf.save(OmegaConf.create(cfg), path / "config.yaml")
    if lines is not None:
        (path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    return path


def make_run(path: Path, algo="grpo", seed=0, steps=20, rewards=None, acc=None, cfg=None,
             extra=None, finished=True) -> Path:
    """Reward per step 1..steps; eval/accuracy as {step: value}; `extra` adds metrics to every step."""
    rewards = rewards if rewards is not None else [0.1 + 0.02 * t for t in range(steps)]
    acc = acc if acc is not None else {0: 0.3, steps: 0.5}
    lines = [{"step": 0, "eval/accuracy": acc[0]}]
    for t, r in enumerate(rewards, start=1):
        line = {"step": t, "reward/mean": r, "train/loss": 0.1, "clip/frac": 0.01,
                "clip/frac_low": 0.004, "clip/frac_high": 0.006, "kl/old": 1e-3,
                "policy/entropy": 1.0, "response/len_mean": 5.0, "time/step_s": 0.5, **(extra or {})}
        if t in acc:
            line["eval/accuracy"] = acc[t]
        lines.append(line)
    config = merge(merge(BASE_CFG, {"algo": {"name": algo}, "seed": seed}), cfg or {})
    summary = {"status": "finished", "wall_s": 10.0} if finished else None
    return write_run(path, config, lines, summary)


def sweep(tmp_path: Path) -> Path:
    """grpo seeds 0,1,2 and gspo seeds 0,1 as Hydra multirun job dirs."""
    root = tmp_path / "multirun" / "12-00-00"
    root.mkdir(parents=True)
    (root / "multirun.yaml").write_text("hydra: {}\n")
    specs = [("grpo", 0, 0.1, 0.5), ("grpo", 1, 0.2, 0.6), ("grpo", 2, 0.6, 0.7),
             ("gspo", 0, 0.3, 0.8), ("gspo", 1, 0.5, 0.9)]
    for job, (algo, seed, r1, final) in enumerate(specs):
        rewards = [r1] + [0.5] * 19
        make_run(root / str(job), algo, seed, rewards=rewards, acc={0: 0.3, 10: 0.4, 20: final},
                 cfg={"algo": {"eps_low": 3e-4 if algo == "gspo" else 0.2}},
                 extra={"moe/routing_volatility": 0.1, "rollout/mismatch_kl": 2e-3 * (seed + 1)}
                 if algo == "gspo" else None)
    return root


def test_groups_by_algo_and_aggregates_seeds(tmp_path):
    root = sweep(tmp_path)
    result = compare([root], plot=False)
    assert result.by == "algo.name"
    assert [g.label for g in result.groups] == ["grpo", "gspo"]
    grpo, gspo = result.rows
    assert grpo["runs"] == 3 and grpo["seeds"] == [0, 1, 2] and gspo["runs"] == 2
    # step 1 rewards 0.1, 0.2, 0.6: mean 0.3, sample std sqrt((0.04 + 0.01 + 0.09) / 2)
    curve = result.groups[0].curve("reward/mean")
    assert curve.mean[0] == pytest.approx(0.3) and curve.std[0] == pytest.approx(math.sqrt(0.07))
    assert curve.n[0] == 3 and curve.std[-1] == pytest.approx(0.0)
    # final eval/accuracy 0.5, 0.6, 0.7 -> 0.6 ± 0.1; best = final here; base 0.3 ± 0
    assert (grpo["final_acc"].mean, grpo["final_acc"].std) == pytest.approx((0.6, 0.1))
    assert grpo["best_acc"].mean == pytest.approx(0.6)
    assert (gspo["final_acc"].mean, gspo["final_acc"].std) == pytest.approx((0.85, math.sqrt(0.005)))
    assert grpo["base_acc"].mean == pytest.approx(0.3) and grpo["base_acc"].std == pytest.approx(0.0)
    assert grpo["clip_frac"].mean == pytest.approx(0.01) and grpo["step_s"].mean == pytest.approx(0.5)
    assert grpo["routing_volatility"].mean is None and gspo["routing_volatility"].mean == pytest.approx(0.1)
    # the sampler/trainer mismatch: each run's mean over its steps, then over seeds (2e-3 and 4e-3)
    assert grpo["mismatch_kl"].mean is None and gspo["mismatch_kl"].mean == pytest.approx(3e-3)
    assert grpo["final_reward"].mean == pytest.approx(0.5)
    assert grpo["collapsed"] == 0 and result.broken == [] and result.warnings == []
    assert result.out_dir == root / "compare"
    md = (root / "compare" / "compare.md").read_text()
    # final acc 0.5, 0.6, 0.7: mean 0.6, s = 0.1, 95% CI 0.6 ± t(0.975, 2) · 0.1 / sqrt(3) = 0.6 ± 0.248
    assert grpo["final_acc"].ci == pytest.approx(4.302652729749464 * 0.1 / math.sqrt(3))
    assert "| grpo | 3 | 20 | 0.300±0.000 | 0.600 [0.352, 0.848] | 0.500 / 0.600 / 0.700 | — | 0.600 [0.352, 0.848] |" in md and "| — |" in md
    assert json.loads((root / "compare" / "compare.json").read_text())["rows"][1]["runs"] == 2
    # `--by algo` is `algo.name`
    assert [g.label for g in compare([root], by="algo.name", plot=False).groups] == ["grpo", "gspo"]


def test_groups_by_any_dotted_key(tmp_path):
    root = sweep(tmp_path)
    result = compare([root], by="algo.eps_low", plot=False)
    assert [g.label for g in result.groups] == ["eps_low=0.0003", "eps_low=0.2"]  # numeric order
    assert [r["runs"] for r in result.rows] == [2, 3]
    by_seed = compare([root], by="seed", plot=False)
    # the seed groups would mix algorithms: they are split by the algorithm, and that is said
    assert [g.label for g in by_seed.groups] == ["seed=0 grpo", "seed=0 gspo", "seed=1 grpo", "seed=1 gspo", "seed=2"]
    assert any(w.startswith("seed=0: its runs differ in algo.name, so they are 2 groups") for w in by_seed.warnings)


def test_steps_to_target(tmp_path):
    root = sweep(tmp_path)
    result = compare([root], plot=False)
    # base 0.3; best group-mean accuracy is gspo's 0.85 at step 20 -> target 0.3 + 0.5 * 0.55 = 0.575
    assert result.target == pytest.approx(0.575)
    grpo, gspo = result.rows
    # grpo finals 0.5, 0.6, 0.7 -> seeds 1 and 2 reach it at step 20; gspo both at step 20
    assert grpo["steps_to_target"].n == 2 and grpo["steps_to_target"].mean == pytest.approx(20)
    assert gspo["steps_to_target"].n == 2
    explicit = compare([root], threshold=0.4, plot=False)
    assert explicit.target == 0.4
    assert explicit.rows[0]["steps_to_target"].mean == pytest.approx(10)  # step-10 eval is 0.4
    assert "10±0 (3/3)" in (root / "compare" / "compare.md").read_text()


def series_run(rewards, loss=None) -> Run:
    steps = np.arange(1, len(rewards) + 1)
    metrics = {"reward/mean": (steps, np.asarray(rewards, dtype=float))}
    if loss is not None:
        metrics["train/loss"] = (steps, np.asarray(loss, dtype=float))
    return Run(Path("x"), {}, metrics)


def test_collapse_flag():
    rise = list(np.linspace(0.2, 0.8, 50))
    collapsed = series_run(rise + [0.05] * 50)
    reason, step = detect_collapse(collapsed)
    assert reason is not None and "did not recover" in reason
    assert 50 < step <= 60  # the moving average (window 10) crosses the half-way level soon after
    recovered = series_run(rise + [0.1] * 20 + [0.8] * 30)
    assert detect_collapse(recovered) == (None, None)
    steady = series_run(rise + [0.8] * 50)
    assert detect_collapse(steady) == (None, None)
    nan_reward = series_run(rise[:10] + [float("nan")] + rise[10:])
    assert detect_collapse(nan_reward) == ("non-finite reward/mean at step 11", 11)
    inf_loss = series_run(rise, loss=[0.1] * 30 + [float("inf")] * 20)
    assert detect_collapse(inf_loss)[1] == 31
    assert detect_collapse(series_run([0.5, 0.0, 0.0])) == (None, None)  # too short to judge
    assert detect_collapse(series_run([0.0] * 40)) == (None, None)  # flat at zero: no learning, no collapse
    # a drop in the last few steps only (shorter than the window) is not yet a collapse
    assert detect_collapse(series_run(rise + [0.8] * 45 + [0.0] * 5)) == (None, None)


def test_short_noisy_runs_are_not_collapsed():
    # 20 noisy steps around 0.4 (tiny batches), two low ones at the end: the old 2-step window
    # flagged this run ("fell from 0.55 to 0.15 at step 15")
    noisy = [0.4, 0.6, 0.2, 0.5, 0.3, 0.6, 0.2, 0.4, 0.7, 0.3, 0.5, 0.2, 0.6, 0.4, 0.3, 0.5, 0.2, 0.6, 0.1, 0.2]
    assert detect_collapse(series_run(noisy)) == (None, None)
    # window max(5, round(0.1 n)) = 5: runs under 15 steps are never judged by the moving average
    assert detect_collapse(series_run([0.8] * 10 + [0.0] * 4)) == (None, None)
    # ...but a clean collapse in 20 steps still counts: initial ma 0.68, peak 0.8, drop 0.5 * max(0.12, 0.4)
    # = 0.2, level 0.6; the window ending at step 9 averages 0.65, the one ending at step 10 0.5 < 0.6
    reason, step = detect_collapse(series_run([0.5, 0.6, 0.7, 0.8, 0.8, 0.8, 0.8, 0.8] + [0.05] * 12))
    assert "window 5" in reason and step == 10


def test_reward_noise_by_hand():
    from gspo.results.compare import reward_noise

    # |diffs| = 0.2, 0.2, 0.2, 0.6 -> median 0.2 -> sigma = 0.2 / (0.6745 * sqrt 2)
    assert reward_noise(np.array([0.1, 0.3, 0.1, 0.3, 0.9])) == pytest.approx(0.2 / (0.6745 * math.sqrt(2)))
    assert reward_noise(np.array([0.5])) == 0.0


def test_collapsed_runs_are_counted(tmp_path):
    root = tmp_path / "s"
    rise = list(np.linspace(0.2, 0.8, 10))
    make_run(root / "0", "grpo", 0, rewards=rise + [0.0] * 10)
    make_run(root / "1", "grpo", 1, rewards=rise[:5] + [float("nan")] * 15)
    make_run(root / "2", "grpo", 2, rewards=rise + [0.1] * 4 + [0.8] * 6)
    result = compare([root], plot=False)
    assert result.rows[0]["collapsed"] == 2
    assert "2/3" in (root / "compare" / "compare.md").read_text()
    assert [r.collapse is not None for r in result.groups[0].runs] == [True, True, False]
    # non-finite values are left out of the mean: step 6 averages seeds 0 and 2 only
    curve = result.groups[0].curve("reward/mean")
    assert curve.n[5] == 2 and curve.mean[5] == pytest.approx(rise[5])


def test_broken_run_dirs_are_listed_and_skipped(tmp_path):
    root = tmp_path / "s"
    make_run(root / "0", "grpo", 0)
    write_run(root / "1", BASE_CFG, lines=[])  # empty metrics
    (root / "1" / "metrics.jsonl").write_text("")
    write_run(root / "2", None, [{"step": 0, "eval/accuracy": 0.3}])  # no config
    write_run(root / "3", BASE_CFG)  # no metrics
    write_run(root / "4", BASE_CFG)
    (root / "4" / "metrics.jsonl").write_text("garbage\n{\"step\": 1}\n")
    write_run(root / "5")  # .hydra only: a resume's leftover (or a job refused before its run began): skipped quietly
    (root / "5" / "hydra_app.log").write_text("")
    write_run(root / "8")  # .hydra and something of ours, but no config or metrics: broken
    (root / "8" / "samples.jsonl").write_text("")
    make_run(root / "6", "grpo", 1)
    with (root / "6" / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 21, "reward/m')  # cut short by a crash: ignored with a note
    (root / "7" / "wandb").mkdir(parents=True)  # not run-like: not listed
    runs, broken = load_runs([root])
    assert [r.path.name for r in runs] == ["0", "6"]
    reasons = {b.path.name: b.reason for b in broken}
    assert set(reasons) == {"1", "2", "3", "4", "8"}
    assert "empty" in reasons["1"] and "config.yaml" in reasons["2"] and "metrics.jsonl" in reasons["3"]
    assert "line 1" in reasons["4"] and "not started" in reasons["8"]
    result = compare([root], plot=False)
    assert len(result.broken) == 5 and result.rows[0]["runs"] == 2
    assert not any("/5" in w for w in result.warnings)
    assert any("unreadable last line" in w for w in result.warnings)
    with pytest.raises(CompareError, match="does not exist"):
        compare([tmp_path / "nope"])
    with pytest.raises(CompareError, match="no readable run"):
        compare([root / "1", root / "3"])


def test_partial_runs(tmp_path):
    root = tmp_path / "s"
    make_run(root / "0", "gspo", 0, rewards=[0.2] * 20)
    make_run(root / "1", "gspo", 1, rewards=[0.4] * 8, acc={0: 0.3, 5: 0.35}, finished=False)
    result = compare([root], plot=False)
    curve = result.groups[0].curve("reward/mean")
    assert list(curve.n[:8]) == [2] * 8 and list(curve.n[8:]) == [1] * 12
    assert curve.mean[0] == pytest.approx(0.3) and curve.mean[-1] == pytest.approx(0.2)
    row = result.rows[0]
    assert (row["steps_min"], row["steps_max"], row["partial"]) == (8, 20, 1)
    assert (row["final_acc"].mean) == pytest.approx((0.5 + 0.35) / 2)
    assert any("partial" in w for w in result.warnings)
    assert "8–20 (1 partial)" in (root / "compare" / "compare.md").read_text()


def test_incomparable_runs_warn(tmp_path):
    root = tmp_path / "s"
    make_run(root / "0", "grpo", 0)
    make_run(root / "1", "gspo", 0, cfg={"rollout": {"group_size": 4}, "model": {"hidden_size": 128,
                                                                                   "attn_implementation": "eager"}})
    make_run(root / "2", "gspo", 1, cfg={"rollout": {"group_size": 4}, "train": {"lr": 3e-4}})
    result = compare([root], plot=False)
    [warning] = [w for w in result.warnings if "NOT comparable" in w]
    assert "rollout.group_size (8 ×1, 4 ×2)" in warning or "rollout.group_size (4 ×2, 8 ×1)" in warning
    assert "model.hidden_size" in warning and "attn_implementation" not in warning
    assert any(w.startswith("group gspo mixes runs that differ in model.hidden_size") is False
               and "train.lr" in w for w in result.warnings)
    # grouping by the differing key itself is not a warning about that key
    by_g = compare([root], by="rollout.group_size", plot=False)
    assert not any("rollout.group_size (" in w for w in by_g.warnings)


def test_a_mismatch_study_groups_by_run_name_and_its_treatments_are_not_budget(tmp_path):
    """Cells that differ in the sampler's precision, the old log-probs or a correction are a study's
    treatments, not a different rollout budget; `--by name` labels groups by the bare run name."""
    root = tmp_path / "s"
    make_run(root / "a0", "grpo", 0, cfg={"name": "grpo", "rollout": {"dtype": "bfloat16"}})
    make_run(root / "a1", "grpo", 1, cfg={"name": "grpo", "rollout": {"dtype": "bfloat16"}})
    make_run(root / "b0", "grpo", 0, cfg={"name": "grpo_icepop", "rollout": {"dtype": "bfloat16", "mask": "token"}})
    make_run(root / "b1", "grpo", 1, cfg={"name": "grpo_icepop", "rollout": {"dtype": "bfloat16", "mask": "token"}})
    make_run(root / "c0", "gspo", 0, cfg={"name": "gspo_sampler", "rollout": {"old_logprobs": "sampler",
                                                                             "dtype": "float16"}})
    make_run(root / "c1", "gspo", 1, cfg={"name": "gspo_sampler", "rollout": {"old_logprobs": "sampler",
                                                                             "dtype": "bfloat16"}})
    result = compare([root], by="name", baseline="grpo", plot=False)
    assert not any("NOT comparable" in w for w in result.warnings)
    # a treatment that differs inside one name splits it: never averaged as if it were seeds
    assert [g.label for g in result.groups] == ["grpo", "grpo_icepop", "gspo_sampler dtype=bfloat16",
                                                "gspo_sampler dtype=float16"]
    [split] = [w for w in result.warnings if "groups, not one" in w]
    assert split.startswith("gspo_sampler: its runs differ in rollout.dtype, so they are 2 groups")


def test_step0_eval_mismatch_warns(tmp_path):
    root = tmp_path / "s"
    make_run(root / "0", "grpo", 0, acc={0: 0.3, 20: 0.5})
    make_run(root / "1", "gspo", 0, acc={0: 0.4, 20: 0.5})
    assert any("step-0 eval/accuracy differs" in w for w in compare([root], plot=False).warnings)


def test_figures_and_report(tmp_path):
    root = sweep(tmp_path)
    make_run(root / "9", "grpo", 3, rewards=list(np.linspace(0.2, 0.8, 10)) + [0.0] * 10)  # collapsed seed
    out = tmp_path / "out"
    result = compare([root], out=out)
    assert [p.name for p in result.figures] == ["compare.png", "compare.svg"]
    assert all(p.stat().st_size > 1000 for p in result.figures)
    assert (out / "compare.md").exists() and "![comparison](compare.png)" in (out / "compare.md").read_text()
    from rich.console import Console

    console = Console(record=True, width=320)
    print_report(result, console, wide=True)
    text = console.export_text()
    assert "grpo" in text and "gspo" in text and "collapsed" in text and "compare.png" in text
    # brackets are text, not rich markup: the intervals and the legend survive
    assert "final acc [95% CI]" in text and "[lo, hi]" in text and "0.575 [" in text
    # a single run dir works too, clip fractions all zero (symlog keeps 0 visible)
    single = make_run(tmp_path / "one", "gspo", 0, extra={"clip/frac": 0.0, "clip/frac_low": 0.0,
                                                         "clip/frac_high": 0.0})
    assert compare(single).out_dir == single / "compare"


def test_aggregate_aligns_steps():
    a = Run(Path("a"), {}, {"m": (np.array([0, 2, 4]), np.array([1.0, 2.0, 3.0]))})
    b = Run(Path("b"), {}, {"m": (np.array([2, 3]), np.array([4.0, 5.0]))})
    curve = aggregate([a, b], "m")
    assert list(curve.steps) == [0, 2, 3, 4]
    assert list(curve.mean) == [1.0, 3.0, 5.0, 3.0] and list(curve.n) == [1, 2, 1, 1]
    assert curve.std[1] == pytest.approx(math.sqrt(2.0)) and curve.std[0] == 0.0
    assert aggregate([a, b], "missing") is None


def test_target_undefined_without_improvement(tmp_path):
    root = tmp_path / "s"
    make_run(root / "0", "grpo", 0, acc={0: 0.5, 20: 0.4})
    make_run(root / "1", "gspo", 0, acc={0: 0.5, 20: 0.5})
    result = compare([root], plot=False)
    assert result.target is None and "undefined" in result.target_note
    # best acc is the best *trained* accuracy: the step-0 base (0.5) does not count
    assert "| grpo | 1 | 20 | 0.500 | 0.400 | 0.400 | — |" in result.table_path.read_text()
    # a group node stands for its name: `--by model` groups by model.name
    assert [g.label for g in compare([root], by="model", plot=False).groups] == ["model=tiny-moe grpo",
                                                                                 "model=tiny-moe gspo"]


def test_groups_by_several_keys(tmp_path):
    make_run(tmp_path / "a", "grpo", 0, cfg={"moe": {"routing_replay": "none"}})
    make_run(tmp_path / "b", "grpo", 0, cfg={"moe": {"routing_replay": "R2"}})
    make_run(tmp_path / "c", "gspo", 0, cfg={"moe": {"routing_replay": "none"}})
    result = compare([tmp_path], by="algo,moe.routing_replay", plot=False)
    assert sorted(g.label for g in result.groups) == [
        "grpo routing_replay=R2", "grpo routing_replay=none", "gspo routing_replay=none"]


def test_best_acc_does_not_count_the_base(tmp_path):
    make_run(tmp_path / "0", "grpo", 0, acc={0: 0.9, 10: 0.5, 20: 0.6})
    make_run(tmp_path / "1", "grpo", 1, acc={0: 0.9})  # never evaluated after the base
    row = compare([tmp_path], plot=False).rows[0]
    assert row["best_acc"].values == (0.6,) and row["final_acc"].values == (0.6,)
    assert row["base_acc"].mean == pytest.approx(0.9)


def test_pairwise_against_a_baseline(tmp_path):
    root = sweep(tmp_path)  # grpo finals 0.5, 0.6, 0.7; gspo finals 0.8, 0.9
    result = compare([root], plot=False, baseline="grpo")
    [pair] = result.pairwise
    assert (pair.group, pair.baseline) == ("gspo", "grpo")
    w = pair.stats["final_acc"]
    # diff 0.85 - 0.6; va = 0.005/2, vb = 0.01/3; Welch df = (va + vb)^2 / (va^2/1 + vb^2/2)
    va, vb = 0.005 / 2, 0.01 / 3
    assert w.diff == pytest.approx(0.25) and w.df == pytest.approx((va + vb) ** 2 / (va**2 + vb**2 / 2))
    assert (w.n_a, w.n_b) == (2, 3)
    md = result.table_path.read_text()
    assert "Against the baseline `grpo`" in md and f"| gspo | 2 / 3 | +0.250 [{w.low:+.3f}, {w.high:+.3f}] (df {w.df:.1f})" in md
    saved = json.loads((root / "compare" / "compare.json").read_text())
    assert saved["baseline"] == "grpo" and saved["pairwise"][0]["final_acc"]["diff"] == pytest.approx(0.25)
    with pytest.raises(CompareError, match=r"--baseline grpoo: no such group.*grpo, gspo"):
        compare([root], plot=False, baseline="grpoo")


def test_several_comparisons_get_intervals_that_hold_together(tmp_path):
    """With m groups against the baseline, the family column is Welch's interval at 1 - 0.05 / m (Bonferroni):
    here m = 2, so t at 0.9875 instead of 0.975, and the same Welch df."""
    from gspo.results.stats import t_quantile

    root = sweep(tmp_path)  # grpo finals 0.5, 0.6, 0.7; gspo finals 0.8, 0.9
    make_run(root / "9", "dapo", 0, acc={0: 0.3, 20: 0.55})
    make_run(root / "10", "dapo", 1, acc={0: 0.3, 20: 0.75})
    result = compare([root], plot=False, baseline="grpo")
    for pair in result.pairwise:
        one, family = pair.stats["final_acc"], pair.stats["final_acc_family"]
        assert family.diff == one.diff and family.df == one.df
        assert family.half_width == pytest.approx(one.half_width * t_quantile(1 - 0.025 / 2, one.df)
                                                  / t_quantile(0.975, one.df))
    gspo = next(p for p in result.pairwise if p.group == "gspo").stats["final_acc_family"]
    assert f"| +0.250 [{gspo.low:+.3f}, {gspo.high:+.3f}] (df {gspo.df:.1f}) |" in result.table_path.read_text()
    [alone] = compare([root / "0", root / "3", root / "4", root / "1", root / "2"], plot=False,
                      baseline="grpo", out=tmp_path / "two").pairwise  # one comparison: the same as the 95% one
    assert alone.stats["final_acc_family"].half_width == pytest.approx(alone.stats["final_acc"].half_width)


def test_the_table_gives_each_seed_and_one_evaluations_binomial_error(tmp_path):
    """final acc by seed: in seed order; eval SE: sqrt(p (1 - p) / n) at the final evaluation, n its eval/n,
    averaged over the runs that logged it."""
    for seed, final, n in ((2, 0.5, 100), (0, 0.25, 48), (1, 0.75, None)):
        run = make_run(tmp_path / f"s{seed}", "grpo", seed, acc={0: 0.3, 20: final})
        if n is not None:
            lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            for line in lines:
                if "eval/accuracy" in line:
                    line["eval/n"] = n
            (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = compare([tmp_path], plot=False)
    [row] = result.rows
    assert row["final_by_seed"] == [(0, 0.25), (1, 0.75), (2, 0.5)]
    se = (math.sqrt(0.25 * 0.75 / 48) + math.sqrt(0.5 * 0.5 / 100)) / 2
    assert row["final_eval_se"].mean == pytest.approx(se) and row["final_eval_se"].n == 2
    assert f"| 0.250 / 0.750 / 0.500 | {se:.3f} |" in result.table_path.read_text()


def test_the_table_counts_the_completions_each_run_sampled(tmp_path):
    """completions: per training step the groups drawn (sampling/groups_drawn, logged where dynamic sampling redraws)
    or prompts_per_step, times group_size, summed over the steps; mean over runs."""
    make_run(tmp_path / "grpo", "grpo", 0, steps=5)  # 5 steps x 16 prompts x G=8
    drawn = [16, 48, 32, 64, 16]  # a DAPO-like run that redrew on some steps
    dapo = make_run(tmp_path / "dapo", "dapo", 0, steps=5)
    lines = [json.loads(line) for line in (dapo / "metrics.jsonl").read_text().splitlines()]
    for line in lines[1:]:
        line["sampling/groups_drawn"] = drawn[line["step"] - 1]
    (dapo / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    rows = {r["group"]: r for r in compare([tmp_path], plot=False).rows}
    assert rows["grpo"]["completions"].mean == 5 * 16 * 8 == 640
    assert rows["dapo"]["completions"].mean == 8 * sum(drawn) == 1408


def test_compare_cli_baseline(tmp_path):
    from typer.testing import CliRunner

    from cli.main import app

    root = sweep(tmp_path)
    res = CliRunner().invoke(app, ["compare", str(root), "--baseline", "gspo"])
    assert res.exit_code == 0, res.output
    assert "against gspo" in res.output and "Welch" in res.output
    wide = CliRunner().invoke(app, ["compare", str(root), "--baseline", "gspo", "--wide"])
    assert wide.exit_code == 0 and "against the baseline gspo" in wide.output and "P(improvement)" in wide.output
    res = CliRunner().invoke(app, ["compare", str(root), "--baseline", "nope"])
    assert res.exit_code == 2 and "no such group" in res.output and "Traceback" not in res.output


def test_figure_bands_stay_in_range_units_match_the_table_and_styles_are_labelled(tmp_path):
    """Routing volatility near 0 with a wide spread: its band stops at 0; fractions are shown in % as the
    table shows them; the KL and clip panels say which line style is which metric."""
    from matplotlib.collections import PolyCollection

    from gspo.results.groups import Stat
    from gspo.results.plots import figure
    from gspo.results.report import COLUMNS

    root = tmp_path / "runs"
    for seed, vol in ((0, 0.001), (1, 0.2), (2, 0.0)):
        make_run(root / f"g{seed}", algo="grpo", seed=seed, steps=6,
                 extra={"moe/routing_volatility": vol, "kl/ref": 0.002 * seed})
    fig = figure(compare([root], plot=False).groups)
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    vol = panels["moe/routing_volatility (% of expert choices)"]
    band = next(c for c in vol.collections if isinstance(c, PolyCollection))
    ys = np.concatenate([p.vertices[:, 1] for p in band.get_paths()])
    assert ys.min() >= 0.0 and ys.max() == pytest.approx(100 * (0.067 + np.std([0.001, 0.2, 0.0], ddof=1)), rel=1e-2)
    assert max(max(line.get_ydata()) for line in vol.get_lines()) == pytest.approx(20.0)  # 0.2 shown as 20 %
    row = {"routing_volatility": Stat.of([0.2]), "clip_frac": Stat.of([0.01])}
    cells = dict((name, cell) for name, cell in COLUMNS)
    assert cells["routing vol."](row) == "20%" and cells["clip/frac"](row) == "1%"  # the table's unit: % too
    assert "kl/ref (k3, to the reference; β > 0)" in panels and "kl/old (k3, to the rollout policy)" in panels
    clip = panels["clip fraction (% of tokens)"]
    assert len(clip.get_legend().get_texts()) == 3
    assert panels["eval/accuracy (held-out, fraction)"].get_legend() is None


def test_a_group_never_averages_runs_that_differ_beyond_the_seed(tmp_path):
    """A sweep over algo.eps_high (or algo.loss, or hardware.dtype) is not one group of 6 "seeds": each config is
    its own group, named by what differs. (Before: one "grpo" group of 6 seeds, no warning.)"""
    root = tmp_path / "s"
    for i, (eps, seed) in enumerate([(0.2, 0), (0.2, 1), (0.2, 2), (0.28, 0), (0.28, 1), (0.28, 2)]):
        make_run(root / str(i), "grpo", seed, cfg={"algo": {"name": "grpo", "eps_high": eps}})
    result = compare([root], plot=False)
    assert [(g.label, len(g.runs)) for g in result.groups] == [("grpo eps_high=0.2", 3), ("grpo eps_high=0.28", 3)]
    assert any("grpo: its runs differ in algo.eps_high" in w for w in result.warnings)
    root = tmp_path / "d"
    for i, dtype in enumerate(["float32", "float32", "bfloat16", "bfloat16"]):
        make_run(root / str(i), "grpo", i % 2, cfg={"hardware": {"dtype": dtype, "threads": 1 + i}})
    assert [g.label for g in compare([root], plot=False).groups] == ["grpo dtype=bfloat16", "grpo dtype=float32"]


def test_the_collapse_flag_has_a_measured_false_positive_rate_on_null_series():
    """Trendless binary rewards, 16 a step: flagged at most 1% of the time (docs/compare.md has the full table,
    `python scripts/collapse_rates.py`). Before, with p = 0.02, the noise estimate was 0 (most steps' means
    are all 0) and 362 of 1,000 runs of 30 steps were flagged collapsed. A real collapse is still caught."""
    import sys

    sys.path.insert(0, str(REPO / "scripts"))
    from collapse_rates import collapse_curve, flagged, simulated_run

    rng = np.random.default_rng(0)
    for p in (0.02, 0.1, 0.5):
        for steps in (30, 60):
            assert flagged(simulated_run(rng, np.full(steps, p)) for _ in range(500)) <= 0.01, (p, steps)
    assert flagged(simulated_run(rng, collapse_curve(200, 0.6, 0.05)) for _ in range(100)) >= 0.95


def test_a_run_whose_metrics_go_past_its_finished_summary_is_partial(tmp_path):
    """summary.json from an older gspo says finished at step 10; metrics.jsonl goes to 15 (a resume to 20 that
    died): partial, and said."""
    run = make_run(tmp_path / "r", steps=15, cfg={"train": {"steps": 20}})
    (run / "summary.json").write_text(json.dumps({"status": "finished", "steps": 10}))
    result = compare([tmp_path / "r"], plot=False)
    assert result.rows[0]["partial"] == 1
    assert any("says finished at step 10 but metrics.jsonl goes to step 15" in w for w in result.warnings)


def test_best_acc_and_steps_to_target_need_one_eval_schedule(tmp_path):
    """Two groups of equal true accuracy evaluated every 2 and every 20 steps differ in best acc by chance alone
    (the finer schedule has more chances at a high point): best acc and steps to target are left out, said."""
    root = tmp_path / "s"
    for seed in range(3):
        make_run(root / f"a{seed}", "grpo", seed, cfg={"eval": {"every": 2}})
        make_run(root / f"b{seed}", "gspo", seed, cfg={"eval": {"every": 20}})
    result = compare([root], baseline="grpo", plot=False)
    assert any(w.startswith("best acc and steps to target are left out") for w in result.warnings)
    assert all(r["best_acc"].n == 0 and r["steps_to_target"].n == 0 for r in result.rows)
    assert result.rows[0]["final_acc"].n == 3


def test_the_figure_says_what_a_line_on_zero_and_a_hidden_curve_are(tmp_path):
    """The figure a paper takes as it is: kl/ref and kl/old on panels of their own (kl/old was a flat line under
    kl/ref's scale), the clip panel's style legend under the axes (it sat on the data), a clip fraction of 0 said
    in words (on the symlog axis it read like missing data), groups whose curves coincide named (one hid the
    other), and a free panel slot holding the group legend instead of staying empty."""
    from gspo.results.compare import group_runs
    from gspo.results.plots import figure

    root = tmp_path / "s"
    same = [0.1 + 0.01 * t for t in range(20)]
    for seed in (0, 1):
        make_run(root / f"a{seed}", "grpo", seed, rewards=same,
                 extra={"clip/frac": 0.0, "clip/frac_low": 0.0, "clip/frac_high": 0.0, "kl/ref": 0.02})
        make_run(root / f"b{seed}", "gspo", seed, rewards=same, extra={"kl/ref": 0.02})
    fig = figure(group_runs(load_runs([root])[0], "algo.name"))
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert "kl/ref (k3, to the reference; β > 0)" in axes and "kl/old (k3, to the rollout policy)" in axes
    clip = axes["clip fraction (% of tokens)"]
    (anchor_y,) = {clip.get_legend().get_bbox_to_anchor().transformed(clip.transAxes.inverted()).y0}
    assert anchor_y < 0  # under the panel, off the data
    texts = lambda ax: " ".join(t.get_text() for t in ax.texts)  # noqa: E731
    assert "0 at every step: grpo" in texts(clip)
    assert "grpo and gspo coincide" in texts(axes["reward/mean"])
    spare = [ax for ax in fig.axes if not ax.get_title() and ax.get_legend() is not None]
    assert len(spare) == 1 and "grpo (n=2)" in [t.get_text() for t in spare[0].get_legend().get_texts()]


def test_the_staleness_figure_reads_each_cell_at_each_k(tmp_path, capsys):
    """scripts/plot_staleness.py: a run's cell is its name less `_k<K>`, its K its config's; final acc per run
    (the last eval after step 0), mean and t interval per (cell, K); an unfinished run is left out."""
    import sys

    sys.path.insert(0, str(REPO / "scripts"))
    from plot_staleness import cells, main

    finals = {("grpo", 0): [0.5, 0.7], ("grpo", 4): [0.2, 0.4], ("gspo_sampler", 4): [0.6, 0.6]}
    for (cell, k), accs in finals.items():
        for seed, a in enumerate(accs):
            make_run(tmp_path / f"{cell}_k{k}" / f"seed{seed}", seed=seed, acc={0: 0.3, 10: 0.9, 20: a},
                     cfg={"name": f"{cell}_k{k}", "rollout": {"staleness": k}})
    make_run(tmp_path / "grpo_k0" / "seed2", seed=2, acc={0: 0.3, 20: 0.0}, finished=False,
             cfg={"name": "grpo_k0", "rollout": {"staleness": 0}})
    data, bases, lengths = cells(str(tmp_path))
    assert data == {"grpo": {0: [0.5, 0.7], 4: [0.2, 0.4]}, "gspo_sampler": {4: [0.6, 0.6]}}
    assert bases == [0.3] * 6 and lengths == {20}
    main(str(tmp_path), str(tmp_path / "f.png"))
    out = capsys.readouterr().out
    # t_{0.975, 1} = 12.706 x s / sqrt(2), s = 0.1414: half-width 1.271
    assert "| grpo | 0.600 ± 1.271 (2) | 0.300 ± 1.271 (2) |" in out and "| gspo_sampler | — | 0.600 ± 0.000 (2) |" in out
    assert (tmp_path / "f.png").stat().st_size > 0


def test_the_cell_figure_reads_final_accuracy_and_mean_curves(tmp_path, capsys):
    """scripts/plot_cells.py: runs grouped by `name`, unfinished ones left out; final acc per cell with its t
    interval; an --over metric's curve is the mean over the cell's seeds at the steps every seed logged (step 0
    left out), and a cell where some seed never logged it has no curve."""
    import sys

    sys.path.insert(0, str(REPO / "scripts"))
    from plot_cells import finished_cells, main, mean_curve

    for seed, (scale, final) in enumerate([(0.1, 0.5), (0.3, 0.7)]):
        make_run(tmp_path / "a" / f"seed{seed}", seed=seed, steps=4, rewards=[scale * t for t in range(1, 5)],
                 acc={0: 0.3, 4: final}, cfg={"name": "a"}, extra={"rollout/mismatch_kl": 1e-4 * (seed + 1)})
    make_run(tmp_path / "b" / "seed0", seed=0, steps=4, acc={0: 0.3, 4: 0.6}, cfg={"name": "b"})
    make_run(tmp_path / "b" / "seed1", seed=1, steps=4, acc={0: 0.3, 4: 0.0}, cfg={"name": "b"}, finished=False)
    cells = finished_cells(str(tmp_path))
    assert sorted(cells) == ["a", "b"] and len(cells["b"]) == 1
    steps, values = mean_curve(cells["a"], "reward/mean")
    assert steps.tolist() == [1, 2, 3, 4] and np.allclose(values, [0.2, 0.4, 0.6, 0.8])
    assert mean_curve(cells["b"], "rollout/mismatch_kl") is None
    main(str(tmp_path), str(tmp_path / "f.png"), ["rollout/mismatch_kl", "reward/mean"], None, smooth=2)
    out = capsys.readouterr().out
    # t_{0.975, 1} = 12.706 x s / sqrt(2), s = 0.1414: half-width 1.271
    assert "| a | 2 | 0.600 [-0.671, 1.871] |" in out and "| b | 1 | — |" in out
    assert (tmp_path / "f.png").stat().st_size > 0


def test_the_critic_of_a_ppo_group_is_tabulated(tmp_path):
    """A ppo / grpo sweep: the critic's metrics get a table of their own, for the group that logs them
    (value loss and value clip: means over the steps; explained variance: the last 10% of steps)."""
    root = tmp_path / "sweep"
    for seed in (0, 1):
        make_run(root / f"grpo{seed}", "grpo", seed)
        ev = [0.1 * t / 20 for t in range(1, 21)]  # 0.005 .. 0.1; the last 2 steps: 0.095, 0.1
        lines = [{"critic/value_loss": 0.02 + seed * 0.02, "critic/value_mean": 0.3, "critic/clip_frac": 0.1,
                  "critic/explained_variance": e} for e in ev]
        run = make_run(root / f"ppo{seed}", "ppo", seed)
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r | (lines[r["step"] - 1] if r["step"] else {})) + "\n"
                                                   for r in rows))
    result = compare([root], out=tmp_path / "out", plot=False)
    ppo = next(r for r in result.rows if r["group"] == "ppo")
    assert ppo["value_loss"].mean == pytest.approx(0.03) and ppo["explained_variance"].mean == pytest.approx(0.0975)
    assert next(r for r in result.rows if r["group"] == "grpo")["value_loss"].mean is None
    md = (tmp_path / "out" / "compare.md").read_text()
    critic = md[md.index("## Critic"):]
    assert "| ppo | 0.03±0.0141 | 0.098±0.000 | 0.3±0 | 10%±0% |" in critic and "| grpo |" not in critic.split("\n\n")[1]


@pytest.fixture
def shared_dir():
    """A directory every user may enter and write (tmp_path is its owner's alone), removed afterwards."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="gspo-shared-"))
    path.chmod(0o777)
    yield path
    for p in [path, *path.rglob("*")]:  # (what the test made unreadable, readable again to be removed)
        p.chmod(0o777)
    shutil.rmtree(path)


AS_COLLEAGUE = """
import contextlib, io, os, sys
from cli.main import app
with contextlib.redirect_stdout(io.StringIO()):  # every module `gspo compare` imports, imported while it can be
    app(["compare", os.environ["GSPO_WARM_UP"]], standalone_mode=False)
if os.geteuid() == 0:  # (nobody may not enter /root, where this Python may live: hence after the imports)
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
app(sys.argv[1:], prog_name="gspo")
"""


def as_colleague(*args: str, cwd: Path):
    """`gspo ARGS` as another user would run it: as root (which reads any file), as nobody once gspo is imported;
    otherwise as this user, from whom chmod 000 hides a file as it hides it from anyone."""
    import os
    import subprocess
    import sys

    root = str(REPO)
    make_run(cwd / "warm-up", "grpo")
    env = {**os.environ, "PYTHONPATH": root, "MPLCONFIGDIR": str(cwd / ".mpl"), "GSPO_WARM_UP": str(cwd / "warm-up")}
    return subprocess.run([sys.executable, "-c", AS_COLLEAGUE, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_a_run_whose_files_cannot_be_read_is_skipped_with_a_line_naming_them(shared_dir):
    """A colleague's runs on a shared results directory, some of whose files this user may not read (written
    owner-only by an older gspo: summary.json, a rewritten metrics.jsonl; or the run directory itself): `gspo
    compare` compares what it can read and lists each of the others as skipped, naming the file and the error,
    where it used to end in a PermissionError traceback (or, for a directory, leave the run out without a word);
    given only such a run, one line and exit code 2. The denial is the kernel's, not a stand-in's."""
    root = shared_dir / "sweep"
    for job in range(4):
        make_run(root / str(job), "grpo", seed=job)
    (root / "1" / "summary.json").chmod(0)
    (root / "2" / "metrics.jsonl").chmod(0)
    (root / "3").chmod(0)
    root.chmod(0o777)  # (the figure and table are written into SWEEP/compare)
    res = as_colleague("compare", str(root), cwd=shared_dir)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stdout[-3000:] + res.stderr[-3000:]
    skipped = {line.split(": ", 1)[0].split("/")[-1]: line for line in res.stdout.splitlines()
               if line.startswith("skipped")}
    assert sorted(skipped) == ["1", "2", "3"], res.stdout
    assert "cannot read summary.json (Permission denied)" in skipped["1"]
    assert "cannot read metrics.jsonl (Permission denied)" in skipped["2"]
    assert "cannot read the directory (Permission denied)" in skipped["3"]
    alone = as_colleague("compare", str(root / "1"), cwd=shared_dir)
    out = alone.stdout + alone.stderr
    assert alone.returncode == 2 and "Traceback" not in out, out[-3000:]
    assert out.strip().splitlines() == [out.strip()] and out.startswith("gspo: error: no readable run directory")
    assert "summary.json (Permission denied)" in out


def _three_seeds_each(tmp_path: Path, machine=None) -> Path:
    """grpo finals 0.5, 0.6, 0.7 and gspo finals 0.55, 0.70, 0.75 on seeds 0-2 (`machine`: seed -> summary machine
    of the gspo run, else one machine for all)."""
    root = tmp_path / "sweep"
    one = {"cpu": "CPU A", "cpu_id": "GenuineIntel 6/207/2", "cpu_flags": "avx2 avx512f amx_bf16"}
    for i, (algo, seed, final) in enumerate([("grpo", 0, 0.5), ("grpo", 1, 0.6), ("grpo", 2, 0.7),
                                             ("gspo", 0, 0.55), ("gspo", 1, 0.70), ("gspo", 2, 0.75)]):
        run = make_run(root / str(i), algo, seed, acc={0: 0.3, 20: final})
        here = (machine or {}).get(seed, one) if algo == "gspo" else one
        summary = json.loads((run / "summary.json").read_text())
        (run / "summary.json").write_text(json.dumps({**summary, "machine": here}))
    return root


def test_a_comparison_pairs_seeds_states_its_power_and_the_seeds_a_difference_needs(tmp_path):
    """The final accuracy's difference paired by seed: d = 0.05, 0.10, 0.05; mean 0.0667; s_d = sqrt((0.0167² +
    0.0333² + 0.0167²) / 2) = 0.02887; half-width t(0.975, 2) = 4.3027 x 0.02887 / sqrt(3) = 0.07172. The smallest
    difference detectable at 80% power: stats.detectable at the pooled std (sqrt((0.01 + 0.010833) / 2) = 0.10206)
    and 3 seeds a group, and at s_d over 3 pairs; --power 0.05: the seeds that needs."""
    from gspo.results.stats import detectable, seeds_needed

    result = compare([_three_seeds_each(tmp_path)], plot=False, baseline="grpo", power=0.05)
    [pair] = result.pairwise
    assert pair.paired.diff == pytest.approx(0.2 / 3) and pair.paired.n == 3
    assert pair.paired.sd == pytest.approx(0.0288675, rel=1e-5)
    assert pair.paired.half_width == pytest.approx(4.302653 * 0.0288675 / math.sqrt(3), rel=1e-5)
    assert pair.detectable == pytest.approx(detectable(math.sqrt((0.01 + 0.0108333) / 2), 3), rel=1e-4)
    assert pair.detectable_paired == pytest.approx(detectable(0.0288675, 3, paired=True), rel=1e-4)
    assert pair.seeds_needed == seeds_needed(0.05, math.sqrt((0.01 + 0.0108333) / 2))
    assert pair.seeds_needed_paired == seeds_needed(0.05, 0.0288675, paired=True)
    assert pair.improvement.estimate == pytest.approx(6.5 / 9)  # gspo above grpo in 6 of 9 pairs, 1 tie (0.70)
    md = result.table_path.read_text()
    assert f"+0.067 [{pair.paired.low:+.3f}, {pair.paired.high:+.3f}] (3 pairs)" in md
    assert "seeds for Δ = 0.05 at 80% power (unpaired / paired)" in md
    saved = json.loads((result.out_dir / "compare.json").read_text())["pairwise"][0]
    assert saved["paired"]["n"] == 3 and saved["seeds_needed_paired"] == pair.seeds_needed_paired
    with pytest.raises(CompareError, match="--power needs --baseline"):
        compare([tmp_path / "sweep"], plot=False, power=0.05)


def test_runs_on_other_machines_are_said_and_no_pair_crosses_machines(tmp_path):
    """gspo's seed 1 ran on another CPU: the group mixes machines, seed 1's arms do too (both said), and the paired
    difference leaves seed 1 out (two pairs: 0.05, 0.05)."""
    other = {"cpu": "CPU B", "cpu_id": "AuthenticAMD 23/49/0", "cpu_flags": "avx2"}
    result = compare([_three_seeds_each(tmp_path, {1: other})], plot=False, baseline="grpo")
    said = " | ".join(result.warnings)
    assert "group gspo: its runs ran on 2 machines" in said and "seed 1: its arms ran on different machines" in said
    [pair] = result.pairwise
    assert pair.paired.n == 2 and pair.paired.diff == pytest.approx(0.05)
    assert "CPU B (AuthenticAMD 23/49/0, avx2) x1" in result.table_path.read_text()


def test_the_same_problems_are_compared_problem_by_problem(tmp_path):
    """Each run's last heldout.jsonl line: grpo's runs answer problem 0 of 4, gspo's problems 0 and 1; the
    difference on the same problems is 1/4, over 4 problems."""
    root = _three_seeds_each(tmp_path)
    for run in sorted(root.iterdir()):
        algo = OmegaConf.load(run / "config.yaml").algo.name
        correct = "1000" if algo == "grpo" else "1100"
        (run / "heldout.jsonl").write_text(json.dumps({"step": 0, "n": 4, "problems": "abc", "correct": "0000"}) + "\n"
                                           + json.dumps({"step": 20, "n": 4, "problems": "abc", "correct": correct})
                                           + "\n")
    [pair] = compare([root], plot=False, baseline="grpo").pairwise
    assert pair.problems_n == 4 and pair.problems.estimate == pytest.approx(0.25)
    assert pair.problems.low <= 0.25 <= pair.problems.high


@pytest.mark.parametrize("width", [80, 120])
def test_the_console_table_fits_the_terminal_with_every_number_whole(tmp_path, width):
    """The brief table (what a reader decides from) in an 80- and a 120-column terminal: no line wider, every cell
    whole on one line; --wide prints every column of compare.md."""
    import io

    from rich.console import Console

    from gspo.results.report import brief_table

    result = compare([_three_seeds_each(tmp_path)], plot=False, baseline="grpo")
    console = Console(width=width, file=io.StringIO(), force_terminal=False)
    print_report(result, console)
    out = console.file.getvalue()
    assert max(len(line) for line in out.splitlines()) <= width
    names, cells = brief_table(result, width)
    table = [line for line in out.splitlines() if "grpo" in line or "gspo" in line]
    assert names[:4] == ["group", "seeds", "final acc % [95%]", "Δ points [95%]"]
    for row in cells:
        assert any(all(cell in line for cell in row) for line in table), row
    wide = Console(width=width, file=io.StringIO(), force_terminal=False)
    print_report(result, wide, wide=True)
    assert "clip low / high" in wide.file.getvalue() or "clip low" in wide.file.getvalue()


def test_the_table_counts_kl_old_spikes_and_the_routing_mismatch(tmp_path):
    """`kl/old > 0.1`: the runs with a training step past 0.1 (of those that logged kl/old) and their steps in all;
    `routing mismatch`: the mean share of (token, layer) expert sets the sampler and the trainer disagree on."""
    from gspo.results.report import COLUMNS

    make_run(tmp_path / "a", seed=0, steps=6, extra={"kl/old": 0.5, "rollout/routing_mismatch": 0.04})
    make_run(tmp_path / "b", seed=1, steps=6, extra={"rollout/routing_mismatch": 0.06})  # kl/old 1e-3: no spike
    make_run(tmp_path / "c", algo="gspo", seed=0, steps=6)  # no routing mismatch logged: "—"
    rows = {r["group"]: r for r in compare([tmp_path], plot=False).rows}
    cells = dict(COLUMNS)
    grpo = next(r for g, r in rows.items() if "grpo" in g)
    gspo = next(r for g, r in rows.items() if "gspo" in g)
    assert cells["kl/old > 0.1"](grpo) == "1/2 (6 steps)"
    assert cells["routing mismatch"](grpo) == "5%±1.41%" and cells["routing mismatch"](gspo) == "—"  # mean ± std
    assert cells["kl/old > 0.1"](gspo) == "0/1 (0 steps)"


def test_p_improvement_needs_two_seeds_a_side():
    """With one seed on a side the bootstrap resamples that seed alone: an interval of zero width, which would read
    as certainty. The table shows a dash there, as for the other intervals, and the estimate from 2 seeds a side."""
    from gspo.results.groups import Pairwise
    from gspo.results.report import PAIR_COLUMNS
    from gspo.results.stats import prob_improvement

    cell = dict(PAIR_COLUMNS)["P(improvement) [95%]"]
    one = Pairwise("a", "b", {}, improvement=prob_improvement([0.3], [0.4]))
    assert cell(one, {"a": 1, "b": 1}) == "— (needs ≥ 2 seeds in both groups)"
    assert cell(one, {"a": 2, "b": 1}) == "— (needs ≥ 2 seeds in both groups)"
    two = Pairwise("a", "b", {}, improvement=prob_improvement([0.3, 0.5], [0.4, 0.2]))
    assert cell(two, {"a": 2, "b": 2}).startswith("0.75 [")  # 0.3 > 0.2, 0.5 > 0.4, 0.5 > 0.2: 3 of 4 pairs
