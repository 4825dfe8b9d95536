"""Sampling G completions per prompt, and the log-probs of sampled tokens.

Rollout dominates the cost of RL on small models, so this is a lean loop over
the model's own KV cache rather than `generate()`: left padding so every row's
next token sits in the last column, each group's prompt prefilled once (its G rows
share it), one forward per new token, and an early exit once every row has produced
EOS. A model that returns no KV cache (GPT-1; Mamba, RWKV, RecurrentGemma keep a
recurrent state instead) re-runs the whole sequence for every token: the same tokens,
at O(T^2) cost.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections import OrderedDict
from dataclasses import dataclass, fields, replace
from typing import Optional

import torch
import torch.nn.functional as F

from gspo.core.errors import ConfigError
from gspo.models.logprobs import head_logprobs
from gspo.models.packing import Packing
from gspo.rollout.decoding import fast_decode, static_decode
from gspo.rollout.decoding.params import SamplingParams


@dataclass
class Rollout:
    """One rollout batch, rows group-contiguous: rows [g*G, (g+1)*G) share a prompt.

    Shapes: N rows, P prompt columns (left-padded), T completion columns.
    """

    input_ids: torch.Tensor  # (N, P+T) prompt then completion, pad after EOS
    attention_mask: torch.Tensor  # (N, P+T) 1 on real prompt tokens and completion tokens (EOS included)
    completion_mask: torch.Tensor  # (N, T) float, 1 on completion tokens (EOS included)
    truncated: torch.Tensor  # (N,) bool: no EOS within max_new_tokens
    prompt_len: int  # P
    texts: list[str]  # decoded completions (without EOS)
    prompt_index: torch.Tensor  # (N,) index of the row's prompt in the step's problem list
    pad_id: int
    routing: Optional[torch.Tensor] = None  # (N, P+T, L, k) experts chosen while sampling (-1: never routed)
    router_logp: Optional[torch.Tensor] = None  # (N, P+T, L, E) float32 router log-probs while sampling (0: never routed)
    ill_formed: Optional[torch.Tensor] = None  # (N,) bool: a special token before the final EOS (see tasks.judge)
    clean_texts: Optional[list[str]] = None  # texts decoded with special tokens skipped, as TRL gives reward functions
    sampler_logp: Optional[torch.Tensor] = None  # (N, T) float32 log-probs of the sampled tokens, as drawn; 0 on padding
    kept_mass: Optional[torch.Tensor] = None  # (N, T) probability mass the nucleus (top_p < 1) kept; None at top_p 1
    # rollout.keep_topk = k: at every position the sampling distribution's k most likely token ids and their
    # log-probs (N, T, k), the sampled token always among them (as verl's DPPO recipe keeps vLLM's); None: off
    topk_ids: Optional[torch.Tensor] = None
    topk_logp: Optional[torch.Tensor] = None
    # multi-turn rollouts with tools (gspo/rollout/decoding/multiturn.py); None for single-turn ones. The tools' tokens
    # sit in input_ids and attention_mask, and out of completion_mask and every log-prob: they are not the model's
    conversations: Optional[list] = None  # each row's messages after the prompt, as TRL hands them to reward functions
    turns: Optional[torch.Tensor] = None  # (N,) the model's turns
    tool_calls: Optional[torch.Tensor] = None  # (N,) tool calls run (a malformed call counts as one, and as an error)
    tool_errors: Optional[torch.Tensor] = None  # (N,) calls that raised, timed out, crashed or were malformed

    @property
    def completion_ids(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_len :]

    @property
    def lengths(self) -> torch.Tensor:
        """(N,) the model's tokens of each row (with tools, not the tools' replies)."""
        return self.completion_mask.sum(-1)

    @property
    def tail_lengths(self) -> torch.Tensor:
        """(N,) every token after each row's prompt, the tools' replies included: what rollout.max_new_tokens
        budgets (`lengths` without tools)."""
        return self.attention_mask[:, self.prompt_len :].sum(-1)

    def select(self, rows: torch.Tensor) -> "Rollout":
        """The sub-batch of the given rows (a LongTensor of row indices)."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                out[f.name] = v[rows]
            elif isinstance(v, list):
                out[f.name] = [v[i] for i in rows.tolist()]
            else:
                out[f.name] = v
        return replace(self, **out)

    def trimmed(self) -> tuple["Rollout", slice]:
        """These rows without the columns that are padding in every one of them, and the window of columns kept.

        A batch is padded to its longest prompt (left) and longest completion (right); a minibatch of some of its
        rows may need less. Dropped: the leading prompt columns that no row attends to (the last prompt column
        always stays: it predicts the first completion token) and the trailing completion columns after every
        row's last completion token. Every kept token's log-prob is the same computation: positions count real
        tokens only (`position_ids`), masked keys weigh nothing, and causal attention never looks right.
        The window slices the (N, P+T) columns (`routing`); the first `window.stop - self.prompt_len` completion
        columns are kept, so (N, T) tensors of this batch cut as `x[:, :window.stop - self.prompt_len]`.
        """
        P = self.prompt_len
        used = self.attention_mask[:, :P].any(0)
        first = min(int(used.int().argmax()) if bool(used.any()) else P, P - 1) if P else 0
        filled = self.completion_mask.any(0)
        width = max(1, int(filled.nonzero().max()) + 1) if bool(filled.any()) else 1
        width = min(width, self.completion_mask.shape[1])
        window = slice(first, P + width)
        if first == 0 and width == self.completion_mask.shape[1]:
            return self, window
        out: dict = {"prompt_len": P - first}
        for name in SEQUENCE_COLUMNS + COMPLETION_COLUMNS:
            v = getattr(self, name)
            out[name] = None if v is None else v[:, window] if name in SEQUENCE_COLUMNS else v[:, :width]
        return replace(self, **out), window


# Rollout's tensors by what their second dimension spans: the prompt and completion columns (N, P+T, ...), or
# the completion's (N, T, ...); every other tensor field is one value per row (tests/rollout/decoding/test_rollout.py
# checks the lists)
SEQUENCE_COLUMNS = ("input_ids", "attention_mask", "routing", "router_logp")
COMPLETION_COLUMNS = ("completion_mask", "sampler_logp", "kept_mass", "topk_ids", "topk_logp")


def cat_rollouts(parts: list[Rollout]) -> Rollout:
    """Concatenate rollouts along rows, re-padding prompts (left) and completions (right). What the sampler
    recorded (its log-probs, kept mass, top-k) is the whole batch's only where every part has it."""
    P = max(r.prompt_len for r in parts)
    T = max(r.completion_mask.shape[1] for r in parts)
    missing = lambda name: any(getattr(r, name) is None for r in parts)  # noqa: E731

    def pad(r: Rollout, x: torch.Tensor, value) -> torch.Tensor:
        extra = (0, 0) * (x.dim() - 2)  # trailing dims (routing: L, k) are not padded
        return F.pad(x, (*extra, P - r.prompt_len, T - r.completion_mask.shape[1]), value=value)

    return Rollout(
        input_ids=torch.cat([pad(r, r.input_ids, r.pad_id) for r in parts]),
        attention_mask=torch.cat([pad(r, r.attention_mask, 0) for r in parts]),
        completion_mask=torch.cat([F.pad(r.completion_mask, (0, T - r.completion_mask.shape[1])) for r in parts]),
        truncated=torch.cat([r.truncated for r in parts]),
        prompt_len=P,
        texts=[t for r in parts for t in r.texts],
        prompt_index=torch.cat([r.prompt_index for r in parts]),
        pad_id=parts[0].pad_id,
        routing=None if parts[0].routing is None else torch.cat([pad(r, r.routing, -1) for r in parts]),
        router_logp=None if parts[0].router_logp is None else torch.cat([pad(r, r.router_logp, 0.0) for r in parts]),
        ill_formed=None if parts[0].ill_formed is None else torch.cat([r.ill_formed for r in parts]),
        clean_texts=None if parts[0].clean_texts is None else [t for r in parts for t in r.clean_texts],
        sampler_logp=None if missing("sampler_logp") else torch.cat(
            [F.pad(r.sampler_logp, (0, T - r.completion_mask.shape[1])) for r in parts]),
        kept_mass=None if missing("kept_mass") else torch.cat(
            [F.pad(r.kept_mass, (0, T - r.completion_mask.shape[1]), value=1.0) for r in parts]),
        topk_ids=None if missing("topk_ids") else torch.cat(
            [F.pad(r.topk_ids, (0, 0, 0, T - r.completion_mask.shape[1])) for r in parts]),
        topk_logp=None if missing("topk_logp") else torch.cat(
            [F.pad(r.topk_logp, (0, 0, 0, T - r.completion_mask.shape[1])) for r in parts]),
        conversations=None if parts[0].conversations is None else [c for r in parts for c in r.conversations],
        **{k: None if getattr(parts[0], k) is None else torch.cat([getattr(r, k) for r in parts])
           for k in ("turns", "tool_calls", "tool_errors")},
    )


class NonFiniteLogits(FloatingPointError):
    """The model's logits hold NaN or inf while sampling (a diverged policy, an overflow in low precision)."""


def stop_ids(model: torch.nn.Module, tokenizer) -> torch.Tensor:
    """Every token id a completion of the torch `model` ends at: the tokenizer's EOS and each id the model's
    generation config lists (chat checkpoints end a turn with another token: Gemma's `<end_of_turn>`, Llama 3's
    `<|eot_id|>`, Phi-3's `<|end|>`), as `generate`, vLLM and verl stop. (A decoder's: `Decoder.stop_ids`.)"""
    return end_ids(tokenizer, getattr(model, "generation_config", None))


def end_ids(tokenizer, generation_config=None) -> torch.Tensor:
    """The tokenizer's EOS and every id `generation_config` (a transformers GenerationConfig, or None) lists as
    an end token: `stop_ids` of a model with that generation config, known before the model is loaded."""
    ids = {tokenizer.eos_token_id}
    listed = getattr(generation_config, "eos_token_id", None)
    ids |= set(listed) if isinstance(listed, (list, tuple)) else {listed}
    return torch.tensor(sorted(i for i in ids if i is not None), dtype=torch.long)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, so a padded row sees the same positions as an unpadded one."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) (N, max len): each sequence right-aligned, `pad_id` / 0 before it."""
    lengths = torch.tensor([len(s) for s in seqs])
    width = int(lengths.max())
    mask = (torch.arange(width) >= width - lengths[:, None]).long()
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    ids[mask.bool()] = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
    return ids, mask


def encode_prompts(tokenizer, prompts: list, chat_template: bool = False,
                   tools: Optional[list] = None) -> list[list[int]]:
    """Token ids of each prompt: a string, or chat messages `[{"role": ..., "content": ...}]`.

    Messages are always rendered with the tokenizer's chat template; a string is wrapped as
    one user message when `chat_template` is on (and the tokenizer has a template). `tools`: the
    JSON schemas the template renders (as `apply_chat_template(tools=...)`).
    """
    has_template = bool(getattr(tokenizer, "chat_template", None))
    texts = []
    for p in prompts:
        if isinstance(p, str) and not (chat_template and has_template):
            texts.append(p)
            continue
        messages = [{"role": "user", "content": p}] if isinstance(p, str) else list(p)
        # render, then tokenize: apply_chat_template(tokenize=True) returns a BatchEncoding in transformers 5
        texts.append(tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                   tokenize=False))
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []  # one batched call


@torch.no_grad()
def generate(model, tokenizer, prompts: Optional[list], group_size: int, params: SamplingParams,
             generator: Optional[torch.Generator | list[torch.Generator]] = None, *,
             prompt_ids: Optional[list[list[int]]] = None, limits: Optional[list[int]] = None) -> Rollout:
    """Sample `group_size` completions for each prompt (rows group-contiguous) with the torch `model`, as `params`
    says (gspo/rollout/decoding/decoder.py: `ModelDecoder` is this function behind the `Decoder` interface).

    `generator` may be a list with one generator per prompt: each group then draws its own noise, so its
    completions do not depend on the rest of the batch (how a prompt sampled on rank r of W matches the same
    prompt sampled by one process). `params.compile`: decode with a static KV cache through `torch.compile` (CUDA
    graphs on a GPU), as `generate(cache_implementation="static")` does; the prefill runs eager. `params.engine`:
    `hf` decodes through the model's forward; `fast` (and `auto`) through gspo/rollout/decoding/fast_decode.py where it
    supports the model, sampling the same tokens; else `hf`. `params.decode`: how the fast engine runs its steps
    (gspo/rollout/decoding/static_decode.py: on a static cache, as one CUDA graph replayed per token under `graph`).
    `prompt_ids` (token ids, one list per prompt) stand in for `prompts`, rendered already; `limits` (one per
    row, each <= params.max_new_tokens): a row ends after that many tokens, drawing only as many uniforms (how
    `continue_sequences` gives each trajectory its own budget).
    """
    device = next(model.parameters()).device
    eos, pad, T = stop_ids(model, tokenizer).to(device), tokenizer.pad_token_id, params.max_new_tokens
    encoded = prompt_ids if prompt_ids is not None else encode_prompts(tokenizer, prompts, params.chat_template)
    ids, mask = left_pad([e for e in encoded for _ in range(group_size)], pad)
    ids, mask = ids.to(device), mask.to(device)
    n, p = ids.shape
    draws = _Draws.empty(n, T, params, pad, device)
    # one attention mask for the whole rollout, filled in as tokens arrive (no per-token re-allocation)
    full_mask = torch.cat([mask, torch.ones((n, T), dtype=mask.dtype, device=device)], dim=1)
    # every row's random draws for the whole rollout at once (one call per group, not one per group per token)
    u = None if params.greedy else _uniforms(n, T, generator, device, limits)
    limit = None if limits is None else torch.tensor(limits, device=device)
    done = torch.zeros(n, dtype=torch.bool, device=device)
    check_every = 1 if device.type == "cpu" else 8  # on a GPU, asking "all done?" every token stalls the launch queue
    forward = _Forward(model, n, p + T, params)  # before the sampler's routing hooks (static decode: no others)
    with _routing_trace(model, params.capture_routing) as trace:
        logits = forward.prefill(ids, mask, full_mask, group_size, trace)
        drawn = _draw(logits, None if u is None else u[:, 0], params)
        for t in range(T):
            nxt = draws.record(t, drawn, done)
            done |= torch.isin(nxt, eos) if limit is None else torch.isin(nxt, eos) | (limit <= t + 1)
            if t + 1 == T or (t + 1) % check_every == 0 and bool(done.all()):
                break
            drawn = forward.draw_next(nxt, ids, draws.out[:, : t + 1], full_mask, p + t + 1,
                                      None if u is None else u[:, t + 1])
    draws.check_finite()
    width = t + 1
    routing = None if trace is None else trace.batch(n)  # the last sampled token was never routed: -1
    return finish(tokenizer, ids, mask, draws.out[:, :width], eos, group_size, draws.recorded(width, routing),
                  limit=limit)


@contextlib.contextmanager
def _routing_trace(model, capture: bool):
    """MoE: the routing every position takes while sampling (gspo/models/moe.py), or None."""
    if not capture:
        yield None
        return
    from gspo.models import moe

    with moe.capture_routing(model, logprobs=True) as trace:
        yield trace


class _Forward:
    """The model's forward while decoding: the prefill of the prompts, then one step per sampled token, on the
    model's KV cache (a static one under `params.compile`; gspo/rollout/decoding/fast_decode.py's under the fast engine,
    or gspo/rollout/decoding/static_decode.py's, whose steps also draw, under `params.decode` static / graph)."""

    def __init__(self, model, rows: int, length: int, params: SamplingParams):
        self.model, self.decode, self.cache, self.params, self.length = model, model, None, params, length
        self.cache_kw = _cache_kwarg(model)
        self.fast = params.max_new_tokens > 1 and fast_decode.resolve(params.engine, model, params.compile) == "fast"
        # eager: fast_decode's steps; static / graph: static_decode's (asked before any routing hook is registered)
        self.mode = static_decode.resolve(params.decode, model) if self.fast else "eager"
        self.static: Optional[static_decode.StaticDecoder] = None
        self.recurrent = False  # `_only_recurrent` of the cache
        if params.compile:
            self.cache, self.decode = _static_decoder(model, rows, length)

    def _kwargs(self, step_ids: torch.Tensor, pos: torch.Tensor) -> dict:
        # logits_to_keep=1: the prefill needs only its last position's logits (V per row, not P x V)
        return {"input_ids": step_ids, "position_ids": pos, self.cache_kw: self.cache, "use_cache": True,
                "logits_to_keep": 1}

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, full_mask: torch.Tensor, group_size: int,
                trace=None) -> torch.Tensor:
        """The last prompt position's float32 logits (N, V); the cache filled with the prompts. `trace`: the
        sampler's routing trace (None: none), which a static decode records its steps' routing into."""
        model, p = self.model, ids.shape[1]
        self.pos, kwargs = position_ids(mask), self._kwargs(ids, position_ids(mask))
        # a group's G rows share their prompt: prefill it once. Not for a stateful model (Mamba: no key/value
        # cache to repeat), nor while recording routing (the trace records every row's prefill)
        share = group_size > 1 and not self.params.capture_routing and hasattr(model, "config") \
            and not getattr(model, "_is_stateful", False) and model not in _UNSHARED_PREFILL
        if self.params.compile:  # static shapes: the whole mask (the causal mask hides the future), the slots to fill
            res = model(attention_mask=full_mask, cache_position=torch.arange(p, device=ids.device), **kwargs)
            self.cache, logits = returned_cache(res), res.logits[:, -1].float()
        elif share and (shared := _prefill_once_per_group(model, kwargs, mask, group_size)):
            self.cache, logits = shared
        else:
            res = model(attention_mask=full_mask[:, :p], **kwargs)
            self.cache, logits = returned_cache(res), res.logits[:, -1].float()
        self.recurrent = _only_recurrent(self.cache)
        if self.fast and self.mode != "eager":  # the prefill's KV cache copied into a static cache (kept, under graph)
            settings = (self.params.greedy, self.params.temperature, self.params.top_p, self.params.topk)
            self.static = static_decode.decoder(model, self.cache, self.length, self.mode,
                                                functools.partial(_draw, params=self.params), settings,
                                                self.params.matmul)
            self.static.begin(self.cache, mask, self.pos, trace)
            self.cache = None
        elif self.fast:  # the prefill was the model's forward: its KV cache moves into the engine's preallocated one
            self.decode, self.cache = fast_decode.FastDecoder(model, self.cache, self.length, self.params.matmul), None
        return logits

    def draw_next(self, nxt: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, full_mask: torch.Tensor, width: int,
                  u: Optional[torch.Tensor]) -> tuple:
        """`_draw`'s outputs for the next position after feeding `nxt` (N,) (`step`'s arguments), with that
        position's uniforms `u` (N,) (None when greedy): a static decode's step draws itself (one graph replay)."""
        if self.static is not None:
            return self.static.step(nxt, u)
        return _draw(self.step(nxt, ids, out, full_mask, width), u, self.params)

    def step(self, nxt: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, full_mask: torch.Tensor,
             width: int) -> torch.Tensor:
        """The logits after feeding the tokens just sampled, `nxt` (N,); `out` (N, t) every token sampled so far,
        `full_mask` (N, P + T) the whole rollout's attention mask, of which the first `width` = P + t columns are
        the positions so far."""
        mask = full_mask[:, :width]
        if self.cache is None and not self.fast:  # no KV cache (GPT-1; Mamba, RWKV keep a recurrent state): all again
            if self.params.capture_routing:
                raise ConfigError(f"{type(self.model).__name__} returns no KV cache: recording routing while sampling "
                                  "needs one (set moe.routing_replay=none or R2, rollout.old_logprobs=recompute)")
            step_ids, self.pos = torch.cat([ids, out], 1), position_ids(mask)
        else:
            step_ids, self.pos = nxt[:, None], self.pos[:, -1:] + 1
        if self.fast:  # gspo/rollout/decoding/fast_decode.py: one call per layer on the model's own weights
            return self.decode.step(step_ids, self.pos, mask).float()
        kwargs = self._kwargs(step_ids, self.pos)
        if self.params.compile:
            slot = torch.full((1,), width - 1, device=mask.device)  # static shapes: the whole mask, the slot to fill
            res = self.decode(attention_mask=full_mask, cache_position=slot, **kwargs)
        else:  # a recurrent state takes the new token's mask column only (as generate() passes none)
            res = self.model(attention_mask=mask[:, -1:] if self.recurrent else mask, **kwargs)
        self.cache = returned_cache(res)
        self.recurrent = _only_recurrent(self.cache)
        return res.logits[:, -1].float()


def _only_recurrent(cache) -> bool:
    """The cache holds only recurrent states (Mamba): the past is in the state, not in the attention mask."""
    return cache is not None and all(getattr(cache, "is_linear", None) or [False])


@dataclass
class _Draws:
    """The tokens drawn at each position (N, T) and what the sampler records of them: their log-probs, the mass
    the nucleus kept (top_p < 1), each position's top-k (keep_topk)."""

    out: torch.Tensor
    logp: Optional[torch.Tensor]
    kept: Optional[torch.Tensor]
    topk_ids: Optional[torch.Tensor]
    topk_logp: Optional[torch.Tensor]
    nonfinite: torch.Tensor  # (N,) rows whose logits held NaN / inf
    params: SamplingParams
    pad: int

    @staticmethod
    def empty(n: int, T: int, params: SamplingParams, pad: int, device) -> "_Draws":
        sampled, k = not params.greedy, params.topk
        f32 = dict(dtype=torch.float32, device=device)
        return _Draws(out=torch.full((n, T), pad, dtype=torch.long, device=device),
                      logp=torch.zeros((n, T), **f32) if sampled else None,
                      kept=torch.ones((n, T), **f32) if sampled and params.top_p < 1.0 else None,
                      topk_ids=torch.zeros((n, T, k), dtype=torch.long, device=device) if k else None,
                      topk_logp=torch.zeros((n, T, k), **f32) if k else None,
                      nonfinite=torch.zeros(n, dtype=torch.bool, device=device), params=params, pad=pad)

    def record(self, t: int, drawn: tuple, done: torch.Tensor) -> torch.Tensor:
        """Position t's tokens (N,) (pad where a row is done), from `_draw`'s outputs, kept with what they record."""
        bad, nxt, *sampled = drawn
        self.nonfinite |= bad  # checked once at the end: no sync per token on a GPU
        if sampled:  # the sampled token's log-prob under the temperature-scaled policy (top-p aside)
            self.logp[:, t], mass, *top = sampled
            if top:
                self.topk_ids[:, t], self.topk_logp[:, t] = top
            if self.kept is not None:
                self.kept[:, t] = mass
        nxt = torch.where(done, torch.full_like(nxt, self.pad), nxt)
        self.out[:, t] = nxt
        return nxt

    def check_finite(self) -> None:
        if bool(self.nonfinite.any()):  # HF's sampler raises on these too: never train on tokens drawn from NaN
            raise NonFiniteLogits(f"the sampler's logits were not finite (NaN or inf) in {int(self.nonfinite.sum())} "
                                  f"of {len(self.nonfinite)} rows; stopping before training on them")

    def recorded(self, width: int, routing: Optional[tuple[torch.Tensor, torch.Tensor]]) -> Recorded:
        """What the draws recorded, the first `width` positions, beside the `routing` the sampler traced."""
        cut = lambda x: None if x is None else x[:, :width]  # noqa: E731
        return Recorded(sampler_logp=cut(self.logp), kept_mass=cut(self.kept), topk_ids=cut(self.topk_ids),
                        topk_logp=cut(self.topk_logp), routing=routing)


@dataclass(frozen=True)
class Tokens:
    """A sampled batch's tokens, as `assemble` lays them out in a `Rollout`: rows group-contiguous (rows
    [g*G, (g+1)*G) share a prompt), the prompt then everything after it."""

    prompt_ids: torch.Tensor  # (N, P) left-padded
    prompt_mask: torch.Tensor  # (N, P) 1 on the prompt's tokens
    tail_ids: torch.Tensor  # (N, T) every token after the prompt (the tools' too), padded after the row's last
    tail_mask: torch.Tensor  # (N, T) 1 on the row's tokens after its prompt
    model_mask: torch.Tensor  # (N, T) float, 1 on the tokens the model sampled (not the tools')
    pad_id: int
    group_size: int  # G


@dataclass(frozen=True)
class Decoded:
    """Each row's completion as text, and how it ended."""

    texts: list[str]  # the model's answer, special tokens and all (a sampled <pad> stays in it)
    clean_texts: list[str]  # with special tokens skipped, as TRL gives reward functions
    truncated: torch.Tensor  # (N,) bool: the row ended without a stop token (out of budget)
    ill_formed: torch.Tensor  # (N,) bool: a special token before the final EOS (see tasks.judge)


@dataclass(frozen=True)
class Recorded:
    """What the sampler recorded beside its tokens, each None where it recorded none (greedy, an engine that gave
    none, rollout.keep_topk off, no routing captured): `assemble` never makes one up."""

    sampler_logp: Optional[torch.Tensor] = None  # (N, T) the sampled tokens' log-probs, as drawn
    kept_mass: Optional[torch.Tensor] = None  # (N, T) the probability mass the nucleus kept (top_p < 1)
    topk_ids: Optional[torch.Tensor] = None  # (N, T, k) each position's k most likely tokens (rollout.keep_topk)
    topk_logp: Optional[torch.Tensor] = None  # (N, T, k) and their log-probs
    # (expert ids (N, W, L, k), router log-probs (N, W, L, E)) over the prompt and completion positions, W <= P + T
    # (positions never routed: -1 / 0)
    routing: Optional[tuple[torch.Tensor, torch.Tensor]] = None


@dataclass(frozen=True)
class ToolRecord:
    """A rollout with tools (gspo/rollout/decoding/multiturn.py): what its rows did besides sampling."""

    conversations: list  # each row's messages after the prompt, as TRL hands them to reward functions
    turns: torch.Tensor  # (N,) the model's turns
    tool_calls: torch.Tensor  # (N,) tool calls run (a malformed call counts as one, and as an error)
    tool_errors: torch.Tensor  # (N,) calls that raised, timed out, crashed or were malformed


def finish(tokenizer, ids: torch.Tensor, mask: torch.Tensor, out: torch.Tensor, eos: torch.Tensor, group_size: int,
           recorded: Recorded = Recorded(), limit: Optional[torch.Tensor] = None) -> Rollout:
    """The `Rollout` of sampled completions, whichever engine drew them.

    ids, mask (N, P): the left-padded prompts, rows group-contiguous; out (N, T): the sampled tokens, padding
    after a row's stop token (the stop token itself is the row's last completion token); `recorded`: the sampler's
    records, the per-token ones aligned with `out`, its routing cut or padded here to the batch's P + T positions;
    limit (N,): the most tokens each row holds, when rows have their own (`generate(limits=)`'s budgets, the tokens
    an engine returned): a row that reaches it without a stop token is truncated, and nothing after it is the
    row's, whatever it reads (the padding may be a stop id: Qwen's pad token is its EOS).
    """
    # completion tokens: everything up to and including the first stop token
    is_eos = torch.isin(out, eos)
    within = None if limit is None else torch.arange(out.shape[1], device=out.device) < limit[:, None]
    if within is not None:  # a row's budget ends its completion: the padding after it (EOS may pad) is no token of it
        is_eos &= within
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    comp_mask = (~after_eos if within is None else ~after_eos & within).float()
    if bool((comp_mask.sum(0) == 0).any()):  # trailing columns where every row had ended
        width = int((comp_mask.sum(0) > 0).nonzero().max()) + 1
        out, comp_mask, is_eos = out[:, :width], comp_mask[:, :width], is_eos[:, :width]
    T = out.shape[1]
    truncated = ~is_eos.any(-1)
    # the text the model wrote before its EOS, special tokens and all: a sampled <pad> stays in it, and makes the row ill-formed
    body = comp_mask.bool() & ~is_eos
    special = torch.tensor(sorted(set(tokenizer.all_special_ids)), device=out.device)
    ill_formed = (torch.isin(out, special) & body).any(-1).cpu()
    bodies = [row[m].tolist() for row, m in zip(out.cpu(), body.cpu())]
    texts = tokenizer.batch_decode(bodies, skip_special_tokens=False)
    # TRL's view (special tokens skipped) differs only on the ill-formed rows: decode those again
    clean = list(texts)
    for i in ill_formed.nonzero().flatten().tolist():
        clean[i] = tokenizer.decode(bodies[i], skip_special_tokens=True)
    width = ids.shape[1] + T
    if recorded.routing is not None:
        recorded = replace(recorded, routing=tuple(_fit(x[:, :width], width, pad)
                                                   for x, pad in zip(recorded.routing, (-1, 0.0))))
    return assemble(Tokens(prompt_ids=ids, prompt_mask=mask, tail_ids=out, tail_mask=comp_mask, model_mask=comp_mask,
                           pad_id=tokenizer.pad_token_id, group_size=group_size),
                    Decoded(texts=texts, clean_texts=clean, truncated=truncated, ill_formed=ill_formed), recorded)


def assemble(tokens: Tokens, decoded: Decoded, recorded: Recorded, tools: Optional[ToolRecord] = None) -> Rollout:
    """Every sampled `Rollout` is made here (single-turn by `finish`, with tools by gspo/rollout/decoding/multiturn.py),
    so what the sampler recorded means one thing in both. The per-token records (N, T[, k]) are kept on the model's
    tokens only: log-probs and top-k 0, kept mass 1 elsewhere; a record that is None stays None. `recorded.routing`
    spans the P + T positions. `tools`: what trajectories with tools did (None: single-turn)."""
    t, r = tokens, recorded
    T = t.model_mask.shape[1]
    on = t.model_mask.bool()
    return Rollout(
        input_ids=torch.cat([t.prompt_ids, t.tail_ids], 1),
        attention_mask=torch.cat([t.prompt_mask, t.tail_mask.long()], 1),
        completion_mask=t.model_mask,
        truncated=decoded.truncated,
        prompt_len=t.prompt_ids.shape[1],
        texts=decoded.texts,
        prompt_index=torch.arange(len(t.prompt_ids) // t.group_size).repeat_interleave(t.group_size),
        pad_id=t.pad_id,
        routing=None if r.routing is None else r.routing[0],
        router_logp=None if r.routing is None else r.routing[1],
        ill_formed=decoded.ill_formed,
        clean_texts=decoded.clean_texts,
        sampler_logp=None if r.sampler_logp is None else r.sampler_logp[:, :T] * t.model_mask,
        kept_mass=None if r.kept_mass is None else torch.where(on, r.kept_mass[:, :T], 1.0),
        topk_ids=None if r.topk_ids is None else r.topk_ids[:, :T] * on.long()[..., None],
        topk_logp=None if r.topk_logp is None else r.topk_logp[:, :T] * t.model_mask[..., None],
        conversations=None if tools is None else tools.conversations,
        turns=None if tools is None else tools.turns,
        tool_calls=None if tools is None else tools.tool_calls,
        tool_errors=None if tools is None else tools.tool_errors,
    )


# models whose cache turned out not to be a plain key/value one (hybrid, sliding-window layers): they prefill
# every row from then on, without a wasted shared prefill at every rollout
_UNSHARED_PREFILL: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def _prefill_once_per_group(model, kwargs: dict, mask: torch.Tensor, group_size: int):
    """The prefill of each prompt once, its key/value cache and last logits then repeated for the G rows of its
    group: a G-th of the prefill's work (as an inference engine shares a prompt's cache among its n samples).
    `kwargs` are the rows' forward arguments. None where the cache is not a plain key/value cache (the model
    is then remembered in _UNSHARED_PREFILL): the caller prefills every row."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    once = {k: v[::group_size] if torch.is_tensor(v) else v for k, v in kwargs.items()}
    res = model(attention_mask=mask[::group_size], **once)
    cache = returned_cache(res)
    if type(cache) is not DynamicCache or not all(type(layer) is DynamicLayer for layer in cache.layers):
        _UNSHARED_PREFILL.add(model)
        return None
    cache.batch_repeat_interleave(group_size)
    return cache, res.logits[:, -1].float().repeat_interleave(group_size, 0)


def _cache_kwarg(model) -> str:
    """The forward's name for the cache: `cache` since transformers 5.24, `past_key_values` before."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def returned_cache(res):
    """The cache a forward returned (`cache` since transformers 5.24, `past_key_values` before), or None."""
    cache = getattr(res, "cache", None)
    return cache if cache is not None else getattr(res, "past_key_values", None)


# (model, rows, length) -> (StaticCache, compiled forward), most recent last: reused, so graphs are recorded
# once per shape. Bounded: every batch shape (task=data's prompt widths vary) would otherwise keep a cache of
# its own for ever; the least recently used shape is dropped (and recompiled if it comes back).
_STATIC: "OrderedDict[tuple, tuple]" = OrderedDict()
MAX_STATIC = 2


def _static_decoder(model, rows: int, length: int):
    """A reset StaticCache of `rows` x `length` and the compiled forward for this model."""
    from transformers import StaticCache

    key = (id(model), rows, length)
    if key not in _STATIC:
        compiled = torch.compile(model.forward, mode="reduce-overhead", dynamic=False)
        _STATIC[key] = (StaticCache(config=model.config, max_cache_len=length), compiled)
        while len(_STATIC) > MAX_STATIC:
            _STATIC.popitem(last=False)
    _STATIC.move_to_end(key)
    cache, compiled = _STATIC[key]
    cache.reset()
    return cache, compiled


def _draw(logits: torch.Tensor, u: Optional[torch.Tensor], params: SamplingParams) -> tuple:
    """One position's draw from float32 logits (N, V) and the rows' uniforms u (N,) (unread when greedy): (rows whose
    logits are not finite (N,), tokens (N,)), then, when sampled, the tokens' log-probs, the nucleus's kept mass and,
    with keep_topk, the top-k ids and log-probs. Arithmetic only, no host sync: a static decode's graph records it
    (gspo/rollout/decoding/static_decode.py); `_Draws.record` keeps what it returns."""
    bad = ~torch.isfinite(logits).all(-1)
    if params.greedy:
        return bad, _sample(logits, params.temperature, params.top_p, True, None)
    return bad, *_sample(logits, params.temperature, params.top_p, False, u, with_logp=True, keep_topk=params.topk)


def _fit(x: torch.Tensor, width: int, value) -> torch.Tensor:
    """x (N, <=width, ...) padded along dim 1 to `width` with `value`."""
    return F.pad(x.movedim(1, -1), (0, width - x.shape[1]), value=value).movedim(-1, 1)


def _uniforms(n: int, steps: int, generator, device, limits: Optional[list[int]] = None) -> torch.Tensor:
    """(n, steps) uniforms in [0, 1) for the whole rollout, drawn once: per group from its own
    generator (a list: one per prompt group, rows group-contiguous), so a group's draws do not
    depend on the rest of the batch. With `limits` (one generator per row), row i draws limits[i]."""
    if limits is not None:
        return torch.stack([F.pad(torch.rand(m, generator=g, device=g.device).to(device), (0, steps - m))
                            for g, m in zip(generator, limits)])
    if isinstance(generator, (list, tuple)):
        per_group = n // len(generator)
        return torch.cat([torch.rand((per_group, steps), generator=g, device=g.device).to(device) for g in generator])
    gen_device = generator.device if generator is not None else device
    return torch.rand((n, steps), generator=generator, device=gen_device).to(device)


def _sample(logits: torch.Tensor, temperature: float, top_p: float, greedy: bool, u: Optional[torch.Tensor],
            with_logp: bool = False, keep_topk: int = 0) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The next token of each row: argmax, or an inverse-CDF draw with the row's uniform u (N,).

    `with_logp`: also the drawn token's log-prob under softmax(logits / temperature) and the mass
    the nucleus kept (1 without top-p), read off the probabilities the draw used: no second pass over V.
    The log-prob is taken BEFORE the top-p cut, like the trainer's over the whole vocabulary, so the
    kept mass cancels from the sampler/trainer ratio (gspo/algos/mismatch.py explains why).
    """
    if greedy:
        return logits.argmax(-1)
    probs = torch.softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)  # T = 1: no pass over V
    full = probs
    if top_p < 1.0:
        sorted_p, idx = probs.sort(-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p  # always keeps the most likely token
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p * keep)
    cdf = probs.cumsum(-1)
    # the first token whose cumulative probability exceeds u x total: never a zero-probability token
    nxt = torch.searchsorted(cdf, (u.to(cdf.dtype) * cdf[:, -1])[:, None], right=True).squeeze(-1)
    nxt = nxt.clamp_max(probs.shape[-1] - 1)
    if not with_logp:
        return nxt
    out = (nxt, full.gather(-1, nxt[:, None]).squeeze(-1).log(), cdf[:, -1])
    if not keep_topk:
        return out
    top_p_vals, top_ids = full.topk(keep_topk, dim=-1)  # the k most likely under the temperature-scaled policy
    missing = ~(top_ids == nxt[:, None]).any(-1)  # the sampled token replaces the k-th when outside them
    top_ids[:, -1] = torch.where(missing, nxt, top_ids[:, -1])
    top_p_vals[:, -1] = torch.where(missing, full.gather(-1, nxt[:, None]).squeeze(-1), top_p_vals[:, -1])
    return (*out, top_ids, top_p_vals.log())


def token_logprobs(
    model,
    rollout: Rollout,
    temperature: float = 1.0,
    with_entropy: bool = False,
    topk: bool = False,
    packing: Optional[Packing] = None,
    **forward_kwargs,
) -> tuple:
    """Log-probs (N, T) of the sampled completion tokens under `model` (with grad if enabled).

    Uses the sampling temperature, so the ratio compares the distributions the tokens
    were actually drawn from. The LM head is applied only at the completion tokens, chunk
    by chunk (gspo/models/logprobs.py): no (N, T, V) float32 logits, at any vocabulary size.
    Padding positions hold 0. Returns (logp, entropy (N, T) (with grad, for a bonus) or None, the
    model output, for aux losses); with `topk`, a fourth: the log-probs (N, T, k) of the rollout's
    kept top-k tokens (`Rollout.topk_ids`) under `model`, without grad. `packing` (gspo/models/packing.py, of
    this rollout's input_ids and attention_mask): one forward of the packed rows, the shared prefix once; the same
    values up to float rounding.
    """
    ids, mask, sel = rollout.input_ids, rollout.attention_mask, rollout.completion_mask.bool()
    extra = rollout.topk_ids[sel] if topk else None
    if packing is None:
        # the head sees positions P-1 .. P+T-1; position P-1+j predicts completion token j (the last predicts nothing)
        head_sel = torch.cat([sel, torch.zeros_like(sel[:, :1])], dim=1)
        inputs = dict(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask),
                      logits_to_keep=sel.shape[1] + 1)
    else:  # the packed positions of the same predicting positions, in the same order
        P = rollout.prompt_len
        predicting = torch.zeros_like(mask, dtype=torch.bool)
        predicting[:, P - 1 : P - 1 + sel.shape[1]] = sel
        head_sel = packing.select(predicting)
        inputs = dict(input_ids=packing.input_ids, attention_mask=packing.attention_mask,
                      position_ids=packing.position_ids, logits_to_keep=0)
    logp_sel, ent_sel, res, *more = head_logprobs(model, head_sel, rollout.completion_ids[sel], temperature,
                                                  with_entropy, extra, **inputs, use_cache=False, **forward_kwargs)
    zeros = torch.zeros(sel.shape, dtype=torch.float32, device=ids.device)
    logp = zeros.masked_scatter(sel, logp_sel)
    entropy = zeros.masked_scatter(sel, ent_sel) if with_entropy else None
    if not topk:
        return logp, entropy, res
    top = torch.zeros(rollout.topk_ids.shape, dtype=torch.float32, device=ids.device)
    top[sel] = more[0]
    return logp, entropy, res, top
