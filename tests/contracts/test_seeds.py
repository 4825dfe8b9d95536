"""Every run is a function of its seed and config: two runs of every preset are bitwise equal, and a resumed
run draws what the uninterrupted one draws, for the presets and options that use random numbers beyond
sampling (Clip-Cov's random pick, pass@k sampling in evaluation, LoRA dropout)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from tests.conftest import tiny
from safetensors.torch import load_file

from gspo.config.loading import compose
from gspo.config.schema import group_options
from gspo.train.loop.trainer import train
from gspo.train.run import checkpoint

NOISY = ("time/", "throughput/")  # wall-clock metrics differ between any two runs


def steady(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(NOISY)} for r in rows]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = checkpoint.latest(run_dir)
    name = "model.safetensors" if (ckpt / "model.safetensors").is_file() else "adapter_model.safetensors"
    return load_file(ckpt / name)


def assert_same(a: Path, b: Path) -> None:
    assert steady(a) == steady(b)
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def opts(cache_dir, **extra) -> list[str]:
    # pass@2 evaluated at every step: evaluation's sampling is on the path too
    return tiny(cache_dir, **{"train.steps": 2, "eval.every": 1, "eval.pass_k": 2, "task.eval_size": 8,
                              "train.checkpoint_every": 1, "rollout.keep_topk": 3, **extra})  # (dppo_topk reads it)


def test_two_runs_of_every_preset_are_bitwise_equal(tmp_path, cache_dir):
    """The second run starts with torch's global generator elsewhere: nothing may draw from it unseeded.
    (Before: two Clip-Cov runs had step-1 losses 0.0249 and 0.0499, pass@2 differed between runs.) The config is
    composed once per preset and each run gets its own copy: composing is a third of a tiny run's time."""
    for algo in group_options("algo"):
        cfg = compose(opts(cache_dir, algo=algo))
        for i in (0, 1):
            torch.rand(1 + i)  # move the global generator
            train(copy.deepcopy(cfg), tmp_path / f"{algo}-{i}")
        assert_same(tmp_path / f"{algo}-0", tmp_path / f"{algo}-1")


CASES = {  # each draws random numbers beyond sampling
    "clip_cov": {"algo": "clip_cov"},
    "lora_dropout": {"model": "qwen3-tiny", "model.lora.r": 4, "model.lora.dropout": 0.2},
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_run_is_the_uninterrupted_run(case, tmp_path, cache_dir):
    """Three steps straight = one step, then resumed to three (its global generator state was not saved:
    each step reseeds from (seed, step))."""
    extra = {**CASES[case], "train.steps": 3}
    train(compose(opts(cache_dir, **extra)), tmp_path / "whole")
    train(compose(opts(cache_dir, **{**extra, "train.steps": 1})), tmp_path / "part")
    torch.rand(5)  # a resume starts in a fresh process: the global generator is anywhere
    train(compose(opts(cache_dir, **extra) + [f"resume={tmp_path / 'part'}"]), tmp_path / "part")
    assert_same(tmp_path / "whole", tmp_path / "part")
