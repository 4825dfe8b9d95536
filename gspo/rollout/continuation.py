"""The token-level sampling primitive a multi-turn rollout is built on: continue these token sequences.

    continue_sequences(model, tokenizer, sequences, max_new_tokens, generators, **sampling) -> list[Continuation]

Each sequence is one trajectory so far (its prompt, the model's earlier turns and the tools' replies, as token
ids: never re-tokenised); each is continued by at most its own `max_new_tokens[i]` tokens, stopping at the stop
ids (`generate.stop_ids`: the tokenizer's EOS and every end token the generation config lists), drawing its
noise from its own generator `generators[i]` alone, so what a trajectory samples depends on nothing else in
the batch. gspo/rollout/multiturn.py drives whole conversations with it and never touches a model.

gspo's engines (`rollout.engine` hf / fast) implement it through `generate` on the pre-tokenised sequences.
Another engine implements it as a method of the object that stands for the model in `generate(model, ...)`:
`model.continue_sequences(sequences, max_new_tokens, generators, **sampling) -> list[Continuation]`, with the
`sampling` keywords below; `continue_sequences` then hands the call to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from gspo.rollout.generate import generate


@dataclass
class Continuation:
    """What one sequence was continued by. n = len(tokens); S = the sequence's length before it."""

    tokens: list[int]  # the sampled tokens, the stop token included when one was drawn
    logp: Optional[torch.Tensor]  # (n,) float32 log-probs as drawn (of logits / temperature, before top-p); greedy: None
    stopped: bool  # it ended at a stop id; False: its budget ran out first
    kept_mass: Optional[torch.Tensor] = None  # (n,) the mass the nucleus kept (top_p < 1), else None
    topk_ids: Optional[torch.Tensor] = None  # (n, k) keep_topk: each position's k most likely token ids ...
    topk_logp: Optional[torch.Tensor] = None  # ... and their log-probs, the sampled token among them
    routing: Optional[torch.Tensor] = None  # (S + n, L, k) experts each position routed to (-1: the last, never fed)
    router_logp: Optional[torch.Tensor] = None  # (S + n, L, E) the routers' log-probs there


@torch.no_grad()
def continue_sequences(model, tokenizer, sequences: list[list[int]], max_new_tokens: list[int],
                       generators: Optional[list[torch.Generator]], *, temperature: float = 1.0, top_p: float = 1.0,
                       greedy: bool = False, capture_routing: bool = False, compile: bool = False, engine: str = "hf",
                       keep_topk: int = 0) -> list[Continuation]:
    """Continue each of `sequences` by at most `max_new_tokens[i]` (>= 1) sampled tokens, stopping at the stop ids.

    `generators`: one per sequence (None when `greedy`); row i draws `max_new_tokens[i]` uniforms from its own.
    `capture_routing`: record the MoE routing of every position fed (the sequence's too, routed again here).
    The other keywords are `generate`'s. An engine object with a `continue_sequences` method does the work.
    """
    sampling = dict(temperature=temperature, top_p=top_p, greedy=greedy, capture_routing=capture_routing,
                    keep_topk=keep_topk)
    if hasattr(model, "continue_sequences"):  # an inference engine standing in for the model
        return model.continue_sequences(sequences, max_new_tokens, generators, **sampling)
    r = generate(model, tokenizer, None, 1, max(max_new_tokens), generator=generators, compile=compile, engine=engine,
                 prompt_ids=sequences, limits=max_new_tokens, **sampling)
    out = []
    for i, seq in enumerate(sequences):
        n = int(r.completion_mask[i].sum())
        routed = slice(r.prompt_len - len(seq), r.prompt_len + n)  # the row's positions: left padding before them
        out.append(Continuation(
            tokens=r.completion_ids[i, :n].tolist(),
            logp=None if r.sampler_logp is None else r.sampler_logp[i, :n].cpu(),
            stopped=not bool(r.truncated[i]),
            kept_mass=None if r.kept_mass is None else r.kept_mass[i, :n].cpu(),
            topk_ids=None if r.topk_ids is None else r.topk_ids[i, :n].cpu(),
            topk_logp=None if r.topk_logp is None else r.topk_logp[i, :n].cpu(),
            routing=None if r.routing is None else r.routing[i, routed].cpu(),
            router_logp=None if r.router_logp is None else r.router_logp[i, routed].cpu(),
        ))
    return out
