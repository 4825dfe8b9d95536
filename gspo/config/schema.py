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

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
GROUPS = ("algo", "model", "task", "reward", "hardware", "logger")
TINY_MAX_POSITIONS = 256  # positions of the models built from config (model.arch qwen3 / qwen3_moe)

# Markings: what a key is, beyond its type and default, as a field's `metadata` (on a node, for every key below it
# that does not mark itself otherwise). An unmarked key defines the experiment: what the run computes. From these
# gspo/config/keys.py derives what a resume may change, which keys tell two arms of `gspo compare` apart, and what
# the warm-started base depends on; tests/config/test_keys.py holds each list.
RUN = {"run": True}  # how or where the run computes, records or names itself, not what it computes (devices,
#   threads, kernels, processes, timeouts, logging, checkpoints, diagnostics): a resume may change it, and compare
#   takes runs that differ in it alone for one arm
NOT_RUN = {"run": False}  # under a RUN node, a key that is part of the experiment (hardware.dtype)
SEED = {"seed": True}  # the seed: the runs of one arm differ in it alone (a resume keeps it)
LABEL = {"label": True}  # a preset's name, not what it chose (that is in the keys beside it); compare ignores it
RESUMABLE = {"resume": True}  # not RUN, yet a resume may change it (train.steps: the length a resume extends)
KEPT_ON_RESUME = {"resume": False}  # RUN, yet a resume refuses to change it (as before these markings were made)
NOT_BASE = {"base": False}  # a model.* or task.* key the warm-started base does not depend on (model.* and task.*
#   keys that are neither RUN nor LABEL are the base's inputs)
BASE = {"base": True}  # a key outside model.* and task.* that the warm-started base depends on


@dataclass
class CriticConfig:
    # PPO's value model (algo.advantage=gae): the policy's base with a scalar head, trained by its own optimizer
    lr: float = 1e-3  # the critic's AdamW learning rate (verl: critic.optim.lr)
    lr_warmup_steps: int = 0  # linear warm-up of that rate over this many RL steps (verl: critic.optim.lr_warmup_steps)
    weight_decay: float = 0.01  # the critic's AdamW weight decay (verl's default)
    value_clip: float = 0.5  # new values clipped to old +- value_clip in the value loss (verl: critic.cliprange_value)
    warmup: int = 0  # the first N RL steps train the critic only, the policy not at all (verl: trainer.critic_warmup)


@dataclass
class AlgoConfig:
    name: str = MISSING  # preset name; `gspo compare` groups runs by it
    loss: str = "grpo"  # key in the gspo.algos.losses registry
    agg: Optional[str] = None  # aggregation override (seq_mean_token_mean | token_mean | seq_mean_token_sum_norm); None = the loss's own
    advantage: str = "grpo"  # key in the gspo.algos.advantages registry
    eps_low: float = 0.2  # ratio clipped to [1 - eps_low, 1 + eps_high]
    eps_high: float = 0.2
    clip_ratio_c: Optional[float] = None  # dual-clip bound for A < 0 (e.g. 3.0); None = off
    delta: Optional[float] = None  # two-sided clip (INTELLECT-2, TRL's delta): the unclipped ratio capped at delta > 1; None = off
    beta: float = 0.0  # KL-to-reference coefficient; 0 = no reference model is built
    kl_estimator: str = "k3"  # k1 | k2 | k3
    kl_in_reward: bool = False  # beta x KL(old policy || reference) subtracted from the reward (PPO's, TRL RLOO's), not added to the loss
    sync_ref_model: bool = False  # TR-DPO reference resets (TRL): ref = alpha policy + (1 - alpha) ref every ref_model_sync_steps updates
    ref_model_mixup_alpha: float = 0.6  # that alpha (TRL's default)
    ref_model_sync_steps: int = 512  # optimizer updates between resets (train.minibatches of them per RL step; TRL's default)
    top_entropy_quantile: float = 1.0  # rho: the policy term trains on the top-rho highest-entropy tokens of each minibatch (TRL); 1 = all
    entropy_coef: float = 0.0  # entropy bonus: loss -= entropy_coef x mean token entropy (TRL's entropy_coef, verl's entropy_coeff)
    gamma: float = 1.0  # advantage gae: discount (verl: algorithm.gamma)
    lam: float = 1.0  # advantage gae: GAE lambda (verl: algorithm.lam)
    critic: CriticConfig = field(default_factory=CriticConfig)  # advantage gae: the value model
    tau_pos: float = 1.0  # SAPO gate temperature for A > 0
    tau_neg: float = 1.05  # SAPO gate temperature for A < 0
    router_shift_floor: float = 0.0  # RSPO: lower bound of the router-shift factor
    clip_cov_ratio: float = 2e-4  # Clip-Cov: share of tokens (at least one) whose gradient is cut, drawn among ...
    clip_cov_lb: float = 1.0  # ... those with covariance(A, log pi) in (clip_cov_lb, clip_cov_ub)
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-3  # KL-Cov: share of tokens (top covariance, at least one) penalised by kl_cov_coef |log pi - log pi_old|
    kl_cov_coef: float = 1.0
    topk_divergence: str = "tv"  # dppo_topk: tv | kl, between the sampler's top-k (+ the rest) and the policy's
    vespo_k_pos: float = 2.0  # vespo: power k of the Gamma kernel W^k exp(lambda (1 - W)) for A >= 0 (TRL's default)
    vespo_lambda_pos: float = 3.0  # vespo: its decay lambda for A >= 0
    vespo_k_neg: float = 3.0  # vespo: k for A < 0
    vespo_lambda_neg: float = 2.0  # vespo: lambda for A < 0
    dro_beta: float = 0.05  # dro: the penalty (beta / 2)(log pi - log pi_old)^2 per token (verl's dro_beta)
    m2_threshold: float = 0.04  # m2po: tokens of largest squared log-ratio are dropped until the rest's mean is below it
    passk_k: int = 4  # advantage passk: the k of pass@k (1 <= k <= rollout.group_size)
    std_eps: float = 1e-4  # added to every std of the advantage estimators (TRL 1e-4; verl 0.9.1: 1e-6)
    whiten: str = "completions"  # reinforce_plus_plus(_baseline): over completions, or tokens (verl 0.9.1's choice)
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, refill the batch
    max_sample_batches: int = 4  # DAPO: at most this many rollout batches drawn per step to fill it
    # DAPO: what must differ within a group for dynamic sampling to keep it (verl's filter_groups.metric): reward =
    # the rewards the advantages use; correct = the task's verdict (the DAPO paper's accuracy); format; fn/<name>
    filter_metric: str = "reward"
    overlong_filter: bool = False  # DAPO: mask truncated completions out of the loss
    overlong_buffer: int = 0  # DAPO soft overlong punishment L_cache (tokens); 0 = off
    overlong_penalty: float = 1.0  # DAPO: penalty at L_max (reward -= this, scaled linearly in the buffer)


@dataclass
class WarmStartConfig:
    # Tiny models only (model=hf is used as it is). The data: (prompt, reference answer) pairs drawn from the
    # task's TRAINING split, never the held-out one; with task=data that is the training rows' answer column, so a
    # file of N rows is seen about steps * batch_size / N times each and RL may start with them memorised.
    steps: int = 1500  # supervised steps on the task's reference solutions, at most (0 = none)
    lr: float = 3e-3  # peak; linear warmup over 20 steps, linear decay to 0 at `steps`
    batch_size: int = 64
    seed: int = 0  # own seed, so every RL seed of a sweep starts from the same base
    problems: int = 0  # warm-start data: this many fixed training problems, sampled in batches (0 = fresh ones every step)
    target_accuracy: float = 0.4  # stop once greedy accuracy on 200 training problems reaches this (0 = run all `steps`)
    check_every: int = 25  # steps between those checks
    fine_check_every: int = 5  # ... and once a check reaches half the target (0 = check_every throughout)


@dataclass
class SplitExpertsConfig:
    # model=hf with a dense Llama: a mixture of experts built from it once (gspo/models/split_experts.py), its MLP's
    # neurons split into `experts` groups by co-activation on text the model writes itself, `top_k` routed per token
    # by routers fitted to each group's contribution; cached in cache_dir by the dense weights' content. 0 = off
    experts: int = 0
    top_k: int = 7
    calibration_sequences: int = 64  # conversations the dense model writes for the construction
    calibration_tokens: int = 160  # tokens per conversation, at most
    seed: int = 0  # the calibration text's and the clustering's seed
    recovery_epochs: int = 0  # passes of distillation from the dense model on the calibration text (experts, routers)
    recovery_lr: float = 3.0e-5  # AdamW's learning rate for that distillation
    # neurons of each MLP in an always-on shared expert, the most important on the calibration text (DeepSeekMoE,
    # Qwen2-MoE): > 0 builds a Qwen2MoeForCausalLM whose `experts` routed experts split the other neurons; 0 = a
    # MixtralForCausalLM, every neuron routed
    shared: int = 0
    # passes of layer-wise recovery: each layer's experts trained to give the dense MLP's output on the MoE's own
    # inputs (its upstream layers already recovered), layer after layer, the routers as fitted; resumable per layer
    layerwise_epochs: int = 0
    layerwise_lr: float = 1.0e-3  # Adam's learning rate for it (cosine to 0 over the passes)
    # a file of a build's decisions (each layer's neuron groups and router weights, which every build writes as
    # split.safetensors beside its checkpoint): the split made from it, the same bytes on any machine, where a build
    # from the calibration text differs with the CPU (its text is sampled). A path, or a recipe gspo ships (conf/model)
    recipe: Optional[str] = None


@dataclass
class LoraConfig:
    r: int = 0  # LoRA rank through peft; 0 = off (full fine-tuning). See gspo/models/adapters.py
    alpha: Optional[float] = None  # LoRA scaling is alpha / r; None = 2 * r
    dropout: float = 0.0  # dropout on the adapter input; must be 0 when MoE expert weights are adapted (peft's limit)
    target_modules: list[str] = field(default_factory=lambda: [  # Linear modules adapted, by name suffix (routers never)
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    target_parameters: list[str] = field(default_factory=lambda: [  # fused 3-D MoE expert weights (transformers 5), where present
        "experts.gate_up_proj", "experts.down_proj"])
    # at the end also write RUN_DIR/merged/: base + adapter as one plain HF checkpoint
    save_merged: bool = field(default=False, metadata=RESUMABLE)
    # sample with a plain copy of the policy, the adapters merged into its base (its adapted weights refreshed before
    # every rollout): one more model's weights in memory, no adapter products beside every projection while decoding
    sample_merged: bool = False


@dataclass
class ModelConfig:
    name: str = field(default=MISSING, metadata=LABEL)  # preset name
    arch: str = "qwen3_moe"  # qwen3 | qwen3_moe | hf
    # with arch=hf: a local Hugging Face checkpoint directory, a GGUF file (dequantized once into cache_dir), or
    # pkg:DIST/FILE, a file shipped in an installed Python package (gspo/config/model_path.py)
    path: Optional[str] = None
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 1
    head_dim: int = 32  # vLLM's CPU attention takes head sizes 32, 64, 80, ... (not 16): every preset runs under the engine
    intermediate_size: int = 128  # dense MLP width (qwen3)
    num_experts: int = 8  # qwen3_moe
    top_k: int = 2  # qwen3_moe: experts per token
    moe_intermediate_size: int = 64  # qwen3_moe: width of each expert
    router_aux_loss_coef: float = 0.001  # load-balancing loss coefficient in RL updates; 0 = off
    norm_topk_prob: bool = True
    # auto (fastest the class supports) | sdpa | eager | flash_attention_2 | ...
    attn_implementation: str = field(default="auto", metadata=RUN)
    # MoE experts kernel: eager | grouped_mm | batched_mm; None = transformers' default
    experts_implementation: Optional[str] = field(default=None, metadata=RUN | KEPT_ON_RESUME)
    gradient_checkpointing: bool = field(default=False, metadata=RUN)
    use_chat_template: bool = False  # wrap prompts in the tokenizer's chat template (real checkpoints; always with tools)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    # LoRA adapters (model.lora.r > 0); the base stays frozen, and LoRA and full runs share one warm-started base
    lora: LoraConfig = field(default_factory=LoraConfig, metadata=NOT_BASE)
    split_experts: SplitExpertsConfig = field(default_factory=SplitExpertsConfig)  # model=hf: a dense Llama made a MoE


@dataclass
class TaskConfig:
    name: str = MISSING  # addition | countdown | long_addition | chain | calculator | word_problems | data (jsonl: the same)
    digits: int = 2  # addition, long_addition, calculator: operand digits
    num_operands: int = 3  # countdown, chain: numbers to combine
    max_operand: int = 9  # countdown, chain: largest number
    path: Optional[str] = None  # data: a .jsonl or .parquet file, one problem per row (gspo/tasks/data.py)
    prompt_column: str = "prompt"  # data: the prompt, a string or chat messages [{"role": ..., "content": ...}]
    answer_column: str = "answer"  # data: the reference answer (GSM8K "... #### 42" or free text, checked with math-verify)
    system_prompt: Optional[str] = None  # data, word_problems: a system message put before every prompt (needs a chat template)
    max_steps: int = 3  # word_problems: arithmetic steps per problem at most (1-3)
    eval_fraction: float = 0.1  # share of the problem space held out, by canonical form (never sampled in training)
    eval_size: int = field(default=200, metadata=RESUMABLE | NOT_BASE)  # held-out prompts scored by eval/accuracy


@dataclass
class RewardConfig:
    name: str = MISSING  # tinyzero | binary | python | model
    correct: float = 1.0  # reward of a correct answer
    format_score: float = 0.1  # reward of a well-formed but wrong answer (TinyZero: 0.1)
    fn: Any = None  # python (and model, beside it): FILE.py:NAME, or a list [A.py:f,B.py:g]; called by keyword as TRL does (docs/contracts.md)
    # model: a reward model directory (AutoModelForSequenceClassification, num_labels 1, its own tokenizer), or a list
    path: Any = None
    device: Optional[str] = None  # model: where the reward model runs, cpu | cuda | auto; None = hardware.device
    batch_size: int = 64  # model: completions scored per forward pass
    weights: Optional[list[float]] = None  # python, model: one weight per model (first) and function (None = all 1); reward = weighted sum
    # python, model: null = the functions score every completion, as TRL; a number = the reward of a completion with a
    # special token before its EOS, the functions not called on it (the built-in rewards score it 0 either way)
    ill_formed: Optional[float] = None
    # scoring a batch (the task's verifier and the reward functions) may take this long (0 = no limit)
    timeout_s: float = field(default=600.0, metadata=RUN | KEPT_ON_RESUME)


@dataclass
class HardwareConfig:
    name: str = MISSING
    device: str = "cpu"  # cpu | cuda | auto
    dtype: str = field(default="float32", metadata=NOT_RUN)  # float32 | bfloat16
    nproc: int = 1  # processes per node (torch.distributed profiles)
    backend: str = "gloo"  # gloo | nccl
    strategy: str = "none"  # none | ddp | fsdp
    threads: int = 0  # torch intra-op threads; 0 = torch's default
    # several processes: a collective that waits longer than this ends the run in one line naming the rank that
    # never came (hung); above reward.timeout_s, since one rank may score that long while the others wait
    collective_timeout_s: float = 900.0
    compile: bool = False  # sample with a static KV cache through torch.compile (CUDA graphs on a GPU; slower on a CPU, docs/benchmarks.md)


@dataclass
class WandbConfig:
    project: str = "gspo"
    entity: Optional[str] = None
    group: Optional[str] = None  # None: the sweep directory's name for multirun jobs
    tags: list[str] = field(default_factory=list)
    name: Optional[str] = None
    mode: str = "offline"  # online | offline | disabled
    samples_every: int = 10  # sample completions every N steps to RUN_DIR/samples.jsonl (and a W&B table); 0 = never


@dataclass
class LoggerConfig:
    name: str = MISSING  # jsonl | wandb
    wandb: bool = False  # metrics.jsonl is always written; this adds a W&B run
    wandb_cfg: WandbConfig = field(default_factory=WandbConfig)
    progress: bool = True  # progress bar on the console


@dataclass
class VllmConfig:
    """The vLLM engine's settings (rollout.engine=vllm; gspo/rollout/engine/client.py). gspo sets the rest itself."""

    # CPU: the engine's KV cache, GiB (vLLM's VLLM_CPU_KVCACHE_SPACE); None = sized to the run (every row of a step at
    # rollout.max_new_tokens + 1024 tokens). A smaller cache serves fewer sequences at once, never other tokens
    kv_cache_gib: Optional[float] = None
    gpu_memory_utilization: float = 0.3  # GPU: the share of the device's memory the engine takes (the trainer shares it)
    enforce_eager: Optional[bool] = None  # no compile / CUDA graphs; None = on a CPU (compiling there is slow), off on a GPU
    max_model_len: Optional[int] = None  # the longest prompt + completion it serves; None = the model's positions
    # LoRA (model.lora.r > 0): what each sync sends the engine. merged = base + ΔW, every weight, reloaded;
    # adapter = the engine loads the base once and each sync sends only the adapter (vLLM's LoRA, a new adapter
    # id per push), always through a directory in /dev/shm (weight_transport=file): dense models only (vLLM's CPU
    # build serves no LoRA on MoE layers)
    lora_push: str = "merged"
    # how each sync's weights reach the engine (rollout.workers=0): file = one copy into a shared-memory file the
    # engine maps (/dev/shm); tensors = broadcast over a process group (gloo; NCCL between distinct GPUs) in
    # buckets of bucket_mb MiB, the trainer's extra memory one bucket (gspo/rollout/engine/transport.py); delta = over
    # that group, only the values that changed in the engine's dtype after the first push (versioned, checksummed; the
    # trainer and the engine each keep one copy of the weights in that dtype: gspo/rollout/engine/delta.py)
    weight_transport: str = "file"
    bucket_mb: float = 64.0
    # the engine's workers, each holding 1/N of every layer (vLLM's tensor parallelism); on a CPU they split the
    # engine's threads. 1 on a MoE (the hooks that record its routing need the model in the engine's own process)
    tensor_parallel_size: int = 1
    # where the engines run. per_rank = an engine each, started by the rank, for its share of the prompts; shared =
    # one engine, rank 0's, serving every rank (one rank's share at a time, the same completions), pushed once per
    # step; server = that one engine started by `gspo vllm-serve` at `server` (HOST:PORT, another host: weights as
    # tensors; both sides share the secret in GSPO_VLLM_KEY)
    mode: str = "per_rank"
    server: Optional[str] = None


@dataclass
class RolloutConfig:
    group_size: int = 8  # G: completions per prompt
    prompts_per_step: int = 16  # prompts per rollout batch
    max_new_tokens: int = field(default=8, metadata=BASE)  # completion length cap
    temperature: float = 1.0  # > 0; also the temperature of pass@k (eval.pass_k)
    top_p: float = 1.0  # nucleus sampling: in (0, 1]; 1 = off
    # float32 | bfloat16 | float16 | int8: the sampler's precision; None = the trainer's (hardware.dtype). When it
    # differs, a copy of the policy in this precision samples, re-synced from the trainer's weights every step;
    # int8 = its Linear products in int8, the rest float32 (CPU only, gspo/rollout/decoding/quantized.py)
    dtype: Optional[str] = None
    # hf | fast | auto | vllm: the decode engine; fast = gspo/rollout/decoding/fast_decode.py (Qwen3, Qwen3-MoE, Llama,
    # Qwen2, Mistral; same samples as hf), auto (default) = fast where it supports the model, quietly hf elsewhere; fast
    # says why when it falls back; vllm = the vLLM inference engine in a process of its own, in rollout.dtype
    # (gspo/rollout/engine/client.py, rollout.vllm.*)
    engine: str = field(default="auto", metadata=RUN | KEPT_ON_RESUME)
    # aten | onednn: the fast engine's decode products. aten = F.linear on the model's own weights (what hf computes);
    # onednn = oneDNN's float32 matmul on copies of the Linear weights reordered at each rollout's start (CPU, float32
    # weights; SmolLM2's decode steps in 0.72x the time, docs/benchmarks.md; the same draws as hf up to rounding:
    # log-probs within 1e-5; one more copy of those weights held while sampling). aten stays the default: one
    # shape on one CPU measured faster, which no rule for other CPUs, sizes or row counts rests on (docs/benchmarks.md)
    matmul: str = "aten"
    # auto | eager | static | graph: how the fast engine runs its decode steps. eager = one kernel after another on
    # its growing cache (the CPU's); static = on a static KV cache, op by op; graph = that step captured once as a
    # CUDA graph and replayed per token (CUDA only; by construction static's draws bit for bit). auto (default) = graph on
    # CUDA where the model is supported, eager elsewhere (gspo/rollout/decoding/static_decode.py)
    decode: str = "auto"
    vllm: VllmConfig = field(default_factory=VllmConfig, metadata=RUN | KEPT_ON_RESUME)
    # auto | sampler | recompute: the old policy's log-probs as recorded while sampling, or from a
    # forward pass of the trainer; auto = sampler when sampler and trainer are the same float32 model, else recompute
    old_logprobs: str = "auto"
    # with sampler log-probs, recompute them every N steps to log the mismatch (0 = never)
    mismatch_every: int = field(default=10, metadata=RUN)
    tis: str = "none"  # none | token | sequence: truncated IS correction of the sampler/trainer mismatch (recompute only)
    tis_cap: float = 2.0  # TIS truncation C: weights min(pi_old / mu, C)
    # none | token | geometric | sequence | outlier: mask tokens whose rho = pi_old/mu is outside [mask_low, mask_high]
    # (masked IS / IcePop), or sequences whose exp(mean_t log rho) is (geometric), whose prod_t rho is (sequence), or
    # that have one such token (outlier); combines with rollout.tis (recompute only). gspo/algos/mismatch.py
    mask: str = "none"
    mask_low: Optional[float] = None  # None = the peers' default: 0.5 (token, sequence, outlier), 0.99 (geometric)
    mask_high: Optional[float] = None  # None = 5 (token, outlier), 1.01 (geometric), 2 (sequence)
    offpolicy_mask_delta: Optional[float] = None  # DeepSeek-V3.2: drop A < 0 sequences with mean log(mu/pi_theta) > delta; None = off
    # the sampler also keeps, at every position, its k most likely tokens and their log-probs (as inference engines
    # return top-k log-probs); the dppo_topk loss reads them. Memory: rows x tokens x k x 12 bytes a batch. 0 = off
    keep_topk: int = 0
    # the batch of step t is sampled by the policy after step t-1-staleness (the initial one while <= 0): exactly,
    # so the run is a function of the seed and config; 0 = synchronous. gspo/rollout/source.py
    staleness: int = 0
    # sampling processes that work ahead while the trainer updates; 0 = in the trainer's process
    workers: int = field(default=0, metadata=RUN)
    # torch threads of each worker (and of in-process sampling when set); 0 = split the cores
    worker_threads: int = field(default=0, metadata=RUN)
    # a rollout worker or the vLLM engine that answers nothing for this long (its start: >= 300 s, the engine's 600 s)
    # is taken as hung: the run ends in one line
    timeout_s: float = field(default=900.0, metadata=RUN)
    # FILE.py:fn1,fn2 (or module.name:fn, or a list of them): functions the model may call, as TRL's `tools=`; each
    # trajectory then runs turns of model and tool calls (gspo/rollout/decoding/multiturn.py);
    # max_new_tokens covers both
    tools: Any = field(default=None, metadata=BASE)  # (the tools' names are in the warm start's prompts)
    # with tools: the model's turns per trajectory at most (calls in the last one are not run)
    max_turns: int = field(default=4, metadata=BASE)
    # with tools: a call that takes longer is cut and answered with an error
    tool_timeout_s: float = field(default=10.0, metadata=RUN | KEPT_ON_RESUME)


@dataclass
class TrainConfig:
    steps: int = field(default=100, metadata=RESUMABLE)  # rollout steps (each: one rollout batch, then updates)
    minibatches: int = 4  # gradient updates per rollout batch (off-policy degree; 4 in the GSPO paper)
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 0  # linear learning-rate warmup over this many RL steps (rollout batches)
    # each minibatch forward at its own rows' width, not the batch's: the same log-probs, less padding computed
    trim_padding: bool = True
    # rows sorted by length into minibatches (less padding; changes which rows share one); off: shuffled per group
    sort_minibatches: bool = False
    # each minibatch's forward packs its rows behind the prompt prefix they all share (a chat template, a system
    # prompt), computed once: the same log-probs and gradients up to float rounding, less computed
    # (gspo/models/packing.py). On by default wherever that holds: a family checked exact, sdpa or eager attention,
    # no sliding window shorter than a row; elsewhere the plain forward, said once (summary.json's `shared_prefix`
    # records which ran). A config.yaml written before this default (the key absent) ran plain: it loads as false
    shared_prefix: bool = True
    checkpoint_every: int = field(default=50, metadata=RUN)  # save a checkpoint every N steps (and always at the end)
    keep_checkpoints: int = field(default=1, metadata=RUN)  # the newest N checkpoints are kept; older ones are deleted


@dataclass
class EvalConfig:
    every: int = 0  # evaluate every N steps (0 = only at the start and the end)
    pass_k: int = 0  # also estimate pass@k with n = 2k samples at rollout.temperature (0 = off)


@dataclass
class MoEConfig:
    routing_replay: str = "none"  # none | R2 (replay old-policy routing) | R3 (replay rollout routing)
    # routing statistics of the updated policy every N steps (0 = never): one extra forward
    stats_every: int = field(default=1, metadata=RUN)
    # ... on this many completions of each group (exchangeable samples; 0 = all)
    stats_rows_per_group: int = field(default=1, metadata=RUN)


@dataclass
class TeacherConfig:
    # on-policy distillation (gspo/algos/distill.py): a teacher checkpoint's per-token reverse KL on the student's own
    # samples, a loss component beside the RL term, each normalised by its own token count (as prime-rl's opd)
    # what model.path takes (a checkpoint directory, a GGUF file, pkg:DIST/FILE), with the student's tokenizer
    path: Optional[str] = None  # None = no teacher
    coef: float = 1.0  # weight of the distillation component
    rl_coef: float = 1.0  # weight of the RL term (the policy loss, its KL term included); 0 = distillation alone


@dataclass
class Config:
    algo: AlgoConfig = MISSING
    model: ModelConfig = MISSING
    task: TaskConfig = MISSING
    reward: RewardConfig = MISSING
    hardware: HardwareConfig = field(default=MISSING, metadata=RUN)  # (hardware.dtype excepted)
    logger: LoggerConfig = field(default=MISSING, metadata=RUN)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig, metadata=RUN)
    moe: MoEConfig = field(default_factory=MoEConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    seed: int = field(default=0, metadata=SEED)
    name: Optional[str] = field(default=None, metadata=RUN)  # appended to the run directory's name
    resume: Optional[str] = field(default=None, metadata=RUN)  # a run directory to continue from its last checkpoint
    # a resume that changes the run's numbers (threads, machine, ...) goes on anyway
    force_resume: bool = field(default=False, metadata=RUN)
    cache_dir: str = field(default="outputs/.cache", metadata=RUN)  # warm-started bases, keyed by their config


def register_configs() -> None:
    """Register the schema: conf/config.yaml lists it first, so every group's YAML is validated against it. Once per
    process: storing converts the whole dataclass tree, a tenth of a compose's time."""
    store = ConfigStore.instance()
    if "config_schema.yaml" not in store.repo:
        store.store(name="config_schema", node=Config)


def leaf_keys(node: type = Config, prefix: str = "") -> list[str]:
    """Every leaf key of a schema node, dotted (`algo.critic.lr`): what docs/contracts.md and the rules in
    gspo/config/checks.py are tested against."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(node)
    return [k for f in dataclasses.fields(node) for k in (
        leaf_keys(hints[f.name], f"{prefix}{f.name}.") if dataclasses.is_dataclass(hints[f.name]) else [prefix + f.name])]


def group_options(group: str) -> list[str]:
    """The options of a config group: the YAML files in conf/<group>/."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
