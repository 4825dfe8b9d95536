"""A run directory is always consistent: resume continues exactly (even after kill -9:
tests/contracts/test_resume_equals_uninterrupted.py) or says why not, summary.json is true after any stop; and the
loop's own defects found in review stay fixed."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from gspo.config.loading import compose
from gspo.train.loop.trainer import train
from gspo.train.run import checkpoint
from tests.conftest import child_env, tiny

NOISY = ("time/", "throughput/")  # wall-clock metrics differ between any two runs


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def steady(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(NOISY)} for r in rows]


def opts(cache_dir, **extra) -> list[str]:
    return tiny(cache_dir, **{"train.steps": 6, "train.checkpoint_every": 1, "hardware.threads": 1, **extra})


def test_resuming_a_finished_run_changes_nothing(tmp_path, cache_dir, capsys):
    cfg = compose(tiny(cache_dir))
    first = train(cfg, tmp_path)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    cfg.resume = str(tmp_path)
    again = train(cfg, tmp_path)
    assert "already finished" in capsys.readouterr().out
    assert again == first
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()} == before


def test_resume_before_the_first_checkpoint_starts_over(tmp_path, cache_dir, capsys):
    """A run killed before its first checkpoint: metrics are not appended to (steps 0,1,2,0,1,2)."""
    cfg = compose(tiny(cache_dir, **{"train.checkpoint_every": 100, "train.steps": 3}))
    train(cfg, tmp_path)
    for p in (tmp_path / "checkpoints").iterdir():  # as if killed before the end: metrics, but no checkpoint
        import shutil

        shutil.rmtree(p)
    cfg.resume = str(tmp_path)
    train(cfg, tmp_path)
    assert "restarting it from step 0" in capsys.readouterr().out
    assert [m["step"] for m in metrics(tmp_path)] == [0, 1, 2, 3]


def test_warmup_counts_rl_steps_and_train_lr_is_the_rate_the_step_used(tmp_path, cache_dir, monkeypatch):
    """train/lr at step s is the rate AdamW stepped with during step s: min(1, s / warmup) * lr."""
    lr, warmup = 1e-3, 4
    used = []
    step = torch.optim.AdamW.step

    def spy(self, *a, **k):
        used.append(self.param_groups[0]["lr"])
        return step(self, *a, **k)

    # the warm-started base made first: run alone, this test would otherwise count the warm start's own AdamW steps
    train(compose(tiny(cache_dir, **{"train.steps": 1})), tmp_path / "base")
    monkeypatch.setattr(torch.optim.AdamW, "step", spy)
    cfg = compose(tiny(cache_dir, **{"train.steps": 5, "train.lr": lr, "train.warmup_steps": warmup}))
    train(cfg, tmp_path / "run")
    logged = [m["train/lr"] for m in metrics(tmp_path / "run")[1:]]
    assert logged == pytest.approx([lr * min(1.0, s / warmup) for s in range(1, 6)])
    assert logged == pytest.approx(used[::2])  # 2 minibatches a step: 2 optimizer steps at the step's rate


def _dapo_score(n_correct_in_group):
    """A stand-in scorer: rewards differ within every group (0, 0.1, 0, 0.1, ...), the task's verdict never does."""
    def score(task, cfg, texts, rows, ill_formed=None, **kwargs):
        n = len(texts)
        return torch.arange(n, dtype=torch.float32) % 2 * 0.1, {"correct": torch.full((n,), n_correct_in_group),
                                                                 "format": torch.ones(n)}
    return score


def test_dynamic_sampling_filters_on_the_rewards_the_advantages_use(tmp_path, cache_dir, monkeypatch):
    """DAPO keeps a group whose rewards differ (its advantages are not 0), whatever the task's verdict says;
    algo.filter_metric=correct filters on the verdict instead (the DAPO paper's accuracy)."""
    import gspo.rollout.batch as batch

    monkeypatch.setattr(batch, "score", _dapo_score(0.0))
    train(compose(tiny(cache_dir, algo="dapo", **{"train.steps": 1, "algo.overlong_buffer": 0})), tmp_path / "reward")
    step = metrics(tmp_path / "reward")[1]
    assert step["sampling/groups_dropped"] == 0 and step["sampling/groups_kept"] == 4 and step["sampling/batches"] == 1
    with pytest.warns(UserWarning, match="dynamic sampling kept 0 .* all-equal 'correct' values"):
        train(compose(tiny(cache_dir, algo="dapo", **{"train.steps": 1, "algo.filter_metric": "correct"})),
              tmp_path / "correct")
    step = metrics(tmp_path / "correct")[1]
    assert step["sampling/groups_kept"] == 0 and step["sampling/groups_dropped"] == step["sampling/groups_drawn"]


def test_dapo_logs_rewards_over_everything_sampled(tmp_path, cache_dir):
    """reward/mean is over every completion drawn (the population every algorithm reports); the kept groups'
    mean is sampling/kept_reward_mean."""
    import gspo.rollout.batch as trainer  # where the loop's scoring happens

    seen = []
    real = trainer.score

    def spy(*a, **k):
        r, parts = real(*a, **k)
        seen.append(r)
        return r, parts

    trainer.score = spy
    try:
        train(compose(tiny(cache_dir, algo="dapo", **{"train.steps": 1, "algo.max_sample_batches": 3})), tmp_path)
    finally:
        trainer.score = real
    step = metrics(tmp_path)[1]
    everything = torch.cat(seen)
    assert step["sampling/batches"] == len(seen)
    # the score before DAPO's overlong penalty is reward/tinyzero/mean; reward/mean adds the penalty
    assert step["reward/tinyzero/mean"] == pytest.approx(everything.mean().item())
    assert step["reward/mean"] == pytest.approx(everything.mean().item() + step["reward/overlong/mean"])
    assert "sampling/kept_reward_mean" in step


def test_r3_old_policy_pass_routes_as_the_sampler_did(cache_dir):
    """Under R3 the old-policy log-probs are computed with the sampling routing replayed, so at the old
    weights the update's ratio is 1 even where live routing would differ (bf16 routing flips)."""
    from omegaconf import OmegaConf

    from gspo.config.schema import ModelConfig
    from gspo.models import moe
    from gspo.models.build import build_model, char_tokenizer
    from gspo.rollout.decoding.generate import generate, token_logprobs
    from gspo.rollout.decoding.params import SamplingParams
    from gspo.train.loop.moe_step import MoEStep

    tok = char_tokenizer("0123456789+=")
    model = build_model(OmegaConf.merge(OmegaConf.structured(ModelConfig), {"name": "m"}), len(tok), tok, 0).eval()
    cfg = compose(tiny(cache_dir, **{"moe.routing_replay": "R3", "rollout.old_logprobs": "recompute"}))
    r = generate(model, tok, ["1+2=", "30+4="], 2, SamplingParams(5, capture_routing=True),
                 generator=[torch.Generator().manual_seed(i) for i in range(2)])
    # routing the live router would not choose: the experts it ranks last
    with moe.capture_routing(model) as trace:
        token_logprobs(model, r)
    forced = trace.logprobs(len(r.texts)).topk(2, dim=-1, largest=False).indices
    r.routing = torch.where(r.routing >= 0, forced, r.routing)
    step = MoEStep.for_model(model, cfg, dist=None, old_pass=True)
    with torch.no_grad(), step.old_pass(model, r):
        old = token_logprobs(model, r)[0]
    routed = r.routing >= 0
    assert torch.equal(step.old_idx[routed], r.routing[routed])
    with torch.no_grad(), step.minibatch(model, r, torch.arange(len(r.texts))):
        new = token_logprobs(model, r)[0]
    torch.testing.assert_close(new, old, rtol=0, atol=1e-6)  # ratio 1 before any update


# --------------------------------------------------------------------------- checkpoints


def test_keep_checkpoints_keeps_the_newest_n(tmp_path, cache_dir):
    train(compose(tiny(cache_dir, **{"train.steps": 3, "train.checkpoint_every": 1, "train.keep_checkpoints": 2})),
          tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002", "step_000003"]


def test_a_checkpoint_that_cannot_be_written_ends_the_run_in_one_line(tmp_path, cache_dir, monkeypatch):
    """No space left while step 2's checkpoint is written: one line naming the path and the error, exit 2;
    step 1's checkpoint and the metrics up to step 2 are intact, no half-written directory is left."""
    from typer.testing import CliRunner

    from cli.main import app
    from tests.cli.test_cli import one_line_exit_2

    real, calls = checkpoint.torch.save, []

    def save(obj, path, *a, **k):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(obj, path, *a, **k)

    monkeypatch.setattr(checkpoint.torch, "save", save)
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    res = CliRunner().invoke(app, ["train", *tiny(cache_dir, **{"train.steps": 3, "train.checkpoint_every": 1}),
                                   f"hydra.run.dir={run}"])
    one_line_exit_2(res, str(run / "checkpoints" / "step_000002"), "No space left on device")
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000001"]  # no .tmp-* left either
    assert checkpoint.load_state(run / "checkpoints" / "step_000001")["step"] == 1
    assert [m["step"] for m in metrics(run)] == [0, 1, 2]
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"


def test_resume_falls_back_past_an_incomplete_checkpoint(tmp_path, cache_dir, capsys):
    whole = tmp_path / "whole"
    opts4 = tiny(cache_dir, **{"train.steps": 4, "train.checkpoint_every": 1, "train.keep_checkpoints": 2})
    train(compose(opts4), whole)
    run = tmp_path / "run"
    train(compose(tiny(cache_dir, **{"train.steps": 3, "train.checkpoint_every": 1, "train.keep_checkpoints": 2})), run)
    weights = run / "checkpoints" / "step_000003" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # cut short, as by a failing disk
    cfg = compose(opts4)
    cfg.resume = str(run)
    train(cfg, run)
    out = capsys.readouterr().out
    assert f"checkpoint {run / 'checkpoints' / 'step_000003'} is incomplete" in out and "falling back to step_000002" in out
    assert steady(metrics(run)) == steady(metrics(whole))  # step 3 redone, exactly


def test_wall_s_counts_a_restart_from_step_0(tmp_path, cache_dir):
    """A run killed before its first checkpoint restarts from step 0, but its earlier session still counts, and so
    does the record of what its resumes changed."""
    cfg = compose(tiny(cache_dir, **{"train.steps": 1}))
    train(cfg, tmp_path)
    import shutil

    shutil.rmtree(tmp_path / "checkpoints")
    summary = json.loads((tmp_path / "summary.json").read_text())
    resumes = [{"from_step": 1, "time": "", "changes": {"hardware.threads": {"was": 0, "now": 1}}}]
    (tmp_path / "summary.json").write_text(json.dumps({**summary, "status": "running", "wall_s": 828.0,
                                                       "resumes": resumes}))
    cfg.resume = str(tmp_path)
    again = train(cfg, tmp_path)
    assert again["wall_s"] > 828.0 and again["resumes"] == resumes


# --------------------------------------------------------------------------- what a resume may change


def test_resume_refuses_keys_that_change_the_experiment(tmp_path, cache_dir, monkeypatch):
    from typer.testing import CliRunner

    from cli.main import app
    from tests.cli.test_cli import one_line_exit_2

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    train(compose(tiny(cache_dir, **{"train.steps": 1})), run)
    before = (run / "config.yaml").read_text()
    for change in ("algo.eps_high=0.3", "seed=5", "train.lr=0.5", "reward.correct=2.0", "rollout.group_size=8",
                   "hardware.dtype=bfloat16", "model.warm_start.steps=3"):
        res = CliRunner().invoke(app, ["train", f"resume={run}", change, "train.steps=2"])
        one_line_exit_2(res, change, "changes what the run is")
    assert (run / "config.yaml").read_text() == before and not (run / "resumes.jsonl").exists()


def test_resume_records_what_it_changes_and_from_which_step(tmp_path, cache_dir, monkeypatch):
    from typer.testing import CliRunner

    from cli.main import app

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    train(compose(tiny(cache_dir, **{"train.steps": 1})), run)
    res = CliRunner().invoke(app, ["train", f"resume={run}", "train.steps=3", "eval.every=2", "seed=0",
                                   "hardware.threads=1", "force_resume=true"])  # (how it was asked: not recorded)
    assert res.exit_code == 0, res.output
    (entry,) = [json.loads(line) for line in (run / "resumes.jsonl").read_text().splitlines()]
    assert entry["from_step"] == 2
    assert entry["changes"] == {"train.steps": {"was": 1, "now": 3}, "eval.every": {"was": 0, "now": 2},
                                "hardware.threads": {"was": 0, "now": 1}}  # seed=0: the same value, no change
    assert [m["step"] for m in metrics(run)] == [0, 1, 2, 3] and "eval/accuracy" in metrics(run)[2]


def test_a_resume_that_changes_the_numbers_is_refused_unless_forced_then_said_and_kept(tmp_path, cache_dir,
                                                                                      monkeypatch):
    """A resume that changes hardware.threads, or goes on on another machine (a study's sessions move between CPUs),
    would make the run no longer the one its seed gives (docs/contracts.md): it is refused in one line, exit 2,
    nothing recorded, unless forced (force_resume=true); then it says so in one line and summary.json lists it, from
    what to what and from which step. One that changes only train.steps is neither refused nor said."""
    from typer.testing import CliRunner

    from cli.main import app
    from tests.cli.test_cli import one_line_exit_2

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    train(compose(tiny(cache_dir, **{"train.steps": 1, "hardware.threads": 1})), run)
    res = CliRunner().invoke(app, ["train", f"resume={run}", "train.steps=2"])
    assert res.exit_code == 0, res.output
    assert "warning" not in res.output
    here = json.loads((run / "summary.json").read_text())["machine"]
    assert here["cpu"] and here["torch"] == torch.__version__ and here["threads"] == 1
    assert {"cpu_id", "cpu_flags", "transformers", "peft", "python", "gspo", "commit", "dirty"} <= here.keys()
    from gspo.core import provenance

    monkeypatch.setattr(provenance, "machine", lambda threads=None: {**here, "cpu": "Another CPU"})
    record, config = (run / "resumes.jsonl").read_text(), (run / "config.yaml").read_text()
    for change in (["hardware.threads=2"], []):  # a thread count, and the machine alone
        res = CliRunner().invoke(app, ["train", f"resume={run}", "train.steps=3", *change])
        one_line_exit_2(res, "machine.cpu", "force_resume=true")
    assert (run / "resumes.jsonl").read_text() == record and (run / "config.yaml").read_text() == config
    res = CliRunner().invoke(app, ["train", f"resume={run}", "train.steps=3", "hardware.threads=2", "force_resume=true"])
    assert res.exit_code == 0, res.output
    said = [line for line in res.output.splitlines() if "warning" in line]
    assert said == [f"gspo: warning: this resume changes hardware.threads 1 -> 2, machine.cpu {here['cpu']} -> Another "
                    "CPU: from step 3 on, the run is no longer the one its seed and config give (docs/contracts.md); "
                    "recorded in summary.json's resumes"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 3
    assert [(r["from_step"], r["changes"]) for r in summary["resumes"]] == [
        (2, {"train.steps": {"was": 1, "now": 2}}),
        (3, {"train.steps": {"was": 2, "now": 3}, "hardware.threads": {"was": 1, "now": 2},
             "machine.cpu": {"was": here["cpu"], "now": "Another CPU"}})]
    assert summary["machine"] == {**here, "cpu": "Another CPU"}  # the last session's
    assert summary["resumes"] == [json.loads(line) for line in (run / "resumes.jsonl").read_text().splitlines()]


def test_a_run_from_before_a_machine_key_was_recorded_resumes_without_a_change(tmp_path, cache_dir, monkeypatch):
    """A run whose summary.json records only the CPU and torch (as runs did before the rest was recorded) resumes
    on the same machine without a change: a key it lacks says nothing."""
    from typer.testing import CliRunner

    from cli.main import app

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    train(compose(tiny(cache_dir, **{"train.steps": 1, "hardware.threads": 1})), run)
    summary = json.loads((run / "summary.json").read_text())
    summary["machine"] = {k: summary["machine"][k] for k in ("cpu", "torch")}
    (run / "summary.json").write_text(json.dumps(summary))
    res = CliRunner().invoke(app, ["train", f"resume={run}", "train.steps=2"])
    assert res.exit_code == 0, res.output
    (entry,) = [json.loads(line) for line in (run / "resumes.jsonl").read_text().splitlines()]
    assert entry["changes"] == {"train.steps": {"was": 1, "now": 2}}  # no machine.* key


def test_a_resumed_finished_run_says_running_while_it_works(tmp_path, cache_dir, monkeypatch):
    """A finished run resumed for more steps is `running` from its first new step on, without the old final
    accuracy: if it dies there (kill -9), it is not taken for finished. (Before: still `finished`, with the
    final accuracy of step 3, after dying at step 9.)"""
    import gspo.train.loop.trainer as trainer

    train(compose(tiny(cache_dir, **{"train.steps": 3})), tmp_path)
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "finished"
    seen = []
    update = trainer._update

    def spy(cfg, *a, **k):
        seen.append(json.loads((tmp_path / "summary.json").read_text()))
        return update(cfg, *a, **k)

    monkeypatch.setattr(trainer, "_update", spy)
    train(compose(tiny(cache_dir, **{"train.steps": 5}) + [f"resume={tmp_path}"]), tmp_path)
    assert seen[0]["status"] == "running" and "final_accuracy" not in seen[0]
    final = json.loads((tmp_path / "summary.json").read_text())
    assert final["status"] == "finished" and final["steps"] == 5 and "final_accuracy" in final


# --------------------------------------------------------------------------- a run's end, after a stop


def _same_end(run: Path, whole: Path) -> None:
    """`run`'s summary, metrics and final weights are `whole`'s (a run never interrupted): wall time aside."""
    a, b = (json.loads((d / "summary.json").read_text()) for d in (run, whole))
    assert a.pop("wall_s") > 0 and b.pop("wall_s") > 0
    assert a == b and a["status"] == "finished"
    assert steady(metrics(run)) == steady(metrics(whole))
    from gspo.train.evaluation.heldout import read_records

    assert read_records(run) == read_records(whole) != []  # which problems each evaluation answered, the last too
    files = sorted(p.name for p in checkpoint.latest(whole).glob("*.safetensors"))  # LoRA: the adapter's
    assert files and files == sorted(p.name for p in checkpoint.latest(run).glob("*.safetensors"))
    for name in files:
        x, y = (load_file(checkpoint.latest(d) / name) for d in (run, whole))
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def _counted(monkeypatch) -> dict[str, list]:
    """Spies: the held-out evaluations run (their steps) and the metrics loggers closed (their exit codes; a W&B
    run is finished there)."""
    from gspo.train.evaluation.evaluator import Evaluator
    from gspo.train.loop.logging import MetricsLogger

    seen: dict[str, list] = {"evaluated": [], "closed": []}
    run, close = Evaluator.run, MetricsLogger.close

    def counted_run(self, step):
        seen["evaluated"].append(step)
        return run(self, step)

    def counted_close(self, exit_code=0):
        seen["closed"].append(exit_code)
        return close(self, exit_code)

    monkeypatch.setattr(Evaluator, "run", counted_run)
    monkeypatch.setattr(MetricsLogger, "close", counted_close)
    return seen


KILL_AFTER_LAST_CHECKPOINT = """
import os, signal, sys
from omegaconf import OmegaConf
from gspo.train.loop.checkpointer import Checkpointer
from gspo.train.loop.trainer import train

save = Checkpointer.save
def save_then_die(self, step):
    save(self, step)
    if step == self.cfg.train.steps:  # the last checkpoint is written; its summary and merged export are not
        os.kill(os.getpid(), signal.SIGKILL)
Checkpointer.save = save_then_die
train(OmegaConf.load(sys.argv[1]), sys.argv[2])
"""


def test_a_run_killed_between_its_last_checkpoint_and_its_end_is_finished_by_its_resume(tmp_path, cache_dir,
                                                                                        monkeypatch):
    """kill -9 right after the last step's checkpoint: the resume, with nothing left to train, ends the run as an
    uninterrupted run ends: summary.json finished with its steps and final accuracy (the final evaluation read from
    metrics.jsonl, not run again), the merged LoRA export, the logger (W&B) closed as finished, and a sweep rerun
    skips it. (Before: `running` for good, no merged export, and every sweep rerun resumed it again.)"""
    from gspo.train.run import sweep

    overrides = opts(cache_dir, **{"train.steps": 3, "model.lora.r": 4, "model.lora.save_merged": True})
    whole = tmp_path / "whole"
    train(compose(overrides), whole)
    killed = tmp_path / "killed"
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(compose(overrides), resolve=True))
    proc = subprocess.run([sys.executable, "-c", KILL_AFTER_LAST_CHECKPOINT, str(tmp_path / "config.yaml"),
                           str(killed)], env=child_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-3000:] + proc.stderr[-3000:]
    left = json.loads((killed / "summary.json").read_text())
    assert left["status"] == "running" and left["steps"] == 2 and "final_accuracy" not in left
    assert checkpoint.load_state(checkpoint.latest(killed))["step"] == 3 and not (killed / "merged").exists()

    (killed / ".tmp-merged-x1").mkdir()  # what an export killed midway leaves (adapters.export_merged's name)

    seen = _counted(monkeypatch)
    cfg = compose(overrides + [f"resume={killed}"])
    assert train(cfg, killed)["status"] == "finished"
    assert seen == {"evaluated": [], "closed": [0]}  # recorded in metrics.jsonl: not run twice
    _same_end(killed, whole)
    assert not list(killed.glob(".tmp-merged-*"))
    x, y = (load_file(d / "merged" / "model.safetensors") for d in (killed, whole))
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    assert sweep.plan(killed, compose(overrides), []).action == "skip"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, cache_dir):
    """A finished 2-step run (kept intact: tests copy it), and the warm-start cache."""
    run = tmp_path_factory.mktemp("finished") / "run"
    train(compose(opts(cache_dir, **{"train.steps": 2})), run)
    return run, cache_dir


@pytest.mark.parametrize("left", ["status", "last_checkpoint", "preempted", "failed"])
def test_a_resume_with_nothing_left_to_train_finishes_the_record(tmp_path, finished_run, monkeypatch, capsys, left):
    """summary.json as a stop left it after the last checkpoint: only the status not written (a kill after the
    export), the summary of the checkpoint before (a kill right after the last checkpoint), `preempted` (a later
    stop's), `failed` (the merged export failed). The resume writes the uninterrupted run's summary, without
    building a model or evaluating again, and says so in one line."""
    import shutil

    whole, cache = finished_run
    run = tmp_path / "run"
    shutil.copytree(whole, run)
    summary = json.loads((run / "summary.json").read_text())
    if left == "last_checkpoint":
        summary = {k: v for k, v in summary.items() if k != "final_accuracy"} | {"steps": 1}
    summary["status"] = {"failed": "failed", "preempted": "preempted"}.get(left, "running")
    (run / "summary.json").write_text(json.dumps(summary))

    seen = _counted(monkeypatch)
    assert train(compose(opts(cache, **{"train.steps": 2}) + [f"resume={run}"]), run)["status"] == "finished"
    assert seen == {"evaluated": [], "closed": [0]}
    assert f"gspo: {run} has trained 2 steps (train.steps=2) but its summary says" in capsys.readouterr().out
    _same_end(run, whole)


def test_a_run_that_failed_at_its_last_step_stays_failed(tmp_path, finished_run):
    """A non-finite loss at the last step (its checkpoint written, then the run stopped as failed): a resume with
    nothing left to train ends it as the loop did, failed, not finished."""
    import shutil

    from gspo.core.errors import RunFailed

    whole, cache = finished_run
    run = tmp_path / "run"
    shutil.copytree(whole, run)
    rows = metrics(run)
    rows[-1]["train/loss"] = float("nan")
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps(json.loads((run / "summary.json").read_text()) | {"status": "failed"}))
    with pytest.raises(RunFailed, match="step 2: train/loss is nan"):
        train(compose(opts(cache, **{"train.steps": 2}) + [f"resume={run}"]), run)
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"


def test_a_resume_to_fewer_steps_runs_the_final_evaluation_once(tmp_path, finished_run, monkeypatch):
    """A 3-step run stopped after step 2 (preempted), resumed with train.steps=2: nothing left to train, and step
    2's evaluation never ran (not due then). The resume runs it, into step 2's row of metrics.jsonl, and ends as the
    2-step run never interrupted ends; a resume after a kill there does not run it again."""
    import shutil

    whole, cache = finished_run
    run = tmp_path / "run"
    train(compose(opts(cache, **{"train.steps": 3, "train.keep_checkpoints": 2})), run)
    shutil.rmtree(run / "checkpoints" / "step_000003")  # as if preempted after step 2
    summary = json.loads((run / "summary.json").read_text())
    summary = {k: v for k, v in summary.items() if k != "final_accuracy"} | {"status": "preempted", "steps": 2}
    (run / "summary.json").write_text(json.dumps(summary))
    assert "eval/accuracy" not in metrics(run)[2]

    seen = _counted(monkeypatch)
    resume = compose(opts(cache, **{"train.steps": 2, "train.keep_checkpoints": 2}) + [f"resume={run}"])
    assert train(resume, run)["status"] == "finished"
    assert seen["evaluated"] == [2] and seen["closed"] == [0]
    _same_end(run, whole)

    (run / "summary.json").write_text(json.dumps(summary))  # killed after the evaluation was recorded
    seen["evaluated"].clear()
    train(resume, run)
    assert seen["evaluated"] == []
    _same_end(run, whole)
