"""On a CUDA GPU (skipped elsewhere): `gspo train hardware=gpu` runs its steps in bf16 and float32, dense and MoE,
critic-free and with PPO's value model. The first GPU run found the group advantages left on the CPU beside a loss
on the GPU (RuntimeError at the first update); nothing on a CPU can see that."""

import json
import math

import pytest
import torch
from conftest import tiny

from gspo.config.loading import compose
from gspo.train.trainer import train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("model,algo,dtype", [
    ("qwen3-moe", "gspo", "bfloat16"), ("qwen3-tiny", "grpo", "float32"), ("qwen3-tiny", "dapo", "bfloat16"),
    ("qwen3-tiny", "ppo", "bfloat16"),
])
def test_train_on_gpu(tmp_path, cache_dir, model, algo, dtype):
    over = tiny(cache_dir, model=model, algo=algo, **{"hardware": "gpu", "hardware.dtype": dtype})
    summary = train(compose(over), tmp_path)
    assert summary["status"] == "finished" and summary["steps"] == 2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float))
        assert r["memory/peak_gib"] > 0  # logged on CUDA only
