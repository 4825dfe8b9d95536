"""The vLLM engine's LoRA weight push, merged against adapter-only (`rollout.vllm.lora_push`), alternating.

Each round runs each mode in a fresh process (`python scripts/bench_lora_push.py push SPEC.json`), the order
reversed every other round: the model's base saved once (a tiny preset: random weights; model=hf / smollm2: the
checkpoint, a GGUF dequantized into --cache-dir), adapters on it (model.lora.*, rank --rank), and the engine process
gspo starts for a run (gspo/rollout/engine/client.py `EngineProcess`) with that mode's settings. Then --pushes updates,
each: the adapters' factors moved, the push timed (the trainer's write into /dev/shm and the engine's load: what
time/weight_sync_s measures), then one rollout of --prompts x --group completions of --max-new-tokens tokens timed
(an adapter is applied at every token the engine computes: that cost belongs beside the push's). The first push
and rollout of a process are its warm-up and not counted.

The table: per mode, the median push and rollout seconds over every round's counted updates, the engine
process's and this process's peak RSS (the largest over the rounds), what one push writes to /dev/shm, and the
largest gap between the engine's float32 log-probs and the trainer's forward (both modes serve the same policy:
~1e-6). Timings mean something only on an otherwise idle machine: --wait-idle waits for one before each run, and
the load average is printed.

Usage (repository root, in the engine's environment: the README's engine line):
  python scripts/bench_lora_push.py --model smollm2 --cache-dir outputs/.cache --rounds 3
  python scripts/bench_lora_push.py --model qwen3-tiny --rounds 3
A mode vLLM cannot serve shows the engine's error, e.g. adapter pushes on the tiny MoE (docs/scaling.md):
  python scripts/bench_lora_push.py --model qwen3-moe --modes adapter --rounds 1 --pushes 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

from bench_common import CACHE, fmt, markdown_table, run_worker, versions, work_dir

MODES = ("merged", "adapter")
PROMPTS = {"char": ["12+34=", "7+8=", "90+1=", "5+55=", "3+4=", "61+2=", "8+80=", "44+4="],
           "text": ["Write a short poem about the sea.", "What is 17 times 3?", "Name three colours.",
                    "Explain what a prime number is.", "Give me a recipe for tea.", "Who wrote Hamlet?",
                    "Count from one to ten in French.", "Describe a cat in one sentence."]}


def overrides(spec: dict) -> list[str]:
    """The gspo config of one mode's process: the model, the engine in float32, LoRA at --rank, the mode."""
    return [f"model={spec['model']}", "rollout.engine=vllm", "rollout.dtype=float32", f"model.lora.r={spec['rank']}",
            f"rollout.vllm.lora_push={spec['mode']}", f"cache_dir={spec['cache_dir']}", *spec["overrides"]]


def push_worker(spec: dict) -> dict:
    """One mode in this process: the engine started, --pushes updates pushed and sampled, their times and sizes."""
    import torch

    from gspo.config.loading import compose
    from gspo.models import adapters
    from gspo.models.build import build_model, char_tokenizer, load_pretrained
    from gspo.rollout.decoding.generate import stop_ids, token_logprobs
    from gspo.rollout.decoding.params import SamplingParams
    from gspo.rollout.engine import client as engine
    from gspo.rollout.engine.slots import layout_of
    from gspo.train.start.warm_start import base_model

    torch.set_num_threads(spec["threads"])
    cfg = compose(overrides(spec))
    if cfg.model.arch == "hf":
        base_dir = base_model(cfg, task=None, log=lambda *_: None)
        model, tokenizer = load_pretrained(base_dir, torch.float32, cfg.model.attn_implementation)
        prompts = PROMPTS["text"][: spec["prompts"]]
    else:  # a tiny preset, random weights (no warm start: the push's cost does not depend on what was learnt)
        tokenizer = char_tokenizer("0123456789+=")
        model = build_model(cfg.model, len(tokenizer), tokenizer, seed=0)
        base_dir = Path(spec["work"]) / "base"
        model.save_pretrained(base_dir)
        tokenizer.save_pretrained(base_dir)
        prompts = PROMPTS["char"][: spec["prompts"]]
    model = adapters.apply(model.eval(), cfg.model.lora, base_dir, cfg.seed)
    stop = stop_ids(model, tokenizer)
    process = engine.EngineProcess(engine.spec(cfg, base_dir, stop, len(prompts) * spec["group"], spec["threads"],
                                               False), layout_of(model), cfg.rollout.timeout_s)
    front = engine.Engine(process, stop.tolist())
    params = SamplingParams(spec["max_new_tokens"], temperature=1.0)
    push_s, sample_s, shm, gap, engine_rss = [], [], [], 0.0, 0.0
    try:
        for update in range(spec["pushes"]):
            with torch.no_grad():  # an update: the adapters' factors move (the base is frozen)
                g = torch.Generator().manual_seed(update)
                for p in model.parameters():
                    if p.requires_grad:
                        p.add_(0.02 * torch.randn(p.shape, generator=g))
            t0 = time.perf_counter()
            engine_rss = max(engine_rss, process.load(model))
            push_s.append(time.perf_counter() - t0)
            shm.append(size(process.path))
            gens = [torch.Generator().manual_seed(100 * update + i) for i in range(len(prompts))]
            t0 = time.perf_counter()
            r = front.sample(tokenizer, prompts, spec["group"], params, gens)
            sample_s.append(time.perf_counter() - t0)
            with torch.no_grad():
                mine = token_logprobs(model, r, 1.0)[0]
            gap = max(gap, float((mine - r.sampler_logp)[r.completion_mask.bool()].abs().max()))
    finally:
        process.close()
    return {"push_s": push_s, "sample_s": sample_s, "shm_bytes": max(shm), "logprob_gap": gap,
            "engine_rss_mib": engine_rss, "trainer_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def size(path: str) -> int:
    """Bytes of a slot: its file, or the files of an adapter directory."""
    p = Path(path)
    return sum(f.stat().st_size for f in p.iterdir()) if p.is_dir() else p.stat().st_size


def table(results: dict[str, list[dict]]) -> str:
    """One row per mode (medians over every round's counted updates; RSS and sizes the largest), ratios to the first."""
    rows, first = [], {}
    for mode, runs in results.items():
        push = statistics.median(x for run in runs for x in run["push_s"][1:])
        sample = statistics.median(x for run in runs for x in run["sample_s"][1:])
        first = first or {"push": push, "sample": sample}
        rows.append([mode, fmt(push, 4), f"{push / first['push']:.2f}", fmt(sample), f"{sample / first['sample']:.2f}",
                     f"{max(r['engine_rss_mib'] for r in runs):.0f}", f"{max(r['trainer_rss_mib'] for r in runs):.0f}",
                     f"{max(r['shm_bytes'] for r in runs) / 2**20:.2f}", f"{max(r['logprob_gap'] for r in runs):.1e}"])
    return markdown_table(["rollout.vllm.lora_push", "push s (median)", "vs first", "rollout s (median)", "vs first",
                           "engine peak RSS MiB", "trainer peak RSS MiB", "/dev/shm per push MiB",
                           "largest log-prob gap"], rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3-tiny", help="a gspo model preset (conf/model): qwen3-tiny, smollm2, ...")
    p.add_argument("--override", action="append", default=[], help="more gspo overrides (KEY=VALUE), repeatable")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--rank", type=int, default=8, help="model.lora.r")
    p.add_argument("--pushes", type=int, default=6, help="updates per process, the first a warm-up")
    p.add_argument("--prompts", type=int, default=4, choices=range(1, len(PROMPTS["char"]) + 1), metavar="1-8")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="the trainer's and the engine's torch threads")
    p.add_argument("--cache-dir", default=str(CACHE), help="cache_dir: where a GGUF's dequantized checkpoint is kept")
    p.add_argument("--wait-idle", type=float, default=0.0, help="wait up to this many s for an idle machine per run")
    p.add_argument("--keep", type=Path, default=None, help="keep the runs' directories here")
    a = p.parse_args()
    if a.pushes < 2:
        p.error("--pushes: at least 2 (the first is a warm-up)")
    base = {"model": a.model, "overrides": a.override, "rank": a.rank, "pushes": a.pushes, "prompts": a.prompts,
            "group": a.group, "max_new_tokens": a.max_new_tokens, "threads": a.threads, "cache_dir": a.cache_dir}
    load0 = os.getloadavg()[0]
    results: dict[str, list[dict]] = {m: [] for m in a.modes}
    with work_dir(a.keep, "bench-lora-push-") as tmp:
        for r in range(a.rounds):
            for mode in a.modes if r % 2 == 0 else a.modes[::-1]:
                work = tmp / f"{mode}-{r}"
                res, _, others = run_worker("push", Path(__file__), {**base, "mode": mode, "work": str(work)}, work,
                                            a.wait_idle)
                results[mode].append(res)
                print(f"round {r + 1}/{a.rounds} {mode}: push {fmt(statistics.median(res['push_s'][1:]), 4)} s, "
                      f"rollout {fmt(statistics.median(res['sample_s'][1:]))} s (medians); other processes used "
                      f"{others:.2f} of {os.cpu_count()} CPUs", flush=True)
    print(f"\n{' '.join([a.model, f'model.lora.r={a.rank}', *a.override])}: {a.pushes - 1} counted updates per process, "
          f"{a.prompts} prompts x {a.group} completions of up to {a.max_new_tokens} tokens per rollout, {a.rounds} "
          f"rounds alternating. {versions(a.threads)}. Load average (1 min) before/after: {load0:.2f} / "
          f"{os.getloadavg()[0]:.2f}.\n")
    print(table(results))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "push":
        spec = json.loads(Path(sys.argv[2]).read_text())
        Path(spec["out"]).write_text(json.dumps(push_worker(spec)))
    else:
        main()
