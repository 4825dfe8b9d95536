"""Two runs compared as the same run: their metrics.jsonl, the clock's and the machine's keys aside, and every weight
file of their last checkpoints, bit for bit. The resume contract (tests/contracts/test_resume_equals_uninterrupted.py)
is built on it, and so is every other test of two runs that must be one (where sampling runs, a stopped sweep, ...)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from gspo.train.run import checkpoint

NOISY = ("time/", "throughput/", "memory/")  # the clock's and the machine's (a worker's, an engine's RSS)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def steady(run_dir: Path) -> list[dict]:
    """metrics.jsonl without the NOISY keys."""
    return [{k: v for k, v in r.items() if not k.startswith(NOISY)} for r in metrics(run_dir)]


def weights(run_dir: Path, name: str = "model.safetensors") -> dict[str, torch.Tensor]:
    """One weight file of the run's last checkpoint."""
    return load_file(checkpoint.latest(run_dir) / name)


def weight_files(run_dir: Path) -> list[str]:
    """The weight files of the run's last checkpoint: the model's (or a LoRA run's adapter), and a critic's or a reset
    reference's beside it."""
    return sorted(p.name for p in checkpoint.latest(run_dir).glob("*.safetensors"))


def assert_same_weights(a: Path, b: Path) -> None:
    files = weight_files(a)
    assert files and files == weight_files(b)
    for name in files:
        wa, wb = weights(a, name), weights(b, name)
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), name


def assert_same_run(a: Path, b: Path) -> None:
    assert steady(a) == steady(b)
    assert_same_weights(a, b)


def stop_after(monkeypatch, step: int) -> None:
    """The stop request a SIGTERM makes, at the boundary after `step` (as preemption.StopSignals sees it)."""
    from gspo.train.run import preemption

    calls = []
    monkeypatch.setattr(preemption.StopSignals, "requested",
                        lambda self: calls.append(1) or ("preempted" if len(calls) > step else None))
