"""The trainers' workers: each runs in a fresh subprocess (so its peak memory is its own).

  python scripts/bench_workers.py trl  SPEC.json    TRL GRPOTrainer on the spec's work
  python scripts/bench_workers.py gspo SPEC.json    `gspo train` (the CLI's Typer app, in process)

SPEC.json: {"overrides": [gspo Hydra overrides], "out": "result.json", "threads": n} (+ "run_dir"
for gspo). Both read the work from the composed overrides (bench_common's docstring says why).
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import bench_common  # (also puts the repository on sys.path)


def cuda_memory() -> dict:
    """Peak CUDA memory of this process so far (GiB), or {} without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return {}
    return {"peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}



def gspo_worker(spec: dict) -> None:
    """`gspo train OVERRIDES hydra.run.dir=RUN_DIR` through the CLI's own Typer app, in this process;
    writes the run's metrics rows, this process's own peak RSS (MiB; the parent's wait4 reports the largest of it
    and its children's, the engine's or rollout workers') and peak CUDA memory to spec["out"]."""
    import resource

    from cli.main import app

    run_dir = Path(spec["run_dir"])
    code = app(["train", *spec["overrides"], f"hydra.run.dir={run_dir}"], standalone_mode=False)
    if code:  # the CLI's exit code for a usage error (its message is already on stderr)
        sys.exit(code)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    Path(spec["out"]).write_text(json.dumps({"rows": [r for r in rows if "time/step_s" in r], **cuda_memory(),
                                             "rss_self_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def gspo_side(spec: dict, wait_idle: float, workers: int = 0):
    """A benchmark side (work dir -> bench_common.Run): `gspo train` on `spec` in a fresh worker process.

    With `workers` rollout workers, the peak RSS is the trainer's plus each worker's own peak (they report it:
    memory/worker_rss_mib): a sum of peaks, at least the peak of the sum. The vLLM engine's process (rollout.engine
    =vllm) is added the same way (memory/engine_rss_mib)."""

    def run(work: Path) -> bench_common.Run:
        res, rss, others = bench_common.run_worker("gspo", Path(__file__), {**spec, "run_dir": str(work / "run")},
                                                   work, wait_idle)
        steps, extra = gspo_run(res["rows"])
        if workers:
            rss += workers * max(r.get("memory/worker_rss_mib", 0.0) for r in res["rows"])
        rss += max(r.get("memory/engine_rss_mib", 0.0) for r in res["rows"])
        return bench_common.Run(steps, rss, others, extra)

    return run


def trl_side(spec: dict, wait_idle: float):
    """A benchmark side (work dir -> bench_common.Run): TRL's `GRPOTrainer` on `spec` in a fresh worker process."""

    def run(work: Path) -> bench_common.Run:
        res, rss, others = bench_common.run_worker("trl", Path(__file__), spec, work, wait_idle)
        extra = {"len_mean": res["len_mean"], "reward_mean": res["reward_mean"]}
        return bench_common.Run(res["steps"], rss, others, extra)

    return run


def gspo_run(rows: list[dict]) -> tuple[list[float], dict]:
    """(seconds per RL step, per-step extras) from gspo's metrics rows."""
    steps = [r["time/step_s"] for r in rows]
    extra = {"len_mean": [r["response/len_mean"] for r in rows], "reward_mean": [r["reward/mean"] for r in rows],
             "rollout_s": [r["time/rollout_s"] for r in rows], "update_s": [r["time/update_s"] for r in rows]}
    for key in ("rollout/logprob_abs_diff_mean", "rollout/logprob_abs_diff_max", "memory/peak_gib"):
        if any(key in r for r in rows):
            extra[key] = [r.get(key, float("nan")) for r in rows]
    return steps, extra


def trl_args(cfg, model_dir: Path, out_dir: Path, device: str, bf16: bool, vllm: bool = False):
    """TRL's GRPOConfig for the work gspo's composed config describes (GSPO settings on both sides); `vllm`: TRL
    samples with vLLM in its own process (use_vllm, vllm_mode="colocate")."""
    import torch
    from transformers import AutoConfig
    from trl import GRPOConfig

    from gspo.algos.losses import get_loss

    algo = cfg.algo
    level = {"gspo": "sequence", "grpo": "token"}.get(algo.loss)
    agg = algo.agg or get_loss(algo.loss).agg
    if level is None or agg != "seq_mean_token_mean" or algo.advantage != "grpo" or algo.dynamic_sampling:
        raise SystemExit(f"the TRL side has no equivalent of algo.loss={algo.loss}, algo.agg={algo.agg}, "
                         f"algo.advantage={algo.advantage}, algo.dynamic_sampling={algo.dynamic_sampling}; "
                         "benchmark algo=gspo or algo=grpo")
    m, rows = cfg.train.minibatches, cfg.rollout.prompts_per_step * cfg.rollout.group_size
    is_moe = hasattr(AutoConfig.from_pretrained(model_dir), "output_router_logits")
    dtype = torch.bfloat16 if bf16 else torch.float32
    return GRPOConfig(
        output_dir=str(out_dir), report_to="none", save_strategy="no", eval_strategy="no",
        use_cpu=device == "cpu", bf16=bf16, fp16=False, gradient_checkpointing=cfg.model.gradient_checkpointing,
        disable_tqdm=True, logging_steps=m, seed=cfg.seed, dataloader_num_workers=0, shuffle_dataset=False,
        log_completions=False,
        model_init_kwargs={"dtype": dtype, "attn_implementation": bench_common.attention(cfg, device, dtype)},
        max_steps=cfg.train.steps * m, per_device_train_batch_size=rows // m, gradient_accumulation_steps=1,
        steps_per_generation=m, num_iterations=1, num_generations=cfg.rollout.group_size,
        max_completion_length=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p, top_k=0,
        importance_sampling_level=level, loss_type="grpo", epsilon=algo.eps_low, epsilon_high=algo.eps_high,
        beta=algo.beta, scale_rewards="group", learning_rate=cfg.train.lr, lr_scheduler_type="constant",
        weight_decay=cfg.train.weight_decay, max_grad_norm=cfg.train.grad_clip, optim="adamw_torch_fused",
        router_aux_loss_coef=cfg.model.router_aux_loss_coef if is_moe else None,
        **({"use_vllm": True, "vllm_mode": "colocate", "vllm_enable_sleep_mode": False,
            "vllm_gpu_memory_utilization": 0.05 if device == "cpu" else 0.3} if vllm else {}),
    )


def peft_config(cfg, model_dir: Path):
    """TRL's `peft_config` for gspo's `model.lora.*` (None: full fine-tuning): the LoraConfig gspo builds
    (`gspo.models.adapters.lora_config`: the same rank, alpha, dropout and target modules), read off the
    checkpoint's architecture on the meta device (no weights loaded)."""
    if cfg.model.lora.r <= 0:
        return None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from gspo.models.adapters import lora_config

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return lora_config(skeleton, cfg.model.lora)


def trl_worker(spec: dict) -> None:
    """TRL's GRPOTrainer on the work of spec["overrides"]; writes per-RL-step seconds (and peak CUDA memory).

    Time per RL step: from on_step_begin of the first of the `steps_per_generation` optimizer
    steps that share one generation to on_step_end of the last (generation, rewards and the
    old-policy pass happen inside the first one).
    """
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from gspo.config.loading import compose
    from gspo.tasks import Problem, build_task
    from gspo.tasks.rewards import score

    cfg = compose(spec["overrides"])
    model_dir, out = Path(cfg.model.path), Path(spec["out"])
    device = "cuda" if cfg.hardware.device in ("cuda", "auto") and torch.cuda.is_available() else "cpu"
    args = trl_args(cfg, model_dir, out.parent / "trl-out", device, bf16=cfg.hardware.dtype == "bfloat16",
                    vllm=bool(spec.get("vllm")))
    task = build_task(cfg.task)
    n = cfg.rollout.prompts_per_step * cfg.train.steps
    problems = task.sample_train(random.Random(cfg.seed), n)
    # gspo wraps a string prompt as one user message under model.use_chat_template when the tokenizer has a
    # template (else it prompts plain text); TRL renders a prompt through the chat template only when the dataset
    # holds messages (and fails without a template): the same rendered prompt on both sides
    chat = bool(cfg.model.use_chat_template) and bool(AutoTokenizer.from_pretrained(model_dir).chat_template)
    prompts = [[{"role": "user", "content": p.prompt}] if chat and isinstance(p.prompt, str) else p.prompt
               for p in problems]
    data = Dataset.from_dict({"prompt": prompts, "answer": [p.answer for p in problems]})

    def correctness(prompts: list, completions: list, answer: list[str], **_) -> list[float]:
        """gspo's own reward: the task verifier, scored by the configured reward (a conversational completion is
        its one assistant message)."""
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return score(task, cfg.reward, texts, [Problem(p, ans) for p, ans in zip(prompts, answer)])[0].tolist()

    class Recorder(TrainerCallback):
        def __init__(self) -> None:
            self.begin: list[float] = []
            self.end: list[float] = []
            self.logs: list[dict] = []

        def on_step_begin(self, args, state, control, **kw) -> None:
            self.begin.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw) -> None:
            if device == "cuda":
                torch.cuda.synchronize()
            self.end.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw) -> None:
            if logs and "completions/mean_length" in logs:
                self.logs.append(dict(logs))

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    rec = Recorder()
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=correctness, args=args, train_dataset=data,
                          processing_class=tokenizer, callbacks=[rec], peft_config=peft_config(cfg, model_dir))
    trainer.train()
    m = cfg.train.minibatches
    steps = [rec.end[(k + 1) * m - 1] - rec.begin[k * m] for k in range(cfg.train.steps)]
    out.write_text(json.dumps({
        "steps": steps,
        "len_mean": [r["completions/mean_length"] for r in rec.logs],
        "reward_mean": [r.get("reward", float("nan")) for r in rec.logs],
        **cuda_memory(),
    }))


WORKERS = {"gspo": gspo_worker, "trl": trl_worker}

if __name__ == "__main__":
    WORKERS[sys.argv[1]](json.loads(Path(sys.argv[2]).read_text()))
