"""Policies: tiny Qwen3 / Qwen3-MoE built from config, or a local Hugging Face checkpoint.

The tiny models are the real `transformers` classes, so every code path (KV cache,
sdpa attention, MoE routers, save/load) is the one a real Qwen3 checkpoint takes.
A random-init model earns no reward: `gspo.train.start.warm_start` makes the base RL starts from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from gspo.config.schema import TINY_MAX_POSITIONS
from gspo.core.errors import ConfigError
from gspo.models.logprobs import check_head

transformers.utils.logging.disable_progress_bar()  # no per-load progress bars between our own lines

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"


# The tiny models' chat template (`rollout.tools`): Qwen3's turn structure at one token per role and per tool-call
# tag, EOS ending the assistant's turn, tool calls in Qwen3's `<tool_call>` JSON (written compactly: every
# character is a token here) and the tools' names (not their whole schemas, which would fill the 256 positions)
CHAT_TEMPLATE = (
    "{%- if tools -%}<|system|>{%- for t in tools -%}{{ t.function.name }}{{ ',' if not loop.last }}{%- endfor -%}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}<|assistant|>{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] -%}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson(separators=(',', ':')) }}</tool_call>{%- endfor -%}" + EOS +
    "{%- else -%}<|{{ m.role }}|>{{ m.content }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")  # special: the model never writes them
TOOL_CALL_TOKENS = ("<tool_call>", "</tool_call>")  # not special, as in Qwen3's tokenizer: the model writes them


def char_tokenizer(alphabet: str, chat: bool = False) -> PreTrainedTokenizerFast:
    """A character-level tokenizer in Hugging Face format: one token per character.

    `chat`: with the tiny chat template (`CHAT_TEMPLATE`) and one token per role and tool-call tag, for
    rollouts with tools; off, the vocabulary (and so every model built on it) is what it always was."""
    vocab = {tok: i for i, tok in enumerate([PAD, EOS, UNK, *sorted(set(alphabet))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK)
    if chat:
        out.add_special_tokens({"additional_special_tokens": list(ROLE_TOKENS)})
        out.add_tokens(list(TOOL_CALL_TOKENS))
        out.chat_template = CHAT_TEMPLATE
    return out


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
    tokenizer = load_tokenizer(path)
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


def load_tokenizer(path: str | Path):
    """A checkpoint's tokenizer, padding with its EOS when it has no pad token."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:  # gspo.config.checks.model_dir_problem catches the usual cases before work
        raise ConfigError(f"model.path={path}: the tokenizer does not load ({str(e).splitlines()[0]})") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tokenizer_encode(cfg, task):
    """Text -> token ids with the tokenizer training will use, without building or loading the model."""
    if cfg.model.arch == "hf":
        from gspo.models.gguf import checkpoint_dir

        tok = load_tokenizer(checkpoint_dir(cfg.model.path, cfg.cache_dir))
    else:
        tok = char_tokenizer(task.alphabet, chat=cfg.rollout.tools is not None)
    return lambda text: tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Recompute activations in the backward (`model.gradient_checkpointing`): transformers renamed the switch
    `activation_checkpointing_enable` in a 5.x release and keeps the old name; take whichever this version has."""
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
