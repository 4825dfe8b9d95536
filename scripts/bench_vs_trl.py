"""Benchmark `gspo train` against TRL's `GRPOTrainer` on the same model and the same work.

Both trainers run GSPO (sequence-level ratio, clip 3e-4/4e-4, no KL) on the addition
task, from the same warm-started tiny Qwen3-MoE directory, on the CPU in float32 with
2 threads. Each run is a fresh subprocess (so peak RSS is its own), and the runs
alternate TRL, gspo, TRL, gspo, ... so that machine noise hits both alike.

Time per RL step = one rollout batch (prompts x G completions, with rewards and the
old-policy log-prob pass) plus `minibatches` optimizer steps on it:
  gspo: `time/step_s` from metrics.jsonl (the step-0/final held-out evals are not timed);
  TRL:  a TrainerCallback, from on_step_begin of the first of the `steps_per_generation`
        optimizer steps that share one generation to on_step_end of the last.
The first RL step of each run is a warm-up and is left out of the statistics.

Usage (from the repository root, in the venv with `trl` installed):
  python scripts/bench_vs_trl.py                      # defaults: a few minutes on 2 cores
  python scripts/bench_vs_trl.py --steps 10 --prompts 16 --group 8 --max-new-tokens 8 \
      --minibatches 4 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLIP_LOW, CLIP_HIGH, LR = 3e-4, 4e-4, 1e-3  # conf/algo/gspo.yaml; gspo's train.lr default


def gspo_overrides(a: argparse.Namespace) -> list[str]:
    """The Hydra overrides that describe the benchmark's work (model chosen separately)."""
    return [
        "algo=gspo", f"seed={a.seed}", f"rollout.prompts_per_step={a.prompts}", f"rollout.group_size={a.group}",
        f"rollout.max_new_tokens={a.max_new_tokens}", f"rollout.temperature={a.temperature}",
        f"train.minibatches={a.minibatches}", f"train.steps={a.steps}", f"train.lr={LR}",
        "eval.every=0", "hardware=cpu", "hardware.dtype=float32", f"hardware.threads={a.threads}",
        "logger=jsonl", "logger.progress=false", f"cache_dir={ROOT / 'outputs/.cache'}",
    ]


def build_base(a: argparse.Namespace) -> Path:
    """The warm-started base `gspo train` would start from (built once, cached)."""
    from gspo.config import compose
    from gspo.models import base_model
    from gspo.tasks import build_task

    cfg = compose(gspo_overrides(a))
    return base_model(cfg, build_task(cfg.task)).resolve()


# --------------------------------------------------------------------------- workers (one per subprocess)


def worker_trl(a: argparse.Namespace, model_dir: Path, out: Path) -> None:
    """Train with TRL's GRPOTrainer set up as GSPO; write per-RL-step seconds to `out`."""
    import torch

    torch.set_num_threads(a.threads)
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from gspo.config import compose
    from gspo.rewards import score
    from gspo.tasks import Problem, build_task

    cfg = compose(gspo_overrides(a))
    task = build_task(cfg.task)
    problems = task.sample_train(random.Random(a.seed), a.prompts * a.steps)
    data = Dataset.from_dict({"prompt": [p.prompt for p in problems], "answer": [p.answer for p in problems]})

    def correctness(prompts: list[str], completions: list[str], answer: list[str], **_) -> list[float]:
        """gspo's own reward: the task verifier, scored by the configured reward (tinyzero)."""
        return score(task, cfg.reward, completions, [Problem(p, ans) for p, ans in zip(prompts, answer)])[0].tolist()

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.begin: list[float] = []
            self.end: list[float] = []

        def on_step_begin(self, args, state, control, **kw) -> None:
            self.begin.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw) -> None:
            self.end.append(time.perf_counter())

    m = a.minibatches
    args = GRPOConfig(
        output_dir=str(out.parent / "trl-out"), report_to="none", save_strategy="no", eval_strategy="no",
        use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False, disable_tqdm=True, logging_steps=m,
        seed=a.seed, dataloader_num_workers=0, shuffle_dataset=False, log_completions=False,
        model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"},
        max_steps=a.steps * m, per_device_train_batch_size=a.prompts * a.group // m, gradient_accumulation_steps=1,
        steps_per_generation=m, num_iterations=1, num_generations=a.group, max_completion_length=a.max_new_tokens,
        temperature=a.temperature, top_p=1.0, top_k=0,
        importance_sampling_level="sequence", loss_type="grpo", epsilon=CLIP_LOW, epsilon_high=CLIP_HIGH, beta=0.0,
        scale_rewards="group", learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
        optim="adamw_torch",
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    timer = StepTimer()
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=correctness, args=args, train_dataset=data,
                          processing_class=tokenizer, callbacks=[timer])
    trainer.train()
    steps = [timer.end[(k + 1) * m - 1] - timer.begin[k * m] for k in range(a.steps)]
    out.write_text(json.dumps({"step_s": steps}))


def gspo_command(a: argparse.Namespace, model_dir: Path, out: Path) -> list[str]:
    """The `gspo train` command line for this benchmark (run as the subprocess itself)."""
    return [sys.executable, "-m", "cli.main", "train", "model=hf", f"model.path={model_dir}",
            *gspo_overrides(a), f"hydra.run.dir={out.parent / 'gspo-run'}"]


# --------------------------------------------------------------------------- driver


def busy_cpu_s() -> float:
    """CPU-seconds the whole machine has been busy (all processes, all CPUs), from /proc/stat."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, open("/proc/stat").readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def wait_until_idle(max_wait: float, busy_frac: float = 0.15) -> None:
    """Wait (at most max_wait s) until other processes use < busy_frac of the machine's CPUs."""
    deadline = time.time() + max_wait
    while True:
        b0 = busy_cpu_s()
        time.sleep(1.0)
        if (busy_cpu_s() - b0) / os.cpu_count() < busy_frac or time.time() > deadline:
            return


def run_one(kind: str, a: argparse.Namespace, model_dir: Path, work: Path) -> tuple[list[float], float, float]:
    """One run in a fresh subprocess: (seconds per RL step, peak RSS in MiB, CPU cores other processes used)."""
    work.mkdir(parents=True)
    out = work / "steps.json"
    if kind == "trl":
        cmd = [sys.executable, __file__, "--worker", "trl", "--model-dir", str(model_dir), "--out", str(out),
               *[f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items() if k not in ("worker", "model_dir", "out")]]
    else:
        cmd = gspo_command(a, model_dir, out)
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "MKL_NUM_THREADS": str(a.threads),
           "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    wait_until_idle(a.wait_idle)
    t0, b0 = time.time(), busy_cpu_s()
    with open(work / "log.txt", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage: peak RSS is per run
    others = (busy_cpu_s() - b0 - usage.ru_utime - usage.ru_stime) / (time.time() - t0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{kind} run failed (exit {os.waitstatus_to_exitcode(status)}); see {work / 'log.txt'}:\n"
                 + (work / "log.txt").read_text()[-3000:])
    if kind == "gspo":
        rows = [json.loads(line) for line in (work / "gspo-run" / "metrics.jsonl").read_text().splitlines()]
        steps = [r["time/step_s"] for r in rows if "time/step_s" in r]
    else:
        steps = json.loads(out.read_text())["step_s"]
    return steps, usage.ru_maxrss / 1024, max(0.0, others)  # ru_maxrss: KiB on Linux


def versions(threads: int) -> str:
    import torch
    import transformers
    import trl

    return f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, " \
           f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, {threads} torch threads per run"


def table(results: dict[str, list[tuple[list[float], float, float]]], a: argparse.Namespace) -> str:
    """The markdown table: pooled post-warm-up steps of every round, per trainer, and gspo/TRL."""
    stats = {}
    for kind, runs in results.items():
        steps = [s for run, _, _ in runs for s in run[1:]]  # drop each run's warm-up step
        per_round = [statistics.median(run[1:]) for run, _, _ in runs]
        stats[kind] = (statistics.median(steps), statistics.mean(steps), max(rss for _, rss, _ in runs), per_round)
    lines = ["| trainer | median s/step | mean s/step | per-round medians (s) | peak RSS (MiB) |",
             "|---|---:|---:|---|---:|"]
    for kind, name in (("trl", "TRL GRPOTrainer"), ("gspo", "gspo train")):
        med, mean, rss, per = stats[kind]
        lines.append(f"| {name} | {med:.3f} | {mean:.3f} | {', '.join(f'{x:.3f}' for x in per)} | {rss:.0f} |")
    (gm, gmean, grss, _), (tm, tmean, trss, _) = stats["gspo"], stats["trl"]
    lines.append(f"| **gspo / TRL** | **{gm / tm:.2f}** | **{gmean / tmean:.2f}** | | **{grss / trss:.2f}** |")
    work = (f"{a.prompts} prompts x G={a.group}, max {a.max_new_tokens} new tokens, {a.minibatches} minibatches, "
            f"{a.steps} RL steps per run (first = warm-up, not counted), {a.rounds} rounds alternating TRL, gspo")
    return "\n".join([f"Work: {work}.", "", *lines, "", f"Versions: {versions(a.threads)}."])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="RL steps per run (the first is a warm-up)")
    p.add_argument("--prompts", type=int, default=16, help="prompts per RL step")
    p.add_argument("--group", type=int, default=8, help="G: completions per prompt (TRL num_generations)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="completion length cap (TRL max_completion_length)")
    p.add_argument("--minibatches", type=int, default=4, help="updates per RL step (TRL steps_per_generation)")
    p.add_argument("--rounds", type=int, default=2, help="alternations: each round runs TRL then gspo")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads of each run")
    p.add_argument("--retries", type=int, default=3,
                   help="times to redo a run during which other processes used > 0.25 CPUs (the last one is kept)")
    p.add_argument("--wait-idle", type=float, default=120.0,
                   help="before each run, wait up to this many seconds for the machine to go idle (0: don't)")
    p.add_argument("--worker", choices=["trl"], help=argparse.SUPPRESS)
    p.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    sys.path.insert(0, str(ROOT))
    if a.worker:
        return worker_trl(a, a.model_dir, a.out)
    if (a.prompts * a.group) % a.minibatches or a.steps < 2:
        p.error("prompts x group must divide into minibatches, and --steps must be at least 2")
    model_dir = build_base(a)
    print(f"model: {model_dir}", flush=True)
    load0 = os.getloadavg()[0]
    results: dict[str, list[tuple[list[float], float, float]]] = {"trl": [], "gspo": []}
    with tempfile.TemporaryDirectory(prefix="bench-vs-trl-") as tmp:
        for r in range(a.rounds):
            for kind in ("trl", "gspo"):
                for attempt in range(a.retries + 1):  # a run that other processes slowed is done again
                    steps, rss, others = run_one(kind, a, model_dir, Path(tmp) / f"{kind}-{r}-{attempt}")
                    if others <= 0.25 or attempt == a.retries:
                        break
                    print(f"round {r + 1}/{a.rounds} {kind:4s}: discarded (median {statistics.median(steps[1:]):.3f}"
                          f" s/step; other processes used {others:.2f} CPUs), running it again", flush=True)
                results[kind].append((steps, rss, others))
                print(f"round {r + 1}/{a.rounds} {kind:4s}: median {statistics.median(steps[1:]):.3f} s/step, "
                      f"peak RSS {rss:.0f} MiB, other processes used {others:.2f} of {os.cpu_count()} CPUs",
                      flush=True)
    print(f"\nLoad average (1 min) before/after: {load0:.2f} / {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs. "
          "Other processes slow both trainers; runs they disturbed are redone (--retries).\n")
    print(table(results, a))


if __name__ == "__main__":
    main()
