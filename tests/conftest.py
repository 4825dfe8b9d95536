"""Shared fixtures: tiny settings that make a whole `gspo train` run take seconds."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


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


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One warm-start cache for the whole test session, as a sweep would share it."""
    return tmp_path_factory.mktemp("cache")
