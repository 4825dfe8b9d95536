"""The one way a batch of completions is drawn, in training and in held-out evaluation, with tools or without:

    rollout(sampler, tokenizer, prompts, group_size, params, keys, purpose=..., device=..., tools=None) -> Rollout

`sampler` is a torch model (gspo's own decoder samples it) or a `Decoder` (an inference engine); `params` the
run's `SamplingParams`. Each prompt's noise comes from generators keyed by `keys[i]` and `purpose`
(gspo/rollout/decoding/seeds.py): what a prompt samples depends on nothing else in the batch, whatever the batching, the
number of ranks or where sampling runs.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from gspo.rollout.decoding.decoder import as_decoder
from gspo.rollout.decoding.generate import Rollout
from gspo.rollout.decoding.multiturn import ToolUse, trajectories
from gspo.rollout.decoding.params import SamplingParams
from gspo.rollout.decoding.seeds import keyed_generator


@torch.no_grad()
def rollout(sampler, tokenizer, prompts: list, group_size: int, params: SamplingParams,
            keys: Optional[list[tuple]] = None, *, purpose: str = "sample", device: Any = "cpu",
            tools: Optional[ToolUse] = None) -> Rollout:
    """`group_size` completions (with `tools`: trajectories) for each prompt, rows group-contiguous.

    `keys`: one per prompt (None: greedy, or torch's global generator): prompt i's group draws from
    keyed_generator(*keys[i], purpose=purpose) on `device` (with tools, each sample's turn its own: gspo/rollout/
    multiturn.py)."""
    decoder = as_decoder(sampler)
    if tools is not None:
        return trajectories(decoder, tokenizer, prompts, group_size, params, tools, keys, purpose, device)
    gens = None if params.greedy or keys is None else [keyed_generator(*k, purpose=purpose, device=device) for k in keys]
    return decoder.sample(tokenizer, prompts, group_size, params, gens)
