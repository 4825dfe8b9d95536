"""On a CUDA GPU (skipped elsewhere): `gspo train hardware=gpu` runs its steps in bf16 and float32, dense and MoE,
critic-free and with PPO's value model. The first GPU run found the group advantages left on the CPU beside a loss
on the GPU (RuntimeError at the first update); nothing on a CPU can see that."""

import json
import math

import pytest
import torch

from gspo.config.loading import compose
from gspo.train.loop.trainer import train
from tests.conftest import tiny

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


def every_preset_on(device: str) -> dict[str, tuple]:
    """Each algo preset's advantages, loss and gradient (float64) with its tensors on `device`, returned on the CPU."""
    from omegaconf import OmegaConf

    from gspo.algos.advantages import ADVANTAGES, compute_advantages
    from gspo.algos.losses import HYPER_NAMES, LOSSES, policy_loss
    from gspo.config.schema import CONF_DIR, AlgoConfig
    from tests.algos.test_losses import make_batch

    out = {}
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.0, 0.0, 0.25], dtype=torch.float64, device=device)
    lengths = torch.tensor([3, 5, 2, 4, 1, 6, 2, 2], device=device)
    for p in sorted((CONF_DIR / "algo").glob("*.yaml")):
        raw = OmegaConf.load(p)
        cfg = OmegaConf.merge(OmegaConf.structured(AlgoConfig), raw.algo if "algo" in raw else raw)
        adv = None  # ppo's GAE needs a critic's values: its loss is still checked
        if cfg.advantage in ADVANTAGES:
            adv = compute_advantages(cfg.advantage, rewards, 4, passk_k=cfg.passk_k, lengths=lengths).cpu()
        logp, old, mask, a = (t.detach().to(device) for t in make_batch())
        logp.requires_grad_()
        hyper = {k: cfg[k] for k in HYPER_NAMES if k in cfg}
        if LOSSES[cfg.loss].topk:
            hyper |= {"topk_old_logp": torch.stack([old, old - 1.0], -1), "topk_logp": torch.stack([logp, logp - 1.0], -1)}
        loss, _ = policy_loss(cfg.loss, logp, old, a, mask, max_tokens=8, ref_logp=old, **hyper)
        (g,) = torch.autograd.grad(loss, logp)
        out[p.stem] = (adv, loss.detach().cpu(), g.cpu())
    return out


def test_every_preset_computes_on_the_gpu_what_it_computes_on_the_cpu():
    # each loss and advantage estimator keeps its inputs' device (DAPO's overlong penalty once built its own on
    # the CPU): on CUDA tensors every preset runs and gives the CPU's float64 numbers
    cpu, gpu = every_preset_on("cpu"), every_preset_on("cuda")
    for name, want in cpu.items():
        for w, got in zip(want, gpu[name]):
            if w is not None:
                torch.testing.assert_close(got, w, rtol=1e-9, atol=1e-12, equal_nan=True, msg=name)


def test_a_gpu_run_samples_the_same_with_its_decode_replayed(tmp_path, cache_dir):
    """`rollout.decode=graph` (the default on CUDA: each decode step one CUDA graph replay) against `eager`, in
    float32, MoE with R3 (the routing recorded while sampling, replayed in the update): the same completions and
    rewards at every step (the weights updated between rollouts are the graph's too), the other numbers equal up
    to float32 rounding."""
    from gspo.rollout.decoding import static_decode
    from tests.train.loop.test_train import read_metrics

    overrides = {"moe.routing_replay": "R3", "rollout.max_new_tokens": 12, "train.lr": 0.05, "hardware": "gpu",
                 "hardware.dtype": "float32"}
    logs = {}
    for decode in ("eager", "graph"):
        static_decode.release()
        train(compose(tiny(cache_dir, **overrides, **{"rollout.decode": decode})), tmp_path / decode)
        logs[decode] = [{k: v for k, v in m.items() if not k.startswith(("time/", "throughput/", "mem/", "memory/"))}
                        for m in read_metrics(tmp_path / decode)]
    assert len(logs["eager"]) == len(logs["graph"]) >= 3
    for eager, graph in zip(logs["eager"], logs["graph"]):
        assert eager.keys() == graph.keys()
        assert {k: v for k, v in graph.items() if k.startswith(("reward/", "response/"))} == \
            {k: v for k, v in eager.items() if k.startswith(("reward/", "response/"))}
        for k, v in eager.items():
            assert math.isclose(graph[k], v, rel_tol=1e-3, abs_tol=1e-5), (k, v, graph[k])
