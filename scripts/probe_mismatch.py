"""The sampler/trainer mismatch of a config's starting policy, before any update (docs/results/bf16-mismatch.md,
docs/results/engine-mismatch.md, docs/results/smollm2-precision.md).

Samples rollout batches from the warm-started base with the config's sampler (`rollout.dtype`, e.g. the
bf16 copy of `+experiment=moe_mismatch`; with `rollout.engine=vllm` the vLLM engine in that precision),
recomputes the same tokens with the trainer in `hardware.dtype`, and prints one JSON line: per-token
|delta log p|, KL, ratio extremes, the (token, MoE layer) routing mismatch, and the share of sequences
(tokens) that GSPO's (GRPO's) clip range and the corrections' bands would clip or mask on mismatch alone,
i.e. when the sampler's log-probs serve as the old policy's. It also scores every sample with the run's task
(`correct`, `reward`; the success rate per prompt in `correct_by_prompt`): `--paired OTHER.json` compares the
success rate with another precision's probe of the same prompts (the saved JSON line of a run at the same seed),
paired by prompt, with a 95% interval (docs/results/smollm2-precision.md).

    python scripts/probe_mismatch.py                                  # +experiment=moe_mismatch, 4 batches
    python scripts/probe_mismatch.py +experiment=moe_mismatch rollout.dtype=float16 --batches 2
    python scripts/probe_mismatch.py +experiment=engine_mismatch      # the bf16 vLLM engine (engine's venv)
    python scripts/probe_mismatch.py +experiment=engine_mismatch hardware.dtype=bfloat16   # a bf16 trainer
    python scripts/probe_mismatch.py +experiment=smollm2_math --batches 16 > fp32.json
    python scripts/probe_mismatch.py +experiment=smollm2_math rollout.dtype=bfloat16 --batches 16 --paired fp32.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random

import torch

from gspo.algos.mismatch import mismatch_metrics, routing_mismatch
from gspo.config.loading import compose
from gspo.models import moe
from gspo.models.build import load_pretrained
from gspo.rollout.decoding.generate import token_logprobs
from gspo.rollout.decoding.params import SamplingParams
from gspo.rollout.decoding.rollouts import rollout
from gspo.rollout.decoding.sampler import Sampler
from gspo.rollout.engine import client as engine
from gspo.tasks import build_task
from gspo.tasks.rewards import score
from gspo.train.ranks import distributed
from gspo.train.start.warm_start import base_model

CLIP_RANGES = {"gspo_paper": (3e-4, 4e-4), "gspo_wide": (3e-3, 4e-3), "grpo": (0.2, 0.2)}


def probe(cfg, batches: int) -> dict:
    task = build_task(cfg.task)
    base = base_model(cfg, task, log=lambda m: None)
    model, tok = load_pretrained(base, getattr(torch, cfg.hardware.dtype), cfg.model.attn_implementation,
                                 cfg.model.experts_implementation)
    device = distributed.device_of(cfg.hardware)  # hardware=gpu: the mismatch of GPU kernels, not the CPU's
    model.to(device).eval()
    is_moe = moe.is_moe(model)
    sampler = Sampler.for_run(model, cfg, engine=lambda: engine.start(
        cfg, model, tok, base, cfg.rollout.prompts_per_step * cfg.rollout.group_size, torch.get_num_threads(),
        routing=is_moe, on_cpu=device.type == "cpu"))
    sampler.sync(model)
    rows: dict[str, list[float]] = {}
    seq_logratio, tok_logratio = [], []
    correct: list[float] = []  # per prompt: the share of its G samples the task scores right
    rewards: list[float] = []
    params = SamplingParams.of(cfg, capture_routing=is_moe)
    for b in range(1, batches + 1):
        rng = random.Random(f"{cfg.seed}-{b}-0")  # the problems the run's step b draws first
        problems = task.sample_train(rng, cfg.rollout.prompts_per_step)
        keys = [(cfg.seed, b, 0, i) for i in range(len(problems))]  # the run's keys: its step b samples these
        with sampler.serve(model, None) as m:  # the run's sampling settings (its chat template, its engine)
            ro = rollout(m, tok, [p.prompt for p in problems], cfg.rollout.group_size, params, keys, device=device)
        with torch.no_grad(), moe.capture_routing(model, logprobs=True) if is_moe else contextlib.nullcontext() as trace:
            trainer = token_logprobs(model, ro, cfg.rollout.temperature)[0]
        rewards_b, parts = score(task, cfg.reward, ro.texts, [problems[i] for i in ro.prompt_index.tolist()],
                                 ro.ill_formed, clean_texts=ro.clean_texts)
        rewards += rewards_b.tolist()
        correct += parts["correct"].view(len(problems), -1).mean(-1).tolist()  # rows are group-contiguous
        mask = ro.completion_mask
        for k, v in mismatch_metrics(trainer, ro.sampler_logp, mask, ro.kept_mass).items():
            rows.setdefault(k, []).append(v)
        if is_moe:
            positions = torch.zeros(ro.input_ids.shape, dtype=mask.dtype, device=mask.device)
            positions[:, ro.prompt_len - 1: -1] = mask  # the positions whose routing produced each completion token
            rows.setdefault("rollout/routing_mismatch", []).append(
                routing_mismatch(ro.routing, trace.live_indices(len(ro.texts)), positions))
        d = (trainer - ro.sampler_logp) * mask
        seq_logratio.append(d.sum(-1) / mask.sum(-1).clamp(min=1))
        tok_logratio.append(d[mask.bool()])
    seq, toks = torch.cat(seq_logratio).exp(), torch.cat(tok_logratio).exp()
    out = {k: (min(v) if k.endswith("_min") else max(v) if k.endswith("_max") else sum(v) / len(v))
           for k, v in rows.items()}
    for name, (lo, hi) in CLIP_RANGES.items():
        out[f"seq_outside_clip/{name}"] = float(((seq < 1 - lo) | (seq > 1 + hi)).float().mean())
        out[f"tok_outside_clip/{name}"] = float(((toks < 1 - lo) | (toks > 1 + hi)).float().mean())
    out["tok_outside/icepop_0.5_5"] = float(((toks < 0.5) | (toks > 5)).float().mean())
    out["seq_outside/geometric_0.99_1.01"] = float(((seq < 0.99) | (seq > 1.01)).float().mean())
    sampler.close()
    out |= {"correct": sum(correct) / len(correct), "reward": sum(rewards) / len(rewards),
            "correct_by_prompt": correct}
    out |= {"sequences": len(seq), "tokens": len(toks), "sampler": cfg.rollout.dtype or cfg.hardware.dtype,
            "engine": cfg.rollout.engine, "trainer": cfg.hardware.dtype, "model": cfg.model.name}
    return out


def paired(a: list[float], b: list[float]) -> dict:
    """The mean per-prompt difference a - b of two probes' success rates on the same prompts, with a 95% interval
    (normal approximation over prompts: the prompts are the shared unit, the samples within one are not independent
    of its difficulty)."""
    if len(a) != len(b):
        raise SystemExit(f"--paired: {len(a)} prompts here, {len(b)} there: probe the same batches at the same seed")
    d = [x - y for x, y in zip(a, b)]
    mean = sum(d) / len(d)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / max(len(d) - 1, 1))
    half = 1.96 * sd / math.sqrt(len(d))
    return {"paired/correct_diff": mean, "paired/ci95": [mean - half, mean + half], "paired/prompts": len(d)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", default=["+experiment=moe_mismatch"])
    parser.add_argument("--batches", type=int, default=4, help="rollout batches to probe (the run's steps 1..N)")
    parser.add_argument("--paired", metavar="OTHER.json", help="another probe's JSON line (same prompts): the "
                        "paired difference in per-prompt success rate, this one minus that one, with a 95%% interval")
    args = parser.parse_args()
    cfg = compose(args.overrides)
    torch.set_num_threads(cfg.hardware.threads or 1)
    out = probe(cfg, args.batches)
    if args.paired:
        with open(args.paired) as f:
            out |= paired(out["correct_by_prompt"], json.loads(f.readline())["correct_by_prompt"])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
