"""How completions are drawn: the sampling settings, as one object, and the decoders that draw with them.

    params = SamplingParams.of(cfg)          # once per run, from cfg.rollout (gspo/rollout/decoding/params.py)
    decoder = as_decoder(model)              # a torch model: gspo's own decoder (rollout.engine hf / fast);
                                             # an inference engine (vLLM, gspo/rollout/engine/client.py) is one already
    decoder.sample(tokenizer, prompts, group_size, params, generators)            -> Rollout
    decoder.continue_sequences(tokenizer, sequences, budgets, generators, params) -> list[Continuation]

`sample` draws G completions per prompt; `continue_sequences` continues token sequences by at most their own
budgets (the primitive a multi-turn rollout with tools is built on: gspo/rollout/decoding/multiturn.py). Both take each
prompt's (or sequence's) noise from its own generator, so what a row samples depends on nothing else in the batch.
A decoder is told apart by its type (a `Decoder` subclass), never by the attributes it happens to have: a new
engine is one class. `gspo/rollout/decoding/rollouts.py` is the one function that both training and held-out evaluation
call, with or without tools.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Optional

import torch

from gspo.rollout.decoding.generate import Rollout, generate, stop_ids
from gspo.rollout.decoding.params import SamplingParams


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


class Decoder(ABC):
    """What samples completions: gspo's own decoder on a torch model (`ModelDecoder`), or an inference engine."""

    @abstractmethod
    def stop_ids(self, tokenizer) -> torch.Tensor:
        """Every token id a completion ends at."""

    @abstractmethod
    def sample(self, tokenizer, prompts: list, group_size: int, params: SamplingParams,
               generators: Optional[list[torch.Generator]]) -> Rollout:
        """`group_size` completions for each prompt (a string or chat messages), rows group-contiguous; group i
        draws its noise from `generators[i]` alone (None when `params.greedy`)."""

    @abstractmethod
    def continue_sequences(self, tokenizer, sequences: list[list[int]], max_new_tokens: list[int],
                           generators: Optional[list[torch.Generator]], params: SamplingParams) -> list[Continuation]:
        """Each of `sequences` (token ids, never re-tokenised) continued by at most `max_new_tokens[i]` (>= 1)
        tokens, stopping at the stop ids; row i draws its noise from `generators[i]` alone (`params.max_new_tokens`
        is not read: each sequence has its own budget)."""


class ModelDecoder(Decoder):
    """gspo's own decoder on a torch model (rollout.engine hf / fast: gspo/rollout/decoding/generate.py)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def stop_ids(self, tokenizer) -> torch.Tensor:
        """The tokenizer's EOS and each end id the model's generation config lists (chat checkpoints end a turn
        with another token: Gemma's `<end_of_turn>`, Llama 3's `<|eot_id|>`), as `generate`, vLLM and verl stop."""
        return stop_ids(self.model, tokenizer)

    def sample(self, tokenizer, prompts, group_size, params, generators):
        return generate(self.model, tokenizer, prompts, group_size, params, generators)

    def continue_sequences(self, tokenizer, sequences, max_new_tokens, generators, params):
        params = replace(params, max_new_tokens=max(max_new_tokens))
        r = generate(self.model, tokenizer, None, 1, params, generators, prompt_ids=sequences, limits=max_new_tokens)
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


def as_decoder(sampler) -> Decoder:
    """The decoder that samples for `sampler`: a `Decoder` as it is, a torch model through gspo's own."""
    return sampler if isinstance(sampler, Decoder) else ModelDecoder(sampler)
