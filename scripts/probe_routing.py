"""Whether a MoE's routing matters: how far its token log-probs move when its routing changes
(docs/results/smollm2-moe.md).

Samples rollout batches of a config's model (its task's training prompts, the run's sampling settings and keys, as
scripts/probe_mismatch.py draws them), then recomputes every sampled token's log-prob under variants of the same
weights and prints one JSON line: per variant, the mean and max |delta log p| per token against the model as
sampled, and the share of (token, MoE layer) expert sets that differ from its own routing:

  top_k=K       each token routed to K experts instead of the model's k, every expert's output scaled by K/k
                (model.split_experts folds the factor k into the experts: this keeps a chosen expert's weight
                near 1, so only *which* experts run changes)
  router_noise  every router weight plus Gaussian noise of EPS times that router's weight std (a small update)
  bf16          the model's bf16 copy, as a bf16 sampler computes it (the mismatch regime's yardstick)

    python scripts/probe_routing.py +experiment=smollm2_moe_math hardware.threads=1 --batches 4
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import random

import torch

from gspo.config.loading import compose
from gspo.models import moe
from gspo.models.build import load_pretrained
from gspo.rollout.decoding.generate import generate, token_logprobs
from gspo.rollout.decoding.params import SamplingParams
from gspo.tasks import build_task
from gspo.train.start.warm_start import base_model


@contextlib.contextmanager
def top_k(model, k: int):
    """Every router picks `k` experts; the experts' outputs scaled by k / (the model's k) meanwhile."""
    routers = moe.find_routers(model)
    own = routers[0].top_k
    experts = [m for m in model.modules() if hasattr(m, "down_proj") and isinstance(m.down_proj, torch.nn.Parameter)]
    with torch.no_grad():
        for r in routers:
            r.top_k = k
        for e in experts:
            e.down_proj.mul_(k / own)
    try:
        yield model
    finally:
        with torch.no_grad():
            for r in routers:
                r.top_k = own
            for e in experts:
                e.down_proj.mul_(own / k)


def router_noise(model, eps: float, seed: int = 0):
    """A copy of `model` whose router weights are moved by Gaussian noise of `eps` times each one's std."""
    noisy = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for r in moe.find_routers(noisy):
            w = moe.router_weight(r)
            w.add_(torch.randn(w.shape, generator=gen) * eps * float(w.std()))
    return noisy


def scores(model, ro, temperature: float, reference: torch.Tensor, routing: torch.Tensor) -> dict:
    """|delta log p| per token of `model` against `reference` on the rollout, and the routing it changes."""
    mask = ro.completion_mask.bool()
    with torch.no_grad(), moe.capture_routing(model, logprobs=False) as trace:
        logp = token_logprobs(model, ro, temperature)[0].float()
    live = trace.live_indices(len(ro.texts))
    d = (logp - reference).abs()[mask]
    changed = _changed(routing, live, ro)
    return {"mean_abs_dlogp": float(d.mean()), "max_abs_dlogp": float(d.max()), "routing_changed": changed}


def _changed(a: torch.Tensor, b: torch.Tensor, ro) -> float:
    """Share of (completion token, layer) whose expert sets differ (as sets, whatever the k of each)."""
    pos = torch.zeros(ro.input_ids.shape, dtype=torch.bool)
    pos[:, ro.prompt_len - 1 : -1] = ro.completion_mask.bool()  # the positions that produced each completion token
    sa, sb = a[pos], b[pos]  # (n, L, k)
    one_hot = lambda idx: torch.zeros(*idx.shape[:-1], 1 + int(max(a.max(), b.max())), dtype=torch.bool).scatter_(  # noqa: E731
        -1, idx.clamp_min(0), True)
    return float((one_hot(sa) != one_hot(sb)).any(-1).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", default=["+experiment=smollm2_moe_math"])
    parser.add_argument("--batches", type=int, default=4, help="rollout batches (the run's steps 1..N)")
    parser.add_argument("--top-k", type=int, nargs="*", default=None, help="other top-k to try (default: k-1, E)")
    parser.add_argument("--eps", type=float, nargs="*", default=[0.01, 0.1], help="router noise, x the weight std")
    args = parser.parse_args()
    cfg = compose(args.overrides)
    torch.set_num_threads(cfg.hardware.threads or 1)
    task = build_task(cfg.task)
    model, tok = load_pretrained(base_model(cfg, task, log=lambda m: None), torch.float32,
                                 cfg.model.attn_implementation)
    model.eval()
    routers = moe.find_routers(model)
    if not routers:
        raise SystemExit("the model has no MoE routers")
    k, experts = routers[0].top_k, routers[0].num_experts
    variants = {f"top_k={n}": n for n in (args.top_k if args.top_k is not None else [k - 1, experts])}
    noisy = {f"router_noise={e}": router_noise(model, e) for e in args.eps}
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    params = SamplingParams.of(cfg, capture_routing=True)
    rows: dict[str, list[dict]] = {}
    for b in range(1, args.batches + 1):
        problems = task.sample_train(random.Random(f"{cfg.seed}-{b}-0"), cfg.rollout.prompts_per_step)
        gens = [torch.Generator().manual_seed(cfg.seed * 1_000_003 + b * 1_000 + i) for i in range(len(problems))]
        with torch.no_grad():
            ro = generate(model, tok, [p.prompt for p in problems], cfg.rollout.group_size, params, generator=gens)
            with moe.capture_routing(model, logprobs=False) as trace:
                reference = token_logprobs(model, ro, cfg.rollout.temperature)[0].float()
        own = trace.live_indices(len(ro.texts))
        for name, n in variants.items():
            with top_k(model, n):
                rows.setdefault(name, []).append(scores(model, ro, cfg.rollout.temperature, reference, own))
        for name, m in {**noisy, "bf16": bf16}.items():
            rows.setdefault(name, []).append(scores(m, ro, cfg.rollout.temperature, reference, own))
    out = {name: {key: (max if key.startswith("max") else lambda v: sum(v) / len(v))([r[key] for r in rs])
                  for key in rs[0]} for name, rs in rows.items()}
    out["model"] = {"name": cfg.model.name, "experts": experts, "top_k": k, "batches": args.batches,
                    "completions": args.batches * cfg.rollout.prompts_per_step * cfg.rollout.group_size}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
