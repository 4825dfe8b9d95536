"""Benchmark `gspo train` against TRL's `GRPOTrainer` on the same model and the same work (CPU).

Both trainers run GSPO (sequence-level ratio, clip 3e-4/4e-4, no KL) on the addition task
from the same checkpoint directory, on the CPU in float32. Each run is a fresh subprocess
(so peak RSS is its own), and the runs alternate TRL, gspo, TRL, gspo, ... so that machine
noise hits both alike. One table per invocation; `--variant` picks the workload:

  toy     the warm-started tiny Qwen3-MoE, 16 prompts x G=8, max 8 new tokens, 4 minibatches
  long16  the same architecture with random weights and an EOS it never samples: 16 tokens each
  long64  the same, 64 tokens each
  vocab   Qwen3, vocab 151,936, 2 layers, hidden 256, random weights; 4 x G=8, 64 tokens, 2 minibatches

Time per RL step = one rollout batch (prompts x G completions, rewards, old-policy log-probs)
plus `minibatches` optimizer steps on it:
  gspo: `time/step_s` from metrics.jsonl (the held-out evals at the start and end are not timed);
  TRL:  from on_step_begin of the first of the `steps_per_generation` optimizer steps that share
        one generation to on_step_end of the last.
The first RL step of each run is a warm-up and is left out.

With --engine (in the engine's environment, .venv-vllm, with trl installed) two more sides: gspo sampling with
vLLM (rollout.engine=vllm, the engine in its own process) and TRL sampling with vLLM (use_vllm=True,
vllm_mode="colocate"); if TRL's vLLM path does not run here, one line says why and the table goes on without it.
The engine's process is counted in gspo's peak RSS (memory/engine_rss_mib).

Usage (repository root, in the venv with `trl` installed; see docs/benchmarks.md):
  python scripts/bench_vs_trl.py --variant toy
  python scripts/bench_vs_trl.py --variant vocab --override rollout.old_logprobs=sampler
  python scripts/bench_vs_trl.py --variant long16 --engine --no-async
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from bench_common import (
    Run,
    describe_work,
    fmt,
    gspo_overrides,
    markdown_table,
    pooled,
    ratio,
    run_benchmark,
    WorkerFailed,
    versions,
)
from bench_workers import gspo_side, trl_side

ASYNC = ["rollout.workers=1", "rollout.staleness=1", "rollout.worker_threads=1"]  # the async row's settings
ENGINE = ["rollout.engine=vllm"]  # the engine rows' settings


def sides(a, model_dir: Path) -> dict:
    """The alternating sides: each runs one subprocess and returns its Run. With --async (the default) a third:
    gspo with one rollout worker sampling one step behind, the cores split (trainer 1 thread, worker 1)."""
    spec = {"overrides": gspo_overrides(a, model_dir), "threads": a.threads}

    out = {"trl": trl_side(spec, a.wait_idle), "gspo": gspo_side(spec, a.wait_idle)}
    if a.async_row:
        split = ["hardware=cpu", "hardware.dtype=float32", f"hardware.threads={max(1, a.threads - 1)}"]
        async_spec = {"overrides": gspo_overrides(a, model_dir, hardware=split) + ASYNC, "threads": a.threads}
        out["gspo-async"] = gspo_side(async_spec, a.wait_idle, workers=1)
    if a.engine:
        out["gspo-vllm"] = gspo_side({**spec, "overrides": spec["overrides"] + ENGINE}, a.wait_idle)
        trl_vllm = trl_side({**spec, "vllm": True}, a.wait_idle)
        with tempfile.TemporaryDirectory(prefix="bench-trl-vllm-") as tmp:  # does TRL's vLLM path run here?
            try:
                trl_vllm(Path(tmp))
                out["trl-vllm"] = trl_vllm
            except WorkerFailed as e:
                a.trl_vllm_failed = why(str(e))
                print(f"TRL's vLLM path does not run here: {a.trl_vllm_failed}", flush=True)
    return out


def why(failure: str) -> str:
    """The last error line of a failed worker's log tail."""
    lines = [x.strip() for x in failure.splitlines() if x.strip()]
    errors = [x for x in lines if "Error" in x.split(":")[0] or x.startswith(("ValueError", "RuntimeError"))]
    return (errors or lines)[-1][:300]


def more_args(p) -> None:
    p.add_argument("--no-async", dest="async_row", action="store_false",
                   help="leave out the row of gspo with one rollout worker, staleness 1")
    p.add_argument("--engine", action="store_true",
                   help="add gspo and TRL sampling with vLLM (rollout.engine=vllm; use_vllm=True, colocate)")


def table(results: dict[str, list[Run]], a) -> str:
    """Pooled post-warm-up steps of every round, per trainer, and each gspo row / TRL."""
    rows, stats = [], {}
    names = [("trl", "TRL GRPOTrainer"), ("gspo", "gspo train (synchronous)"),
             ("gspo-async", f"gspo train {' '.join(ASYNC[:2])}"), ("trl-vllm", "TRL GRPOTrainer use_vllm=True (colocate)"),
             ("gspo-vllm", f"gspo train {' '.join(ENGINE)}")]
    for kind, name in names:
        if kind not in results:
            continue
        runs = results[kind]
        steps = pooled(runs)
        stats[kind] = (statistics.median(steps), statistics.mean(steps), max(r.rss_mib for r in runs))
        rows.append([name, fmt(stats[kind][0]), fmt(stats[kind][1]),
                     ", ".join(fmt(statistics.median(r.steps[1:])) for r in runs),
                     fmt(statistics.mean(pooled(runs, "len_mean")), 1),
                     fmt(statistics.mean(pooled(runs, "reward_mean")), 3), f"{stats[kind][2]:,.0f}"])
    for kind, base, label in (("gspo", "trl", "**gspo sync / TRL**"), ("gspo-async", "trl", "**gspo async / TRL**"),
                              ("gspo-vllm", "trl", "**gspo vLLM / TRL**"), ("gspo-vllm", "gspo", "**gspo vLLM / gspo sync**"),
                              ("gspo-vllm", "trl-vllm", "**gspo vLLM / TRL vLLM**")):
        if kind in stats and base in stats:
            (gm, gmean, grss), (tm, tmean, trss) = stats[kind], stats[base]
            rows.append([label, ratio(gm, tm), ratio(gmean, tmean), "", "", "", ratio(grss, trss)])
    header = ["trainer", "median s/step", "mean s/step", "per-round medians (s)", "mean completion length",
              "mean reward", "peak RSS (MiB; async: trainer + worker; vLLM: trainer + engine)"]
    work = describe_work(a, ", ".join(k for k in results))
    extra = f"gspo overrides added: {' '.join(a.override)}" if a.override else "gspo overrides added: none"
    failed = getattr(a, "trl_vllm_failed", None)
    note = [f"TRL's vLLM path (use_vllm=True, vllm_mode=colocate) did not run here: {failed}.", ""] if failed else []
    return "\n".join([f"Work: {work}.", extra + ".", "", markdown_table(header, rows, right={1, 2, 4, 5, 6}), "",
                      *note, f"Versions: {versions(a.threads)}."])


if __name__ == "__main__":
    run_benchmark(__doc__.split("\n\n")[0], sides, table, "bench-vs-trl-", more_args)
