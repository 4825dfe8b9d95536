"""Typed config schemas: the single source of truth for every config key.

Each group of `conf/` (algo, model, task, reward, hardware, logger) validates
against one dataclass here, registered with Hydra's ConfigStore, so a typo or a
wrong type is caught at composition time with the key's name. YAML files only
choose values; defaults live here, each with one line saying what it means.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from gspo.errors import ConfigError

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
GROUPS = ("algo", "model", "task", "reward", "hardware", "logger")


@dataclass
class AlgoConfig:
    name: str = MISSING  # preset name; `gspo compare` groups runs by it
    loss: str = "grpo"  # key in the gspo.losses registry
    agg: Optional[str] = None  # aggregation override (seq_mean_token_mean | token_mean | seq_mean_token_sum_norm); None = the loss's own
    advantage: str = "grpo"  # key in the gspo.advantages registry
    eps_low: float = 0.2  # ratio clipped to [1 - eps_low, 1 + eps_high]
    eps_high: float = 0.2
    clip_ratio_c: Optional[float] = None  # dual-clip bound for A < 0 (e.g. 3.0); None = off
    beta: float = 0.0  # KL-to-reference coefficient; 0 = no reference model is built
    kl_estimator: str = "k3"  # k1 | k2 | k3
    tau_pos: float = 1.0  # SAPO gate temperature for A > 0
    tau_neg: float = 1.05  # SAPO gate temperature for A < 0
    router_shift_floor: float = 0.0  # RSPO: lower bound of the router-shift factor
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, refill the batch
    max_sample_batches: int = 4  # DAPO: at most this many rollout batches drawn per step to fill it
    overlong_filter: bool = False  # DAPO: mask truncated completions out of the loss
    overlong_buffer: int = 0  # DAPO soft overlong punishment L_cache (tokens); 0 = off
    overlong_penalty: float = 1.0  # DAPO: penalty at L_max (reward -= this, scaled linearly in the buffer)


@dataclass
class WarmStartConfig:
    steps: int = 1500  # supervised steps on the task's reference solutions, at most (0 = none)
    lr: float = 3e-3  # peak; linear warmup over 20 steps, linear decay to 0 at `steps`
    batch_size: int = 64
    seed: int = 0  # own seed, so every RL seed of a sweep starts from the same base
    problems: int = 0  # warm-start data: this many fixed training problems, sampled in batches (0 = fresh ones every step)
    target_accuracy: float = 0.4  # stop once greedy accuracy on 200 training problems reaches this (0 = run all `steps`)
    check_every: int = 25  # steps between those checks


@dataclass
class ModelConfig:
    name: str = MISSING  # preset name
    arch: str = "qwen3_moe"  # qwen3 | qwen3_moe | hf
    path: Optional[str] = None  # with arch=hf: a local Hugging Face checkpoint directory
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128  # dense MLP width (qwen3)
    num_experts: int = 8  # qwen3_moe
    top_k: int = 2  # qwen3_moe: experts per token
    moe_intermediate_size: int = 64  # qwen3_moe: width of each expert
    router_aux_loss_coef: float = 0.001  # load-balancing loss coefficient in RL updates; 0 = off
    norm_topk_prob: bool = True
    attn_implementation: str = "sdpa"  # sdpa | eager
    gradient_checkpointing: bool = False
    use_chat_template: bool = False  # wrap prompts in the tokenizer's chat template (real checkpoints)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)


@dataclass
class TaskConfig:
    name: str = MISSING  # addition | countdown | long_addition | chain | jsonl
    digits: int = 2  # addition, long_addition: operand digits
    num_operands: int = 3  # countdown, chain: numbers to combine
    max_operand: int = 9  # countdown, chain: largest number
    path: Optional[str] = None  # jsonl: file with prompt/answer fields
    eval_fraction: float = 0.1  # share of the problem space held out, by canonical form (never sampled in training)
    eval_size: int = 200  # held-out prompts scored by eval/accuracy


@dataclass
class RewardConfig:
    name: str = MISSING  # tinyzero | binary
    correct: float = 1.0  # reward of a correct answer
    format_score: float = 0.1  # reward of a well-formed but wrong answer (TinyZero: 0.1)


@dataclass
class HardwareConfig:
    name: str = MISSING
    device: str = "cpu"  # cpu | cuda | auto
    dtype: str = "float32"  # float32 | bfloat16
    nproc: int = 1  # processes per node (torch.distributed profiles)
    backend: str = "gloo"  # gloo | nccl
    strategy: str = "none"  # none | ddp | fsdp
    threads: int = 0  # torch intra-op threads; 0 = torch's default


@dataclass
class WandbConfig:
    project: str = "gspo"
    entity: Optional[str] = None
    group: Optional[str] = None  # None: the sweep directory's name for multirun jobs
    tags: list[str] = field(default_factory=list)
    name: Optional[str] = None
    mode: str = "offline"  # online | offline | disabled
    samples_every: int = 10  # log a table of sample completions every N steps (0 = never)


@dataclass
class LoggerConfig:
    name: str = MISSING  # jsonl | wandb
    wandb: bool = False  # metrics.jsonl is always written; this adds a W&B run
    wandb_cfg: WandbConfig = field(default_factory=WandbConfig)
    progress: bool = True  # progress bar on the console


@dataclass
class RolloutConfig:
    group_size: int = 8  # G: completions per prompt
    prompts_per_step: int = 16  # prompts per rollout batch
    max_new_tokens: int = 8  # completion length cap
    temperature: float = 1.0
    top_p: float = 1.0


@dataclass
class TrainConfig:
    steps: int = 100  # rollout steps (each: one rollout batch, then updates)
    minibatches: int = 4  # gradient updates per rollout batch (off-policy degree; 4 in the GSPO paper)
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 0
    checkpoint_every: int = 50  # save a checkpoint every N steps (and always at the end)


@dataclass
class EvalConfig:
    every: int = 0  # evaluate every N steps (0 = only at the start and the end)
    pass_k: int = 0  # also estimate pass@k with n = 2k samples (0 = off)
    temperature: float = 1.0  # sampling temperature for pass@k


@dataclass
class MoEConfig:
    routing_replay: str = "none"  # none | R2 (replay old-policy routing) | R3 (replay rollout routing)


@dataclass
class Config:
    algo: AlgoConfig = MISSING
    model: ModelConfig = MISSING
    task: TaskConfig = MISSING
    reward: RewardConfig = MISSING
    hardware: HardwareConfig = MISSING
    logger: LoggerConfig = MISSING
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    seed: int = 0
    name: Optional[str] = None  # appended to the run directory's name
    resume: Optional[str] = None  # a run directory to continue from its last checkpoint
    cache_dir: str = "outputs/.cache"  # warm-started bases, keyed by their config


def register_configs() -> None:
    """Register the schema: conf/config.yaml lists it first, so every group's YAML is validated against it."""
    ConfigStore.instance().store(name="config_schema", node=Config)


def group_options(group: str) -> list[str]:
    """The options of a config group: the YAML files in conf/<group>/."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


# --------------------------------------------------------------------------- composition


def _suffix(name: Optional[str]) -> str:
    return f"-{name}" if name else ""


def _register_resolvers() -> None:
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("gspo.suffix"):
        OmegaConf.register_new_resolver("gspo.suffix", _suffix)


def compose(overrides: list[str] = ()) -> Any:
    """The composed, validated config for `overrides` (as `gspo train` would see it).

    Raises ConfigError with a message for people on any problem.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    _register_resolvers()
    overrides = list(overrides)
    _check_group_choices(overrides)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = hydra_compose(config_name="config", overrides=overrides)
    except Exception as e:  # Hydra/OmegaConf errors: keep the one line that names the problem
        raise ConfigError(_explain(e)) from None
    finally:
        GlobalHydra.instance().clear()
    check(cfg)
    return cfg


def load_run_config(run_dir: str | Path, overrides: list[str] = ()) -> Any:
    """A run's saved config.yaml with `overrides` applied, checked.

    GROUP=OPTION replaces the whole group by that option's composed node (`task=countdown`);
    KEY=VALUE sets one value (`task.eval_size=500`), after the group swaps.
    """
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(Path(run_dir) / "config.yaml")
    swaps = [o for o in overrides if o.partition("=")[0] in GROUPS]
    if swaps:
        fresh = compose(swaps)
        for o in swaps:
            group = o.partition("=")[0]
            cfg[group] = fresh[group]
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([o for o in overrides if o not in swaps]))
    check(cfg)
    return cfg


def sweep_combinations(overrides: list[str], limit: int = 256) -> list[list[str]]:
    """Expand Hydra sweep syntax (`algo=grpo,gspo seed=0,1`) into the jobs' override lists."""
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser


    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception as e:
        raise ConfigError(f"cannot parse the overrides: {e}") from None
    choices = []
    for o in parsed:
        key = o.get_key_element()
        values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]
        choices.append([f"{key}={v}" for v in values])
    return [list(c) for c in itertools.islice(itertools.product(*choices), limit)]


def _check_group_choices(overrides: list[str]) -> None:

    for o in overrides:
        key, _, value = o.lstrip("+~").partition("=")
        if key == "experiment":  # a preset over several groups (conf/experiment/*.yaml), added with a +
            valid = ", ".join(group_options("experiment"))
            if value not in group_options("experiment"):
                raise ConfigError(f"+experiment={value}: no such experiment. Valid experiments: {valid}")
            if not o.startswith("+"):
                raise ConfigError(f"{o}: an experiment is added to the config, not swapped in: write +experiment={value}")
        if key in GROUPS and value and value not in group_options(key):
            raise ConfigError(
                f"{key}={value}: no such option for '{key}'. Valid options: {', '.join(group_options(key))}"
            )


def _explain(e: Exception) -> str:
    import re

    msgs = [str(x) for x in (e, e.__cause__) if x is not None]
    text = "\n".join(msgs)
    m = re.search(r"Key '([^']+)' (?:is )?not in", text) and re.search(r"full_key: (\S+)", text)
    if m:
        parent = m.group(1).rsplit(".", 1)[0] if "." in m.group(1) else ""
        return f"{m.group(1)}: unknown key.{_valid_keys(parent)}"
    m = re.search(r"Could not find '([^']+)'", text)
    if m:
        group = m.group(1).split("/")[0]
        return f"{m.group(1)}: no such config. Valid options for '{group}': {', '.join(group_options(group))}"
    m = re.search(r"full_key: (\S+)", text)
    first = msgs[-1].strip().splitlines()[0]
    return f"{m.group(1)}: {first}" if m else first


def _valid_keys(parent: str) -> str:
    from omegaconf import OmegaConf

    node: Any = OmegaConf.structured(Config)
    try:
        for part in filter(None, parent.split(".")):
            node = node[part] if not OmegaConf.is_missing(node, part) else None
        keys = sorted(node.keys()) if node is not None else []
    except Exception:
        keys = []
    if not keys:  # a group node (algo, model, ...): its schema's fields
        schema = {"algo": AlgoConfig, "model": ModelConfig, "task": TaskConfig, "reward": RewardConfig,
                  "hardware": HardwareConfig, "logger": LoggerConfig}.get(parent)
        keys = sorted(OmegaConf.structured(schema).keys()) if schema else []
    return f" Valid keys under '{parent or 'the top level'}': {', '.join(keys)}" if keys else ""


CHOICES = {
    "moe.routing_replay": ("none", "R2", "R3"),
    "hardware.device": ("cpu", "cuda", "auto"),
    "hardware.dtype": ("float32", "bfloat16", "float16"),
    "hardware.strategy": ("none", "ddp", "fsdp"),
    "algo.kl_estimator": ("k1", "k2", "k3"),
    "algo.agg": (None, "seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"),
    "model.arch": ("qwen3", "qwen3_moe", "hf"),
    "logger.wandb_cfg.mode": ("online", "offline", "disabled"),
}


def check(cfg: Any) -> None:
    """Semantic checks Hydra cannot do: registry names, enumerations, required paths."""
    from omegaconf import OmegaConf

    from gspo.advantages import ADVANTAGES
    from gspo.losses import LOSSES

    missing = sorted(OmegaConf.missing_keys(cfg))
    if cfg.model.arch == "hf" and not cfg.model.path:
        raise ConfigError("model=hf needs model.path=DIR: a local Hugging Face checkpoint directory")
    if missing:
        raise ConfigError(f"missing required value(s): {', '.join(missing)} (set them as KEY=VALUE)")
    for key, valid in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in valid:
            raise ConfigError(f"{key}={value}: valid values are {', '.join(map(str, valid))}")
    for key, registry in (("algo.loss", LOSSES), ("algo.advantage", ADVANTAGES)):
        if OmegaConf.select(cfg, key) not in registry:
            raise ConfigError(f"{key}={OmegaConf.select(cfg, key)}: valid values are {', '.join(sorted(registry))}")
    if cfg.model.arch == "hf" and not (Path(cfg.model.path) / "config.json").is_file():
        raise ConfigError(f"model.path={cfg.model.path}: not a Hugging Face checkpoint directory (no config.json)")
    if cfg.task.name == "jsonl" and not (cfg.task.path and Path(cfg.task.path).is_file()):
        raise ConfigError(f"task=jsonl needs task.path=FILE, a JSONL file with prompt/answer fields (got {cfg.task.path})")
    for key in ("rollout.group_size", "rollout.prompts_per_step", "rollout.max_new_tokens", "train.minibatches"):
        if OmegaConf.select(cfg, key) < 1:
            raise ConfigError(f"{key} must be at least 1")
    if cfg.resume and not (Path(cfg.resume) / "config.yaml").is_file():
        raise ConfigError(f"resume={cfg.resume}: not a gspo run directory (no config.yaml there)")
