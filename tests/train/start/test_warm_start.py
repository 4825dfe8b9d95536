"""The warm start: its data (fresh problems or a fixed pool) and its stop at a target accuracy."""


import torch
from omegaconf import OmegaConf

from gspo.config.schema import ModelConfig, WarmStartConfig
from gspo.models.build import build_model, char_tokenizer
from gspo.tasks import Problem, Verdict
from gspo.train.start.warm_start import warm_start
from tests.conftest import child_env


class Echo:
    """`d=` -> `d`: learnable in a few dozen steps. Counts the problems it hands out."""

    name, alphabet = "echo", "0123456789="

    def __init__(self):
        self.drawn = 0

    def sample_train(self, rng, n):
        self.drawn += n
        return [Problem(f"{d}=", str(d)) for d in (rng.randint(0, 9) for _ in range(n))]

    def verify(self, completion, problem):
        return Verdict(completion.strip() == problem.answer, completion.strip().isdigit())


def tiny_model(tok):
    mcfg = OmegaConf.structured(ModelConfig(name="t", arch="qwen3", hidden_size=32, num_heads=2, num_kv_heads=1,
                                            head_dim=16, intermediate_size=64, num_layers=1))
    return build_model(mcfg, len(tok), tok, seed=0)


def wcfg(**kw):
    return OmegaConf.structured(WarmStartConfig(**{"batch_size": 16, **kw}))


def test_warm_start_stops_at_the_target_accuracy():
    task = Echo()
    tok = char_tokenizer(task.alphabet)
    record = warm_start(tiny_model(tok), tok, task, wcfg(steps=400, lr=1e-2, target_accuracy=0.9, check_every=10),
                        log=lambda m: None)
    assert record["train_accuracy"] >= 0.9
    assert record["steps"] < 400 and record["steps"] % 5 == 0  # stopped at a check, well before the cap


def test_checks_come_five_times_as_often_from_half_the_target(monkeypatch):
    """Coarse checks overshoot (52.5% for a 40% target, 25 steps apart): from half the target, every 5 steps.
    (The accuracies are given: 2 problems a step are enough to count steps.)"""
    import gspo.train.start.warm_start

    accuracies = iter([0.10, 0.19, 0.20, 0.30, 0.39, 0.41, 0.9])
    seen = []
    monkeypatch.setattr(gspo.train.start.warm_start, "_accuracy_check",
                        lambda *a: lambda: seen.append(next(accuracies)) or seen[-1])
    task = Echo()
    tok = char_tokenizer(task.alphabet)
    record = warm_start(tiny_model(tok), tok, task, wcfg(steps=400, lr=1e-3, target_accuracy=0.4, check_every=25,
                                                         fine_check_every=5, batch_size=2), log=lambda m: None)
    # checks at 25, 50, 75 (0.20: half the target reached), then 80, 85, 90 (0.41 >= 0.4: stop)
    assert seen == [0.10, 0.19, 0.20, 0.30, 0.39, 0.41]
    assert record == {"steps": 90, "train_accuracy": 0.41}
    seen.clear()
    accuracies = iter([0.10, 0.19, 0.20, 0.30, 0.39, 0.41])
    record = warm_start(tiny_model(tok), tok, task, wcfg(steps=400, lr=1e-3, target_accuracy=0.4, check_every=25,
                                                         fine_check_every=0, batch_size=2), log=lambda m: None)
    assert record == {"steps": 150, "train_accuracy": 0.41}  # 0: every 25 steps throughout


def test_without_a_target_it_runs_every_step_and_never_checks():
    task = Echo()
    tok = char_tokenizer(task.alphabet)
    record = warm_start(tiny_model(tok), tok, task, wcfg(steps=12, lr=1e-2, target_accuracy=0.0), log=lambda m: None)
    assert record == {"steps": 12, "train_accuracy": None}
    assert task.drawn == 12 * 16  # fresh problems every step


def test_a_fixed_pool_is_drawn_once():
    task = Echo()
    tok = char_tokenizer(task.alphabet)
    warm_start(tiny_model(tok), tok, task, wcfg(steps=12, lr=1e-2, problems=40, target_accuracy=0.0), log=lambda m: None)
    assert task.drawn == 40


def test_the_cache_is_keyed_by_the_data_files_content_and_says_when_it_reuses_a_base(tmp_path, capsys):
    """task=data: the same path with other content builds another base; the same content reuses the cached one,
    with a line naming it."""
    import json

    from gspo.config.loading import compose
    from gspo.tasks import build_task
    from gspo.train.start.warm_start import base_model
    from tests.conftest import tiny

    data = tmp_path / "d.jsonl"

    def write(op):
        rows = [{"prompt": f"{a}{op}{b}=", "answer": str(eval(f"{a}{op}{b}"))} for a in range(10) for b in range(10)]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    write("+")
    cfg = compose(tiny(tmp_path / "cache", task="data", **{"task.path": str(data), "model.warm_start.steps": 2,
                                                          "model.warm_start.target_accuracy": 0}))
    add = base_model(cfg, build_task(cfg.task))
    write("*")  # the same path, other problems
    mul = base_model(cfg, build_task(cfg.task))
    assert mul != add
    assert json.loads((mul / "warm_start.json").read_text())["inputs"]["task.path"]["path"] == str(data)
    capsys.readouterr()
    write("+")
    assert base_model(cfg, build_task(cfg.task)) == add
    assert f"gspo: reusing the warm-started base {add} (built from task.path={data}, same content)" in capsys.readouterr().out


def test_the_cached_base_and_a_partial_warm_start_are_readable_by_those_sharing_the_cache(tmp_path):
    """Made by tempfile.mkdtemp (mode 0o700) and renamed into place, the warm-started base (and a stopped warm
    start's `.partial-` state) kept a colleague sharing cache_dir out of it; both now have the mode a mkdir gives
    under the umask (0o755 under 022)."""
    import os
    import random
    import stat

    from gspo.config.loading import compose
    from gspo.tasks import build_task
    from gspo.train.start.warm_start import _save_partial, base_model
    from tests.conftest import tiny

    cfg = compose(tiny(tmp_path / "cache", **{"model.warm_start.steps": 1, "model.warm_start.target_accuracy": 0}))
    tok = char_tokenizer("0123456789=")
    model = tiny_model(tok)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    old = os.umask(0o022)
    try:
        base = base_model(cfg, build_task(cfg.task), log=lambda m: None)
        _save_partial(tmp_path / "cache" / ".partial-x", model, opt, sched, random.Random(0), {}, 1, 1)
    finally:
        os.umask(old)
    for made in (base, tmp_path / "cache" / ".partial-x"):
        assert stat.S_IMODE(made.stat().st_mode) == 0o755, (made, oct(made.stat().st_mode))


def test_sigterm_during_the_warm_start_saves_it_and_the_resume_continues_it(tmp_path, monkeypatch):
    """SIGTERM while the warm start runs: exit 75 and the one-line resume message (before: killed by the signal,
    exit -15, no message), the partial warm start saved beside the cache and never taken for a finished base;
    `gspo train resume=` continues it and builds the very base an uninterrupted warm start builds. (The signal
    comes after the first step's line, 199 steps before the end: a run and its resume cost one warm start; the
    signal came after step 101 of 400 before, 800 steps in all where 400 now test the same.)"""
    import json
    import signal
    import subprocess
    import sys
    import time

    from safetensors.torch import load_file

    env = child_env()
    opts = ["model=qwen3-tiny", "model.hidden_size=32", "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16",
            "model.intermediate_size=64", "model.warm_start.steps=200", "model.warm_start.target_accuracy=0",
            "model.warm_start.batch_size=16", "train.steps=1", "rollout.prompts_per_step=4", "rollout.group_size=4",
            "rollout.max_new_tokens=4", "task.eval_size=8", "logger.progress=false", "hardware.threads=1"]
    from typer.testing import CliRunner

    from cli.main import app

    # the uninterrupted warm start and the resume in this process; the signalled run below needs a process of its own
    monkeypatch.chdir(tmp_path)
    whole = CliRunner().invoke(app, ["train", *opts, f"cache_dir={tmp_path / 'c1'}", f"hydra.run.dir={tmp_path / 'whole'}"])
    assert whole.exit_code == 0, whole.output[-2000:]
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "train", *opts, f"cache_dir={tmp_path / 'c2'}",
                             f"hydra.run.dir={run}"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen = ""
    while "warm start 1/200" not in seen:
        seen += proc.stdout.readline()
        assert proc.poll() is None, seen
    proc.send_signal(signal.SIGTERM)
    out = seen + proc.communicate(timeout=120)[0]
    assert proc.returncode == 75, out
    assert "during the warm start, after its step" in out and f"resume with: gspo train resume={run}" in out
    assert json.loads((run / "summary.json").read_text())["status"] == "preempted"
    cache = tmp_path / "c2"
    assert [p.name.startswith(".partial-base-") for p in cache.iterdir()] == [True]  # no finished base
    time.sleep(0.1)
    res = CliRunner().invoke(app, ["train", f"resume={run}"])  # (in this process: the stopped one is gone)
    assert res.exit_code == 0, res.output[-2000:]
    assert "continuing the interrupted warm start from step" in res.output
    a = load_file(next((tmp_path / "c1").glob("base-*")) / "model.safetensors")
    b = load_file(next(cache.glob("base-*")) / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not list(cache.glob(".partial-*"))  # done: the partial state is gone
