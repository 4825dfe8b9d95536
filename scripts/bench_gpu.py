"""GPU benchmark (one GPU, bf16): gspo against `model.generate()` and against TRL, on real-shaped models.

Models (random weights, built from configs, nothing downloaded; the tokenizer is character-level,
filled to the vocabulary, with an EOS one past it, so every completion runs to full length):
  dense  Qwen3-0.6B-shaped: 28 layers, hidden 1024, 16 heads / 8 kv heads, head_dim 128,
         intermediate 3072, vocab 151,936, tied embeddings
  moe    Qwen3-30B-A3B-shaped, cut to 4 layers: 128 experts, top-8, hidden 2048, moe_intermediate 768,
         32 heads / 4 kv heads, head_dim 128, vocab 151,936
Measurements (`--parts`), one table each, all of them also in a JSON file (`--out`), written
after every measurement so a run cut short still returns what it finished:
  rollout   tokens/s of gspo's sampler (`gspo.rollout.decoding.generate.generate`) and of `model.generate()`:
            same model, same left-padded batch, same lengths, sampling at temperature 1
  step      time per RL step: `gspo train hardware=gpu model=hf model.path=DIR ...` vs TRL's
            GRPOTrainer with the same GSPO settings, bf16 weights on both, alternating subprocesses
  memory    peak GPU memory of each trainer's process (`torch.cuda.max_memory_allocated` /
            `max_memory_reserved`; gspo's `memory/peak_gib` too when it logs one) — from the step runs
  mismatch  sampler vs trainer log-probs of the same sampled tokens: per token |diff| (mean, max),
            per sequence |mean diff| (GSPO's log-ratio; mean, max), k3 KL, and the share of sequences
            whose ratio would already sit outside GSPO's clip range (3e-4 / 4e-4) before any update
  decode    (not in the default parts) decode ms per step of the fast engine under `rollout.decode`: eager (one
            kernel after another), static (the static KV cache op by op) and graph (the step captured once as a
            CUDA graph, replayed per token), the same batch and seeds, alternating; graph against static bit for
            bit, eager against graph row by row. Built in memory (no checkpoint saved, no Hydra: it runs on a
            machine that has only torch and transformers); the MoE model records its routing (R3) as it samples

Usage (the defaults are sized for one device call of under 10 minutes on one H100 — an estimate, not yet
measured; `--models` / `--parts` split the work across calls):
  python scripts/bench_gpu.py --out $OUT/bench_gpu.json
  python scripts/bench_gpu.py --models moe --parts step --override rollout.old_logprobs=sampler
  python scripts/bench_gpu.py --tiny                      # seconds on a CPU: a smoke test
  python scripts/bench_gpu.py --parts decode --out $OUT/decode.json   # eager vs graph decode, dense and moe
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch
from bench_common import (
    ROOT,
    WorkerFailed,
    cached_model_dir,
    fmt,
    gspo_overrides,
    markdown_table,
    never_ending_tokenizer,
    random_model,
    ratio,
    run_worker,
    versions,
    work_dir,
)
from bench_workers import gspo_run

WORKERS = Path(__file__).resolve().parent / "bench_workers.py"
V = 151_936
MODELS = {  # name: (about, qwen3_config shape, MoE settings or None)
    "dense": ("Qwen3-0.6B-shaped (28 layers, hidden 1024)",
              dict(vocab=V, hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072, tie=True),
              None),
    "moe": ("Qwen3-30B-A3B-shaped, 4 layers (128 experts, top-8, hidden 2048)",
            dict(vocab=V, hidden=2048, layers=4, heads=32, kv_heads=4, head_dim=128, intermediate=6144, tie=False),
            dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, router_aux_loss_coef=0.001)),
}
TINY = {
    "dense": ("tiny dense", dict(vocab=1024, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                                 tie=True), None),
    "moe": ("tiny MoE", dict(vocab=1024, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                             tie=False),
            dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, router_aux_loss_coef=0.001)),
}
WORK = dict(prompts=16, group=8, max_new_tokens=256, minibatches=4, steps=4, repeats=3)
TINY_WORK = dict(prompts=2, group=2, max_new_tokens=8, minibatches=2, steps=2, repeats=1)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
CLIP = (3e-4, 4e-4)  # GSPO's clip range (conf/algo/gspo.yaml)
SAMPLER_LOGPROB_FIELDS = ("sampler_logp",)  # the Rollout field gspo records while sampling


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def problems_for(a) -> list:
    """The step's prompts: the addition task's training prompts, as `gspo train` draws them."""
    import random

    from gspo.config.loading import compose
    from gspo.tasks import build_task

    task = build_task(compose([]).task)
    return task.sample_train(random.Random(a.seed), a.prompts)


def build(name: str, a) -> Path:
    """The model's checkpoint directory (random weights in `--dtype`, built on the device, cached)."""
    from gspo.config.loading import compose
    from gspo.tasks import build_task

    about, shape, moe = (TINY if a.tiny else MODELS)[name]
    alphabet = build_task(compose([]).task).alphabet
    key = {"name": name, "shape": shape, "moe": moe, "alphabet": alphabet, "seed": a.seed, "dtype": a.dtype}
    return cached_model_dir(f"gpu-{name}", key, lambda: random_model(shape, alphabet, a.seed, DTYPES[a.dtype],
                                                                     a.device, moe))


def load(model_dir: Path, dtype: str, device: str):
    from gspo.models.build import load_pretrained

    model, tok = load_pretrained(model_dir, DTYPES[dtype])
    return model.to(device).eval(), tok


def completion_tokens(comp: torch.Tensor, eos: int) -> int:
    """Tokens of each row up to and including its first EOS, summed."""
    is_eos = (comp == eos).long()
    return int(((is_eos.cumsum(-1) - is_eos) == 0).sum())


# --------------------------------------------------------------------------- rollout: tokens/s


def bench_rollout(model, tok, a) -> dict:
    """gspo's sampler vs `model.generate()` on the same batch: median seconds per call, tokens/s, peak memory."""
    from gspo.rollout.decoding.generate import encode_prompts, generate, left_pad
    from gspo.rollout.decoding.params import SamplingParams

    prompts = [p.prompt for p in problems_for(a)]
    encoded = encode_prompts(tok, prompts)
    ids, mask = left_pad([e for e in encoded for _ in range(a.group)], tok.pad_token_id)
    ids, mask = ids.to(a.device), mask.to(a.device)
    hf_kwargs = json.loads(a.hf_generate_kwargs)

    def gspo() -> int:
        return int(generate(model, tok, prompts, a.group, SamplingParams(a.max_new_tokens))
                   .completion_mask.sum())

    def hf() -> int:
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=a.max_new_tokens, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id, **hf_kwargs)
        return completion_tokens(out[:, ids.shape[1]:], tok.eos_token_id)

    def gspo_compiled() -> int:  # static KV cache + torch.compile (CUDA graphs): `hardware.compile=true`
        return int(generate(model, tok, prompts, a.group, SamplingParams(a.max_new_tokens, compile=True))
                   .completion_mask.sum())

    def gspo_fast() -> int:  # gspo/rollout/decoding/fast_decode.py: `rollout.engine=fast`
        return int(generate(model, tok, prompts, a.group, SamplingParams(a.max_new_tokens, engine="fast"))
                   .completion_mask.sum())

    fns = {"gspo": gspo, "hf": hf, **({"gspo_compiled": gspo_compiled} if a.compile else {}),
           **({"gspo_fast": gspo_fast} if a.fast else {})}
    res = {k: {"s": [], "tokens": []} for k in fns}
    with torch.no_grad():
        for name, fn in fns.items():
            fn()  # warm-up: kernels, allocator, caches
        for _ in range(a.repeats):  # alternating calls
            for name, fn in fns.items():
                if torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()
                sync()
                t0 = time.perf_counter()
                n = fn()
                sync()
                res[name]["s"].append(time.perf_counter() - t0)
                res[name]["tokens"].append(n)
                if torch.cuda.is_available():
                    res[name]["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    for r in res.values():
        r["median_s"] = statistics.median(r["s"])
        r["tokens_per_s"] = statistics.median(n / s for n, s in zip(r["tokens"], r["s"]))
    return res


# --------------------------------------------------------------------------- decode: eager against graph

DECODE_MODES = ("eager", "static", "graph")
DECODE_ALPHABET = "0123456789+="


def decode_prompts(a) -> list[str]:
    """`a.prompts` addition prompts of 4 to 10 characters (left padding up to 6 columns), from `a.seed`."""
    import random

    rng = random.Random(a.seed)
    return [f"{rng.randrange(10 ** rng.randint(1, 4))}+{rng.randrange(10 ** rng.randint(1, 4))}="
            for _ in range(a.prompts)]


def bench_decode(name: str, a) -> dict:
    """Decode ms per step of the fast engine in each `rollout.decode` mode (`--decode-modes`), on one batch.

    ms/step = (a rollout of T tokens - one of 2 tokens) / (T - 2): the prefill, the first draw and the rollout's
    set-up cancel; every row runs to T (an EOS the model never samples). Each mode runs once untimed first at both
    lengths (graph: its captures, timed as `first_call_s`), then `a.repeats` rounds alternate the modes. The
    rollouts of the last round share their seeds: graph against static bit for bit (tokens, log-probs, kept mass,
    routing), eager against graph row by row. A mode this machine cannot run (graph without CUDA) is skipped, said.
    """
    from gspo.models import moe
    from gspo.rollout.decoding import static_decode
    from gspo.rollout.decoding.generate import generate
    from gspo.rollout.decoding.params import SamplingParams

    about, shape, moe_cfg = (TINY if a.tiny else MODELS)[name]
    model, tok = random_model(shape, DECODE_ALPHABET, a.seed, DTYPES[a.dtype], a.device, moe_cfg)
    model.eval()
    prompts, T, capture = decode_prompts(a), a.max_new_tokens, moe.is_moe(model)
    res: dict = {"about": about, "rows": len(prompts) * a.group, "new_tokens": T, "dtype": a.dtype,
                 "device": a.device, "capture_routing": capture, "modes": {}}
    modes = []
    for mode in a.decode_modes:
        runs_as = static_decode.resolve(mode, model)
        if runs_as != mode:  # graph on a CPU: what --tiny checks is everything else
            why = static_decode.unsupported(model, graph=mode == "graph") or f"resolves to {runs_as}"
            res["modes"][mode] = {"skipped": why}
            print(f"  decode {mode}: skipped: {why}", flush=True)
        else:
            modes.append(mode)
    captures = {"n": 0}
    original = static_decode.StaticDecoder._capture

    def counted(self):
        captures["n"] += 1
        return original(self)

    def run(mode: str, tokens: int):
        gens = [torch.Generator(device=a.device).manual_seed(1000 + i) for i in range(len(prompts))]
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            ro = generate(model, tok, prompts, a.group, SamplingParams(tokens, engine="fast", decode=mode,
                                                                       capture_routing=capture), generator=gens)
        sync()
        return ro, time.perf_counter() - t0

    static_decode.StaticDecoder._capture = counted
    try:
        times = {m: {"long": [], "short": [], "first_call_s": None} for m in modes}
        for mode in modes:  # warm-up: kernels and allocator; graph: one capture per cache length (T and 2)
            captures["n"] = 0
            times[mode]["first_call_s"] = run(mode, T if mode == "graph" else min(T, 8))[1]
            run(mode, 2)
            times[mode]["captures"] = captures["n"]
        last = {}
        for _ in range(a.repeats):
            for mode in modes:
                if torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()
                captures["n"] = 0
                last[mode], s = run(mode, T)
                times[mode]["long"].append(s)
                times[mode]["short"].append(run(mode, 2)[1])
                times[mode]["captures_timed"] = times[mode].get("captures_timed", 0) + captures["n"]
                if torch.cuda.is_available():
                    times[mode]["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    finally:
        static_decode.StaticDecoder._capture = original
    for mode in modes:
        t = times[mode]
        per_step = [(lo - sh) / max(T - 2, 1) * 1e3 for lo, sh in zip(t["long"], t["short"])]
        res["modes"][mode] = {
            "ms_per_step": statistics.median(per_step), "rounds_ms_per_step": per_step,
            "rollout_s": statistics.median(t["long"]), "first_call_s": t["first_call_s"],
            "tokens_per_s": res["rows"] * T / statistics.median(t["long"]), "captures_warmup": t["captures"],
            "captures_timed": t.get("captures_timed", 0), "peak_allocated_gib": t.get("peak_allocated_gib"),
            "failed_capture": static_decode._FAILED.get(model)}
    res["modes"] = {m: res["modes"][m] for m in a.decode_modes}  # in the order asked
    if "graph" in last and "static" in last:
        g, st = last["graph"], last["static"]
        same = {f: bool(torch.equal(getattr(g, f), getattr(st, f))) for f in
                ("input_ids", "sampler_logp", "kept_mass", "routing", "router_logp") if getattr(g, f) is not None}
        res["graph_equals_static"] = {**same, "all": all(same.values()),
                                      "logp_max_abs_diff": (g.sampler_logp - st.sampler_logp).abs().max().item()}
    if "graph" in last and "eager" in last:
        g, e = last["graph"], last["eager"]
        rows = (g.input_ids == e.input_ids).all(-1)
        res["eager_vs_graph"] = {"rows_identical": int(rows.sum()), "rows": len(rows),
                                 "logp_max_abs_diff_on_identical_rows":
                                     (g.sampler_logp - e.sampler_logp)[rows].abs().max().item() if rows.any() else None}
    if all("ms_per_step" in res["modes"].get(m, {}) for m in ("eager", "graph")):
        res["eager_over_graph"] = res["modes"]["eager"]["ms_per_step"] / res["modes"]["graph"]["ms_per_step"]
    static_decode.release()
    del model
    return res


FAMILIES = {  # decode part's check: tiny random models of the other families the fast engine serves (float32, bf16)
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True, attn_implementation="eager")),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(attn_implementation="sdpa")),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, attn_implementation="sdpa")),
}


def decode_check(a) -> dict:
    """graph against static, bit for bit, and eager against graph, on tiny Llama (every bias, eager attention),
    Qwen2 (q/k/v biases) and Mistral models in float32 and bf16: 4 prompts x G=4, 48 tokens, temperature 0.7,
    top-p 0.9, the top-2 kept (what tests/rollout/decoding/test_fast_decode.py's GPU tests check, without their
    dependencies)."""
    import transformers

    from gspo.rollout.decoding import static_decode
    from gspo.rollout.decoding.generate import generate
    from gspo.rollout.decoding.params import SamplingParams

    out = {}
    for family, (config, causal, extra) in FAMILIES.items():
        for dtype in ("float32", "bfloat16"):
            tok = never_ending_tokenizer(DECODE_ALPHABET, 64)
            torch.manual_seed(a.seed)
            cfg = getattr(transformers, config)(vocab_size=64, hidden_size=64, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                intermediate_size=128, max_position_embeddings=512, pad_token_id=0,
                                                eos_token_id=None, bos_token_id=None, tie_word_embeddings=False,
                                                **extra)
            model = getattr(transformers, causal)(cfg).to(a.device, DTYPES[dtype]).eval()
            with torch.no_grad():
                model.lm_head.weight.mul_(3.0)
                for prm in model.parameters():
                    if prm.dim() == 1:
                        prm.add_(torch.randn_like(prm) * 0.2)
            modes = [m for m in DECODE_MODES if static_decode.resolve(m, model) == m]
            ro = {}
            for mode in modes:
                gens = [torch.Generator().manual_seed(100 + i) for i in range(4)]
                with torch.no_grad():
                    ro[mode] = generate(model, tok, decode_prompts(argparse.Namespace(prompts=4, seed=a.seed)), 4,
                                        SamplingParams(48, temperature=0.7, top_p=0.9, keep_topk=2, engine="fast",
                                                       decode=mode), generator=gens)
            r = {"modes": modes, "failed_capture": static_decode._FAILED.get(model)}
            if "graph" in ro:
                g, st, e = ro["graph"], ro["static"], ro["eager"]
                r["graph_equals_static"] = all(torch.equal(getattr(g, f), getattr(st, f)) for f in
                                               ("input_ids", "sampler_logp", "kept_mass", "topk_ids", "topk_logp"))
                rows = (g.input_ids == e.input_ids).all(-1)
                r["eager_rows_identical"] = f"{int(rows.sum())}/{len(rows)}"
                r["eager_logp_max_abs_diff_on_them"] = (g.sampler_logp - e.sampler_logp)[rows].abs().max().item() \
                    if rows.any() else None
            out[f"{family} {dtype}"] = r
            print(f"  decode check {family} {dtype}: {json.dumps(r)}", flush=True)
            static_decode.release()
    return out


# --------------------------------------------------------------------------- mismatch: sampler vs trainer


@torch.no_grad()
def replay_logprobs(model, rollout) -> torch.Tensor:
    """Log-probs (N, T) of the rollout's completion tokens computed the way the sampler computes them:
    a prefill of the prompt, then one token at a time over the KV cache (float32 log-softmax of each
    step's last logits). Used when the Rollout carries no sampler log-probs of its own."""
    from gspo.rollout.decoding.generate import position_ids

    p, comp = rollout.prompt_len, rollout.completion_ids
    n, t = comp.shape
    mask = torch.cat([rollout.attention_mask[:, :p], torch.ones_like(comp)], 1)  # the sampler's mask: ones after the prompt
    res = model(input_ids=rollout.input_ids[:, :p], attention_mask=mask[:, :p], position_ids=position_ids(mask[:, :p]),
                use_cache=True, logits_to_keep=1)
    out = torch.empty(n, t, device=comp.device)
    for j in range(t):
        out[:, j] = res.logits[:, -1].float().log_softmax(-1).gather(-1, comp[:, j : j + 1]).squeeze(-1)
        if j + 1 < t:
            m = mask[:, : p + j + 1]
            res = model(input_ids=comp[:, j : j + 1], attention_mask=m, position_ids=position_ids(m)[:, -1:],
                        past_key_values=res.past_key_values, use_cache=True)
    return out


def mismatch_stats(sampler: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor, clip=CLIP) -> dict:
    """How far the trainer's log-probs of the sampled tokens are from the sampler's, on completion tokens.

    d = trainer - sampler per token; per sequence GSPO's log-ratio sum(m d) / |y|; k3 = exp(d) - d - 1
    (the estimate of KL(sampler || trainer) from the sampler's own tokens).
    """
    mask = mask.double()  # float64: k3 ~ d^2/2 is ~1e-14 in float32 runs, below float32's resolution of exp(d) - 1
    d = (trainer.double() - sampler.double()) * mask
    tok = d.abs()[mask.bool()]
    seq = d.sum(-1) / mask.sum(-1).clamp(min=1)
    k3 = (torch.expm1(d) - d) * mask
    ratio_s = torch.exp(seq)
    return {
        "token_abs_diff_mean": tok.mean().item(), "token_abs_diff_max": tok.max().item(),
        "seq_abs_diff_mean": seq.abs().mean().item(), "seq_abs_diff_max": seq.abs().max().item(),
        "k3_mean": (k3.sum() / mask.sum()).item(),
        "seq_outside_clip_frac": ((ratio_s < 1 - clip[0]) | (ratio_s > 1 + clip[1])).float().mean().item(),
        "tokens": int(mask.sum()),
    }


def bench_mismatch(model_dir: Path, a) -> dict:
    """Sample a batch with gspo's sampler, then compare its log-probs with `gspo.rollout.decoding.generate.token_logprobs`."""
    from gspo.rollout.decoding.generate import generate, token_logprobs
    from gspo.rollout.decoding.params import SamplingParams

    prompts = [p.prompt for p in problems_for(a)]
    out = {}
    for dtype in dict.fromkeys([a.dtype, "float32"]):  # the run's dtype, and float32 as the control
        model, tok = load(model_dir, dtype, a.device)
        torch.manual_seed(a.seed)
        with torch.no_grad():
            ro = generate(model, tok, prompts, a.group, SamplingParams(a.max_new_tokens))
            field = next((f for f in SAMPLER_LOGPROB_FIELDS if getattr(ro, f, None) is not None), None)
            sampler = getattr(ro, field) if field else replay_logprobs(model, ro)
            # the trainer's pass in chunks of rows: its float32 (rows, T, V) copies at V = 151,936 are GBs per row-chunk
            chunks = torch.arange(len(ro.texts)).split(a.logprob_rows)  # CPU indices: Rollout holds CPU tensors too
            trainer = torch.cat([token_logprobs(model, ro.select(rows), 1.0)[0] for rows in chunks])
        out[dtype] = {**mismatch_stats(sampler, trainer, ro.completion_mask),
                      "sampler_source": f"Rollout.{field}" if field else "KV-cache replay"}
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


# --------------------------------------------------------------------------- step: gspo train vs TRL


def bench_step(model_dir: Path, a, tmp: Path) -> dict:
    """Alternating subprocess runs (TRL, gspo, ...): seconds per RL step and peak GPU memory of each."""
    cuda = a.device == "cuda"
    hardware = ["hardware=gpu"] if cuda else ["hardware=cpu", "hardware.threads=0"]
    spec = {"overrides": gspo_overrides(a, model_dir, [*hardware, f"hardware.dtype={a.dtype}"]), "threads": 0}
    out: dict = {"trl": [], "gspo": []}
    for r in range(a.rounds):
        for kind in a.trainers:
            work = tmp / f"{model_dir.name}-{kind}-{r}"
            extra = {"run_dir": str(work / "run")} if kind == "gspo" else {}
            try:
                res, rss, _ = run_worker(kind, WORKERS, {**spec, **extra}, work)
            except WorkerFailed as e:  # e.g. out of GPU memory: recorded, and the benchmark goes on
                out[kind].append({"error": str(e)[-1500:]})
                print(f"  {kind}: round {r + 1}: FAILED\n{str(e)[-1500:]}", flush=True)
                continue
            if kind == "gspo":
                steps, ex = gspo_run(res.pop("rows"))
                res = {**res, "steps": steps, **ex}
            res["rss_mib"] = rss
            out[kind].append(res)
            print(f"  {kind}: round {r + 1}: median {fmt(statistics.median(res['steps'][1:]))} s/step"
                  + (f", peak allocated {res['peak_allocated_gib']:.2f} GiB" if "peak_allocated_gib" in res else ""),
                  flush=True)
    return out


# --------------------------------------------------------------------------- tables


def tables(results: dict, a) -> str:
    models = results["models"]
    blocks = []
    rows = []
    for name, m in models.items():
        if "error" not in m.get("rollout", {"error": 1}):
            g, h = m["rollout"]["gspo"], m["rollout"]["hf"]
            rows.append([name, fmt(g["median_s"]), fmt(h["median_s"]), f"{g['tokens_per_s']:,.0f}",
                         f"{h['tokens_per_s']:,.0f}", ratio(g["tokens_per_s"], h["tokens_per_s"]),
                         fmt(g.get("peak_allocated_gib"), 2), fmt(h.get("peak_allocated_gib"), 2)])
            for key, label in (("gspo_compiled", "gspo compiled"), ("gspo_fast", "gspo fast engine")):
                c = m["rollout"].get(key)
                if not c:
                    continue
                rows.append([f"{name} ({label})", fmt(c["median_s"]), fmt(h["median_s"]), f"{c['tokens_per_s']:,.0f}",
                             f"{h['tokens_per_s']:,.0f}", ratio(c["tokens_per_s"], h["tokens_per_s"]),
                             fmt(c.get("peak_allocated_gib"), 2), fmt(h.get("peak_allocated_gib"), 2)])
    if rows:
        blocks.append("Rollout (tokens/s, higher is better):\n\n" + markdown_table(
            ["model", "gspo s/call", "generate() s/call", "gspo tokens/s", "generate() tokens/s",
             "gspo / generate()", "gspo peak GiB", "generate() peak GiB"], rows))
    steps, mem = [], []
    for name, m in models.items():
        if "step" not in m:
            continue
        med = {}
        for kind, label in (("trl", "TRL GRPOTrainer"), ("gspo", "gspo train")):
            runs = [r for r in m["step"].get(kind) or [] if "error" not in r]
            if not runs:
                continue
            pool = [s for r in runs for s in r["steps"][1:]]
            med[kind] = statistics.median(pool)
            lens = [x for r in runs for x in r["len_mean"][1:]]
            steps.append([name, label, fmt(med[kind]), ", ".join(fmt(statistics.median(r["steps"][1:])) for r in runs),
                          fmt(statistics.mean(lens), 1) if lens else "—"])
            peak = [r.get("peak_allocated_gib") for r in runs]
            logged = [x for r in runs for x in r.get("memory/peak_gib", [])]
            reserved = [r.get("peak_reserved_gib") for r in runs]
            mem.append([name, label, fmt(max(peak), 2) if None not in peak else "—",
                        fmt(max(reserved), 2) if None not in reserved else "—",
                        fmt(max(logged), 2) if logged else "—", f"{max(r['rss_mib'] for r in runs):,.0f}"])
        if len(med) == 2:
            steps.append([name, "**gspo / TRL**", ratio(med["gspo"], med["trl"]), "", ""])
    if steps:
        blocks.append("Time per RL step (first step of each run = warm-up, not counted):\n\n" + markdown_table(
            ["model", "trainer", "median s/step", "per-round medians (s)", "mean completion length"], steps,
            right={2, 4}))
    if mem:
        blocks.append("Peak memory of each trainer's process (GPU: GiB):\n\n" + markdown_table(
            ["model", "trainer", "max_memory_allocated", "max_memory_reserved", "gspo's memory/peak_gib",
             "peak RSS (MiB)"], mem, right={2, 3, 4, 5}))
    rows = []
    for name, m in models.items():
        for dtype, s in ({} if "error" in m.get("mismatch", {}) else m.get("mismatch", {})).items():
            rows.append([name, dtype, f"{s['token_abs_diff_mean']:.2e}", f"{s['token_abs_diff_max']:.2e}",
                         f"{s['seq_abs_diff_mean']:.2e}", f"{s['seq_abs_diff_max']:.2e}", f"{s['k3_mean']:.2e}",
                         f"{s['seq_outside_clip_frac']:.1%}", s["sampler_source"]])
    if rows:
        blocks.append("Sampler vs trainer log-probs of the same sampled tokens:\n\n" + markdown_table(
            ["model", "dtype", "token |d| mean", "token |d| max", "seq |mean d| mean", "seq |mean d| max", "k3 KL",
             "seqs outside clip", "sampler log-probs from"], rows, right={2, 3, 4, 5, 6, 7}))
    rows = []
    for name, m in {**models, **{f"check: {k}": {"check": v} for k, v in results.get("decode_check", {}).items()
                                 if isinstance(v, dict) and "modes" in v}}.items():
        if "check" in m:
            c = m["check"]
            rows.append([name, ", ".join(c["modes"]), "", "", "", "",
                         f"graph == static bitwise: {c.get('graph_equals_static', '—')}; eager's rows identical to "
                         f"graph's: {c.get('eager_rows_identical', '—')}"
                         + (f"; FAILED: {c['failed_capture']}" if c.get("failed_capture") else "")])
            continue
        for mode, r in (m.get("decode") or {}).get("modes", {}).items():
            if "skipped" in r:
                rows.append([name, mode, "skipped", "", "", "", r["skipped"][:80]])
                continue
            rows.append([name, mode, fmt(r["ms_per_step"], 2), ", ".join(fmt(x, 2) for x in r["rounds_ms_per_step"]),
                         f"{r['tokens_per_s']:,.0f}", fmt(r["first_call_s"], 2),
                         f"{r['captures_warmup']} warm-up, {r['captures_timed']} timed"
                         + (f"; FAILED: {r['failed_capture']}" if r.get("failed_capture") else "")])
        d = m.get("decode") or {}
        if "graph_equals_static" in d or "eager_vs_graph" in d:
            ge, eg = d.get("graph_equals_static", {}), d.get("eager_vs_graph", {})
            rows.append([name, "**eager / graph**", ratio(d.get("eager_over_graph"), 1.0), "", "", "",
                         f"graph == static bitwise: {ge.get('all')}; eager's rows identical to graph's: "
                         f"{eg.get('rows_identical')}/{eg.get('rows')}"])
    if rows:
        blocks.append("Decode (`rollout.decode`; ms per decode step, lower is better):\n\n" + markdown_table(
            ["model", "mode", "median ms/step", "per-round ms/step", "tokens/s", "first call s", "captures"], rows,
            right={2, 4, 5}))
    errors = []
    for name, m in models.items():
        failed = [(part, m[part]) for part in ("rollout", "mismatch", "decode") if "error" in m.get(part, {})]
        failed += [("step " + kind, r) for kind, runs in m.get("step", {}).items() for r in runs if "error" in r]
        errors += [f"- {name} {part}: {(r['error'].strip().splitlines() or ['?'])[-1]}" for part, r in failed]
    if errors:
        blocks.append("FAILED (details in the JSON file):\n" + "\n".join(errors))
    work = (f"{a.prompts} prompts x G={a.group}, {a.max_new_tokens} new tokens (every completion runs to full length), "
            f"{a.minibatches} minibatches, {a.steps} RL steps per run, {a.rounds} round(s); {a.dtype} on {a.device}")
    return "\n\n".join([f"Work: {work}. gspo overrides added: {' '.join(a.override) or 'none'}.", *blocks,
                        f"Versions: {results['env']['versions']}."])


# --------------------------------------------------------------------------- driver


def attempt(m: dict, part: str, fn) -> None:
    """m[part] = fn(), or the error if it raised (out of memory, say): the other parts still run."""
    try:
        m[part] = fn()
        print(f"  {part}: {json.dumps(m[part])[:600]}", flush=True)
    except Exception as e:  # noqa: BLE001  (reported in the JSON and the tables)
        m[part] = {"error": f"{type(e).__name__}: {e}"[:1500]}
        print(f"  {part}: FAILED: {m[part]['error']}", flush=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny models and batch: a smoke test that runs on a CPU")
    p.add_argument("--models", default="dense,moe", help="comma-separated: dense, moe")
    p.add_argument("--parts", default="rollout,mismatch,step",
                   help="comma-separated: rollout, mismatch, step, decode (decode: not by default)")
    p.add_argument("--decode-modes", default=",".join(DECODE_MODES),
                   help="decode part: comma-separated rollout.decode modes (eager, static, graph), in this order")
    p.add_argument("--trainers", default="trl,gspo", help="step part: comma-separated trl, gspo (run in this order)")
    for k, v in WORK.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=int, help=f"default {v} ({TINY_WORK[k]} with --tiny)")
    p.add_argument("--rounds", type=int, default=1, help="step part: alternations of the trainers")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-size", type=int, default=4, help="gspo's untimed held-out eval at the start and the end")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="an extra gspo Hydra override")
    p.add_argument("--logprob-rows", type=int, default=16,
                   help="mismatch part: rows per chunk of the trainer's log-prob pass (bounds its memory)")
    p.add_argument("--compile", action="store_true",
                   help="rollout part: also gspo's sampler with a static KV cache through torch.compile (hardware.compile)")
    p.add_argument("--fast", action="store_true",
                   help="rollout part: also gspo's sampler through the fast decode engine (rollout.engine=fast)")
    p.add_argument("--hf-generate-kwargs", default="{}", help='JSON, e.g. \'{"cache_implementation": "static"}\'')
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "outputs")) / "bench_gpu.json")
    p.add_argument("--keep", type=Path, metavar="DIR", help="keep the step runs' files under DIR")
    a = p.parse_args()
    for k, v in (TINY_WORK if a.tiny else WORK).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.models, a.parts, a.trainers = a.models.split(","), a.parts.split(","), a.trainers.split(",")
    a.decode_modes = a.decode_modes.split(",")
    if a.steps < 2 or (a.prompts * a.group) % a.minibatches:
        p.error("--steps must be at least 2 (the first is a warm-up), and prompts x group must divide into minibatches")
    a.threads = 0
    results = {"env": {"versions": versions(), "commit": git_commit(), "args": {k: str(v) for k, v in vars(a).items()}},
               "models": {}}
    a.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        a.out.write_text(json.dumps(results, indent=2))

    t_start = time.time()
    with work_dir(a.keep, "bench-gpu-") as tmp:
        for name in a.models:
            m = results["models"][name] = {"about": (TINY if a.tiny else MODELS)[name][0]}
            if "decode" in a.parts:  # first: it needs no checkpoint (nor Hydra)
                print(f"{name}: {m['about']}: decode", flush=True)
                attempt(m, "decode", lambda: bench_decode(name, a))
                save()
            if not {"rollout", "mismatch", "step"} & set(a.parts):
                continue
            t0 = time.time()
            model_dir = build(name, a)
            print(f"{name}: {m['about']}: {model_dir} ({time.time() - t0:.0f} s)", flush=True)
            if "rollout" in a.parts:
                attempt(m, "rollout", lambda: bench_rollout(*load(model_dir, a.dtype, a.device), a))
                save()
            if "mismatch" in a.parts:
                attempt(m, "mismatch", lambda: bench_mismatch(model_dir, a))
                save()
            if "step" in a.parts:
                m["step"] = bench_step(model_dir, a, tmp)
                save()
        if "decode" in a.parts:
            attempt(results, "decode_check", lambda: decode_check(a))
            save()
    results["env"]["wall_s"] = time.time() - t_start
    save()
    print("\n" + tables(results, a))
    print(f"\nresults: {a.out} (wall {results['env']['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
