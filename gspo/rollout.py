"""Sampling G completions per prompt, and the log-probs of sampled tokens.

Rollout dominates the cost of RL on small models, so this is a lean loop over
the model's own KV cache rather than `generate()`: left padding so every row's
next token sits in the last column, one forward per new token, and an early exit
once every row has produced EOS.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional

import torch
import torch.nn.functional as F


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
    ill_formed: Optional[torch.Tensor] = None  # (N,) bool: a special token before the final EOS (see tasks.judge)

    @property
    def completion_ids(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_len :]

    @property
    def lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(-1)

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


def cat_rollouts(parts: list[Rollout]) -> Rollout:
    """Concatenate rollouts along rows, re-padding prompts (left) and completions (right)."""
    P = max(r.prompt_len for r in parts)
    T = max(r.completion_mask.shape[1] for r in parts)

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
        ill_formed=None if parts[0].ill_formed is None else torch.cat([r.ill_formed for r in parts]),
    )


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, so a padded row sees the same positions as an unpadded one."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s) :] = 1
    return ids, mask


def encode_prompts(tokenizer, prompts: list, chat_template: bool = False) -> list[list[int]]:
    """Token ids of each prompt: a string, or chat messages `[{"role": ..., "content": ...}]`.

    Messages are always rendered with the tokenizer's chat template; a string is wrapped as
    one user message when `chat_template` is on (and the tokenizer has a template).
    """
    has_template = bool(getattr(tokenizer, "chat_template", None))
    out = []
    for p in prompts:
        if isinstance(p, str) and not (chat_template and has_template):
            out.append(tokenizer(p, add_special_tokens=False)["input_ids"])
            continue
        messages = [{"role": "user", "content": p}] if isinstance(p, str) else list(p)
        # render, then tokenize: apply_chat_template(tokenize=True) returns a BatchEncoding in transformers 5
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompts: list,
    group_size: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    greedy: bool = False,
    generator: Optional[torch.Generator | list[torch.Generator]] = None,
    chat_template: bool = False,
    capture_routing: bool = False,
) -> Rollout:
    """Sample `group_size` completions for each prompt (rows group-contiguous).

    `generator` may be a list with one generator per prompt: each group then draws its
    own noise, so its completions do not depend on the rest of the batch (how a prompt
    sampled on rank r of W matches the same prompt sampled by one process).
    """
    device = next(model.parameters()).device
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    encoded = encode_prompts(tokenizer, prompts, chat_template)
    ids, mask = left_pad([e for e in encoded for _ in range(group_size)], pad)
    ids, mask = ids.to(device), mask.to(device)
    n, p = ids.shape
    out = torch.full((n, max_new_tokens), pad, dtype=torch.long, device=device)
    done = torch.zeros(n, dtype=torch.bool, device=device)
    trace = None
    if capture_routing:
        from gspo import moe

        ctx = moe.capture_routing(model, logprobs=False)  # R3 replays indices only; skip per-token log-softmax
        trace = ctx.__enter__()
    try:
        cache, step_ids, full_mask = None, ids, mask
        for t in range(max_new_tokens):
            pos = position_ids(full_mask)[:, -step_ids.shape[1] :]
            res = model(input_ids=step_ids, attention_mask=full_mask, position_ids=pos, past_key_values=cache, use_cache=True)
            cache, logits = res.past_key_values, res.logits[:, -1].float()
            nxt = _sample(logits, temperature, top_p, greedy, generator)
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
            out[:, t] = nxt
            done |= nxt == eos
            if bool(done.all()):
                break
            step_ids = nxt[:, None]
            full_mask = torch.cat([full_mask, torch.ones((n, 1), dtype=mask.dtype, device=device)], dim=1)
    finally:
        if capture_routing:
            ctx.__exit__(None, None, None)
    out = out[:, : t + 1]
    # completion tokens: everything up to and including the first EOS
    is_eos = out == eos
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    comp_mask = (~after_eos).float()
    truncated = ~is_eos.any(-1)
    # the text the model wrote before its EOS, special tokens and all: a sampled <pad> stays in it, and makes the row ill-formed
    body = comp_mask.bool() & ~is_eos
    special = torch.tensor(sorted(set(tokenizer.all_special_ids)), device=device)
    ill_formed = (torch.isin(out, special) & body).any(-1).cpu()
    texts = [tokenizer.decode(row[m].tolist(), skip_special_tokens=False) for row, m in zip(out.cpu(), body.cpu())]
    routing = None
    if trace is not None:
        # (N, P+T, L, k); the last sampled token was never routed: -1 (replay routes it live)
        routing = trace.indices(n, length=p + out.shape[1])
    return Rollout(
        input_ids=torch.cat([ids, out], 1),
        attention_mask=torch.cat([mask, comp_mask.long()], 1),
        completion_mask=comp_mask,
        truncated=truncated,
        prompt_len=p,
        texts=texts,
        prompt_index=torch.arange(len(prompts)).repeat_interleave(group_size),
        pad_id=pad,
        routing=routing,
        ill_formed=ill_formed,
    )


def _sample(logits: torch.Tensor, temperature: float, top_p: float, greedy: bool, generator) -> torch.Tensor:
    if greedy or temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p  # always keeps the most likely token
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p * keep)
    if isinstance(generator, (list, tuple)):  # one generator per prompt group
        groups = probs.split(probs.shape[0] // len(generator))
        return torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(groups, generator)]).squeeze(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def token_logprobs(
    model,
    rollout: Rollout,
    temperature: float = 1.0,
    with_entropy: bool = False,
    **forward_kwargs,
) -> tuple[torch.Tensor, Optional[torch.Tensor], object]:
    """Log-probs (N, T) of the sampled completion tokens under `model` (with grad if enabled).

    Uses the sampling temperature, so the ratio compares the distributions the
    tokens were actually drawn from. Only the completion positions go through the
    LM head (`logits_to_keep`), which matters for real vocabularies.
    Returns (logp, entropy or None, the model output for aux losses).
    """
    ids, mask = rollout.input_ids, rollout.attention_mask
    t = ids.shape[1] - rollout.prompt_len
    res = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=position_ids(mask),
        logits_to_keep=t + 1,
        use_cache=False,
        **forward_kwargs,
    )
    logits = res.logits[:, :-1].float() / temperature  # position j predicts completion token j
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, rollout.completion_ids[..., None]).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy, res
