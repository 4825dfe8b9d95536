"""Policies: tiny Qwen3 / Qwen3-MoE built from config, or a local Hugging Face checkpoint.

The tiny models are the real `transformers` classes, so every code path (KV cache,
sdpa attention, MoE routers, save/load) is the one a real Qwen3 checkpoint takes.
A random-init model earns no reward, so `base_model` warm-starts it with
supervised steps on the task's reference solutions and caches the result by its
config and the content of the files it reads (a data file): every run of a sweep
starts from the very same weights, built once, and a changed file builds a new base.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from gspo.errors import ConfigError
from gspo.logprobs import check_head
from gspo.moe import is_moe

transformers.utils.logging.disable_progress_bar()  # no per-load progress bars between our own lines

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
TINY_MAX_POSITIONS = 256  # positions of the models built from config (checked by gspo.checks)
CACHE_VERSION = 3  # bump when warm-start code changes, so stale bases are rebuilt (3: canonical split, warm-start pool)


def char_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    """A character-level tokenizer in Hugging Face format: one token per character."""
    vocab = {tok: i for i, tok in enumerate([PAD, EOS, UNK, *sorted(set(alphabet))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK)


def build_model(mcfg, vocab_size: int, tokenizer: PreTrainedTokenizerFast, seed: int) -> torch.nn.Module:
    """A randomly initialised tiny Qwen3 (dense) or Qwen3-MoE from the model config."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(
        vocab_size=vocab_size,
        hidden_size=mcfg.hidden_size,
        num_hidden_layers=mcfg.num_layers,
        num_attention_heads=mcfg.num_heads,
        num_key_value_heads=mcfg.num_kv_heads,
        head_dim=mcfg.head_dim,
        intermediate_size=mcfg.intermediate_size,
        max_position_embeddings=TINY_MAX_POSITIONS,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        attn_implementation=choose_attention(
            Qwen3ForCausalLM if mcfg.arch == "qwen3" else Qwen3MoeForCausalLM, mcfg.attn_implementation),
    )
    torch.manual_seed(seed)
    if mcfg.arch == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**common))
    if mcfg.arch == "qwen3_moe":
        config = Qwen3MoeConfig(
            **common,
            num_experts=mcfg.num_experts,
            num_experts_per_tok=mcfg.top_k,
            moe_intermediate_size=mcfg.moe_intermediate_size,
            norm_topk_prob=mcfg.norm_topk_prob,
            router_aux_loss_coef=mcfg.router_aux_loss_coef,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            **({"experts_implementation": mcfg.experts_implementation} if mcfg.get("experts_implementation") else {}),
        )
        return Qwen3MoeForCausalLM(config)
    raise ConfigError(f"model.arch={mcfg.arch}: valid values are qwen3, qwen3_moe, hf")


ATTENTION = ("auto", "eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
_SUPPORT_FLAG = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn",
                 "flash_attention_3": "_supports_flash_attn", "flex_attention": "_supports_flex_attn"}


def choose_attention(model_class: type, requested: str, device: torch.device | str = "cpu",
                     dtype: torch.dtype = torch.float32) -> str:
    """The attention implementation to load `model_class` with (`model.attn_implementation`).

    `auto`: the fastest the class supports here: flash-attention 2 where it is installed, on a
    GPU, in half precision (its kernels take no float32); else PyTorch's SDPA; else eager. An
    explicit choice the class does not support is refused in one line (ConfigError).
    """
    if requested not in ATTENTION:
        raise ConfigError(f"model.attn_implementation={requested}: must be one of {', '.join(ATTENTION)}")
    supports = lambda impl: impl == "eager" or bool(getattr(model_class, _SUPPORT_FLAG[impl], False))  # noqa: E731
    if requested != "auto":
        if not supports(requested):
            valid = ", ".join(i for i in ATTENTION if i == "auto" or supports(i))
            raise ConfigError(f"model.attn_implementation={requested}: {model_class.__name__} does not support it; "
                              f"it supports {valid}")
        return requested
    from transformers.utils import is_flash_attn_2_available

    if (supports("flash_attention_2") and torch.device(device).type == "cuda"
            and dtype in (torch.float16, torch.bfloat16) and is_flash_attn_2_available()):
        return "flash_attention_2"
    return "sdpa" if supports("sdpa") else "eager"


def normalise_config(config) -> list[str]:
    """Fix, in place, config values that break a class's forward without changing its weights; notes on what changed.

    Multi-head latent attention (DeepSeek-V2/V3, Kimi, GLM-4.7-Flash, ...: `kv_lora_rank` set)
    expands its latent cache to keys and values for every head, but transformers' attention
    still repeats them num_attention_heads / num_key_value_heads times whenever it is given a
    mask (eager always, SDPA on a padded batch): with num_key_value_heads < num_attention_heads
    the head counts no longer match. No weight depends on num_key_value_heads under MLA, so
    setting it to num_attention_heads is the same model, and it runs padded.
    """
    notes = []
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if getattr(config, "kv_lora_rank", None) and isinstance(heads, int) and isinstance(kv, int) and kv != heads:
        config.num_key_value_heads = heads
        notes.append(f"multi-head latent attention computes keys for all {heads} heads: "
                     f"num_key_value_heads={kv} is read as {heads} (the same weights)")
    return notes


def load_pretrained(path: str | Path, dtype: torch.dtype = torch.float32, attn: str = "auto",
                    experts: Optional[str] = None, device: torch.device | str = "cpu", log=None):
    """A local causal-LM checkpoint and its tokenizer, loaded with safetensors.

    `attn`: a `model.attn_implementation` value (see `choose_attention`); `device` and `dtype`
    decide what `auto` may pick. `experts`: the MoE experts kernel (transformers'
    `experts_implementation`); None = its default. `log` (e.g. print) gets one line on the
    attention chosen and on any config value `normalise_config` corrected.
    """
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.path={path}: not a Hugging Face checkpoint directory (no config.json there)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:  # gspo.checks.model_dir_problem catches the usual cases before work
        raise ConfigError(f"model.path={path}: the tokenizer does not load ({str(e).splitlines()[0]})") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    config = AutoConfig.from_pretrained(path)
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ConfigError(f"model.path={path}: {type(config).__name__} has no causal-LM class in transformers "
                          f"{transformers.__version__}; gspo trains causal (decoder) language models")
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    impl = choose_attention(model_class, attn, device, dtype)
    notes = normalise_config(config)
    if log is not None:
        log(f"gspo: {model_class.__name__}: attention {impl}" + (" (auto)" if attn == "auto" else "")
            + "".join(f"; {n}" for n in notes))
    kernels = {"experts_implementation": experts} if experts else {}
    model = model_class.from_pretrained(path, config=config, dtype=dtype, attn_implementation=impl, use_safetensors=True,
                                        **kernels)
    if not check_head(model) and log is not None:
        log(f"gspo: {model_class.__name__} transforms its LM head's logits (soft-cap, scale ...): "
            "log-probs are read off its own logits, not computed chunk by chunk")
    return model, tokenizer


def _input_files(cfg) -> dict[str, str]:
    """The files the warm start reads, by the key naming them: `task.path` (a data file's reference answers).

    The reward is not among them: the warm start is supervised on the task's answers, never scored.
    """
    return {"task.path": str(cfg.task.path)} if cfg.task.get("path") else {}


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _base_key(cfg) -> str:
    from omegaconf import OmegaConf

    m = OmegaConf.to_container(cfg.model, resolve=True)
    for k in ("name", "gradient_checkpointing", "attn_implementation", "experts_implementation", "lora"):
        m.pop(k, None)  # do not change the weights the warm start produces (LoRA and full runs share a base)
    t = OmegaConf.to_container(cfg.task, resolve=True)
    t.pop("eval_size", None)
    files = {k: _sha256(path) for k, path in _input_files(cfg).items() if Path(path).is_file()}  # content, not name
    key = {"v": CACHE_VERSION, "model": m, "task": t, "T": cfg.rollout.max_new_tokens}
    blob = json.dumps(key | ({"files": files} if files else {}), sort_keys=True)  # no file: the key it always had
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def tokenizer_encode(cfg, task):
    """Text -> token ids with the tokenizer training will use, without building or loading the model."""
    if cfg.model.arch == "hf":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(cfg.model.path)
    else:
        tok = char_tokenizer(task.alphabet)
    return lambda text: tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def base_model(cfg, task, log=print) -> Path:
    """The directory of the warm-started base for this config, building it on first use.

    Written to a temporary directory and renamed, so parallel sweep jobs never see
    a half-written base; the first one to finish wins and the others reuse it.
    """
    if cfg.model.arch == "hf":
        if not cfg.model.path:
            raise ConfigError("model=hf needs model.path=DIR (a local Hugging Face checkpoint directory)")
        return Path(cfg.model.path)
    target = Path(cfg.cache_dir) / f"base-{cfg.model.name}-{cfg.task.name}-{_base_key(cfg)}"
    if (target / "config.json").is_file():
        if int(os.environ.get("RANK", "0")) == 0:
            inputs = ", ".join(f"{k}={v}" for k, v in _input_files(cfg).items())
            log(f"gspo: reusing the warm-started base {target}" + (f" (built from {inputs}, same content)" if inputs else ""))
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = char_tokenizer(task.alphabet)
    model = build_model(cfg.model, len(tokenizer), tokenizer, seed=cfg.model.warm_start.seed)
    t0 = time.time()
    record = warm_start(model, tokenizer, task, cfg.model.warm_start, log=log)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    inputs = {k: {"path": path, "sha256": _sha256(path)} for k, path in _input_files(cfg).items()}
    (tmp / "warm_start.json").write_text(json.dumps({"seconds": time.time() - t0, **record, "inputs": inputs}))
    try:
        os.rename(tmp, target)
    except OSError:  # another job finished first: use its base
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def warm_start(model, tokenizer, task, wcfg, log=print) -> dict:
    """Supervised steps on (prompt, reference answer + EOS); loss on the answer tokens only.

    The data: `wcfg.problems` fixed training problems drawn once and sampled in batches, or
    (0) fresh training problems every step; never a held-out one. With `wcfg.target_accuracy`
    > 0 it stops at the first check (every `wcfg.check_every` steps) where greedy accuracy on
    200 fixed *training* problems reaches the target: a base of a known accuracy. Once a check
    reaches half the target, it checks every `wcfg.fine_check_every` steps: near the target,
    accuracy climbs over ten points in 25 steps, and a coarse check stopped at 52.5% for a 40%
    target (docs/results.md). Where the accuracy stands after a fixed number of steps is chaotic
    (float rounding, which differs with the thread count and the CPU's vector ISA, moves it by
    tens of points: docs/results.md), so a fixed step count alone does not give the same base
    on two machines.

    Returns what was done: {"steps", "train_accuracy" (at the last check, None without one)}.
    """
    record = {"steps": 0, "train_accuracy": None}
    if wcfg.steps <= 0:
        return record
    rng = random.Random(wcfg.seed)
    torch.manual_seed(wcfg.seed)
    pool = task.sample_train(rng, wcfg.problems) if wcfg.problems > 0 else None
    check = _accuracy_check(model, tokenizer, task, wcfg) if wcfg.target_accuracy > 0 else None
    opt = torch.optim.AdamW(model.parameters(), lr=wcfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.0, 1 - s / wcfg.steps))
    moe_kwargs = {"output_router_logits": True} if is_moe(model) else {}
    model.train()
    every = wcfg.check_every
    for step in range(wcfg.steps):
        problems = (task.sample_train(rng, wcfg.batch_size) if pool is None
                    else rng.sample(pool, min(wcfg.batch_size, len(pool))))
        ids, labels = [], []
        for p in problems:
            prompt = tokenizer(p.prompt, add_special_tokens=False)["input_ids"]
            answer = tokenizer(p.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            ids.append(prompt + answer)
            labels.append([-100] * len(prompt) + answer)
        width = max(map(len, ids))
        pad = tokenizer.pad_token_id
        input_ids = torch.tensor([x + [pad] * (width - len(x)) for x in ids])
        label_t = torch.tensor([y + [-100] * (width - len(y)) for y in labels])
        mask = torch.arange(width)[None, :] < torch.tensor([len(x) for x in ids])[:, None]
        # MoE: the load-balancing loss is on here as in RL, so RL starts from balanced experts
        # instead of spending its first steps re-routing tokens to satisfy the aux loss.
        out = model(input_ids=input_ids, attention_mask=mask.long(), labels=label_t, **moe_kwargs)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        record["steps"] = step + 1
        if step % 100 == 0 or step == wcfg.steps - 1:
            log(f"warm start {step + 1}/{wcfg.steps}: loss {out.loss.item():.3f}")
        if check is not None and (step + 1) % every == 0:
            record["train_accuracy"] = check()
            if record["train_accuracy"] >= wcfg.target_accuracy:
                log(f"warm start {step + 1}/{wcfg.steps}: greedy accuracy on training problems "
                    f"{record['train_accuracy']:.1%} >= target {wcfg.target_accuracy:.0%}: stopping")
                break
            if record["train_accuracy"] >= wcfg.target_accuracy / 2 and wcfg.fine_check_every > 0:
                every = wcfg.fine_check_every
    model.eval()
    return record


def _accuracy_check(model, tokenizer, task, wcfg, n: int = 200):
    """A function returning greedy accuracy on `n` fixed training problems (never held-out ones)."""
    from gspo.evaluate import evaluate

    problems = task.sample_train(random.Random(f"warm-start-check-{wcfg.seed}"), n)
    width = max(len(tokenizer(p.answer, add_special_tokens=False)["input_ids"]) for p in problems) + 1

    def check() -> float:
        return evaluate(model, tokenizer, task, problems, max_new_tokens=width)["eval/accuracy"]

    return check
