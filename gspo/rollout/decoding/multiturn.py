"""Multi-turn rollouts with tools: the model calls functions, reads their results and goes on (`rollout.tools`).

A trajectory is prompt -> model turn -> tool result(s) -> model turn ... until the model stops calling tools,
`rollout.max_turns` model turns are done, or its token budget (`rollout.max_new_tokens`, everything after the
prompt: the model's tokens and the tools', as TRL's `max_completion_length`) runs out. Token in, token out: the
model's tokens are the ones sampled (a decoder's `continue_sequences`, gspo/rollout/decoding/decoder.py, continues the
token sequences themselves, never a re-rendered text), the tools' replies are appended as the chat template renders them
(gspo/rollout/decoding/chat.py).

The result is a `Rollout` like a single-turn one, so everything downstream is unchanged: `input_ids` and
`attention_mask` hold the whole trajectory, `completion_mask` is 1 on the model's tokens only (every loss, KL,
entropy, length, mismatch and routing statistic reads it), `sampler_logp` exists on the model's tokens only, and
the routing recorded while sampling covers every position (a position is recorded by the pass that first fed
it, as an engine's prefix cache would: R3 replays what the model saw). `texts` holds each row's last assistant
message (what the task's verifier judges), `conversations` the messages after the prompt (what reward
functions get as `completions`, as TRL passes them), and `turns`, `tool_calls`, `tool_errors` the counts.

Seeds: turn k of sample j of prompt g draws from a generator keyed by (the prompt's key, j, k), the prompt's key
being (seed, step, draw, global prompt index) in training: a trajectory depends on nothing else in the batch,
whatever the batching, the number of ranks or where sampling runs.

Where gspo differs from TRL's `tools=` loop: a trajectory ends after `rollout.max_turns` model turns (TRL:
`max_tool_calling_iterations` = max_turns - 1 rounds of calls); the tools run in a child process under a time
limit (gspo/tasks/tools.py); a malformed `<tool_call>` is answered with an error and counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F

from gspo.rollout.decoding import chat
from gspo.rollout.decoding.decoder import Continuation, Decoder
from gspo.rollout.decoding.generate import Decoded, Recorded, Rollout, Tokens, ToolRecord, assemble, encode_prompts
from gspo.rollout.decoding.params import SamplingParams
from gspo.rollout.decoding.seeds import keyed_generator
from gspo.tasks.tools import Toolbox, specs_of, toolbox


@dataclass(frozen=True)
class ToolUse:
    """A run's tools as its rollouts use them (`rollout.tools`, `rollout.max_turns`, `rollout.tool_timeout_s`)."""

    specs: tuple[str, ...]
    timeout_s: float
    max_turns: int

    @staticmethod
    def of(cfg) -> Optional["ToolUse"]:
        """The run's tools, or None without `rollout.tools`."""
        r = cfg.rollout
        return None if r.tools is None else ToolUse(tuple(specs_of(r.tools)), float(r.tool_timeout_s), int(r.max_turns))

    @property
    def box(self) -> Toolbox:
        """This process's tool server (started on first use)."""
        return toolbox(list(self.specs), self.timeout_s)


@dataclass
class _Trajectory:
    """One row being sampled: its prompt, the tokens after it, and what the Rollout needs of them."""

    prompt: list[int]
    tail: list[int] = field(default_factory=list)
    mine: list[int] = field(default_factory=list)  # per tail token: 1 the model sampled it, 0 a tool's reply
    # what the sampler recorded per tail token (neutral at a tool's: log-prob 0, kept mass 1, top-k zeros); None
    # once a model turn recorded none (greedy; an engine that gives none in gspo's convention), never made up
    logp: Optional[list[float]] = field(default_factory=list)
    kept: Optional[list[float]] = field(default_factory=list)
    topk: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)  # per tail chunk: (ids, logp)
    routing: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per fed chunk of positions
    routed: int = 0  # positions whose routing is recorded
    messages: list[dict] = field(default_factory=list)
    answer: str = ""  # the last assistant message's content
    turns: int = 0
    calls: int = 0
    errors: int = 0
    ill_formed: bool = False
    truncated: bool = False
    done: bool = False

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.tail

    def add(self, tokens: list[int], mine: bool, c: Optional[Continuation] = None, k: int = 0) -> None:
        """Append the model's turn `c` (its `tokens`, `mine`) or a tool's reply (`c` None)."""
        n = len(tokens)
        self.tail += tokens
        self.mine += [int(mine)] * n
        if c is None:  # a tool's tokens: neutral values, masked out of everything that reads them
            self.logp = None if self.logp is None else self.logp + [0.0] * n
            self.kept = None if self.kept is None else self.kept + [1.0] * n
            self.topk = None if self.topk is None else self.topk + [(torch.zeros((n, k), dtype=torch.long),
                                                                     torch.zeros((n, k)))]
        else:
            self.logp = None if self.logp is None or c.logp is None else self.logp + c.logp.tolist()
            self.kept = None if self.kept is None or c.kept_mass is None else self.kept + c.kept_mass.tolist()
            self.topk = None if self.topk is None or c.topk_ids is None else self.topk + [(c.topk_ids, c.topk_logp)]
        if c is not None and c.routing is not None:  # positions fed for the first time (the last token is not yet)
            end = len(self.ids) - 1
            self.routing.append((c.routing[self.routed : end], c.router_logp[self.routed : end]))
            self.routed = end


@torch.no_grad()
def trajectories(decoder: Decoder, tokenizer, prompts: list, group_size: int, params: SamplingParams, tools: ToolUse,
                 keys: Optional[list[tuple]] = None, purpose: str = "sample", device: Any = "cpu") -> Rollout:
    """`group_size` trajectories for each prompt (rows group-contiguous), as a Rollout (module docstring); what
    gspo/rollout/decoding/rollouts.py's `rollout` runs with tools.

    `params.max_new_tokens` budgets every token after the prompt. `keys`: one per prompt (None when greedy): sample
    j's turn k draws from keyed_generator(*keys[g], j, k, purpose=purpose) on `device`. Prompts (strings or chat
    messages) are rendered with the chat template and the tools' schemas.
    """
    box, budget = tools.box, params.max_new_tokens
    stops = set(decoder.stop_ids(tokenizer).tolist())
    chat.check_template(tokenizer, stops)
    special = set(tokenizer.all_special_ids) - stops
    k = params.topk
    rows = [_Trajectory(p) for p in encode_prompts(tokenizer, prompts, True, box.schemas) for _ in range(group_size)]
    for turn in range(tools.max_turns):
        active = [i for i, r in enumerate(rows) if not r.done]
        if not active:
            break
        gens = None if params.greedy else [keyed_generator(*keys[i // group_size], i % group_size, turn,
                                                           purpose=purpose, device=device) for i in active]
        outs = decoder.continue_sequences(tokenizer, [rows[i].ids for i in active],
                                          [budget - len(rows[i].tail) for i in active], gens, params)
        for i, c in zip(active, outs):
            _model_turn(rows[i], c, tokenizer, box, stops, special, k, last=turn == tools.max_turns - 1, budget=budget)
    return _as_rollout(rows, tokenizer, group_size, params.capture_routing, device)


def _model_turn(row: _Trajectory, c: Continuation, tokenizer, box: Toolbox, stops: set[int], special: set[int],
                k: int, last: bool, budget: int) -> None:
    """Append the model's turn `c` to `row`; run the tools it called and append their replies, or end the row."""
    prefix = row.ids
    row.add(c.tokens, True, c, k)
    row.turns += 1
    body = c.tokens[:-1] if c.stopped else c.tokens
    row.ill_formed |= any(t in special for t in body)  # a special token the model wrote inside its turn
    text = tokenizer.decode(body, skip_special_tokens=True)
    turn = chat.read_turn(tokenizer, text, body, prefix, box.schemas)
    message = {"role": "assistant", "content": turn.content}
    if turn.calls:
        message["tool_calls"] = turn.calls
    row.messages.append(message)
    row.answer = turn.content
    row.truncated = not c.stopped
    if not c.stopped or last or not (turn.calls or turn.malformed):
        row.done = True  # out of budget, out of turns (calls left unanswered are not run), or an answer
        return
    replies = []
    for call in turn.calls:
        content, failed = box.call(call["function"]["name"], call["function"]["arguments"])
        replies.append({"role": "tool", "name": call["function"]["name"], "content": content})
        row.errors += failed
    for why in turn.malformed:  # answered as a failed call, as TRL answers an unsupported one
        replies.append({"role": "tool", "name": "unknown", "content": str({"error": f"malformed tool call: {why}"})})
        row.errors += 1
    row.calls += len(replies)
    suffix = chat.tool_suffix(tokenizer, replies, stops)
    if len(row.tail) + len(suffix) >= budget:  # no room left for the model to read the replies and go on (as TRL)
        row.done = True
        return
    row.add(suffix, False, None, k)
    row.messages += replies


def _as_rollout(rows: list[_Trajectory], tokenizer, group_size: int, capture_routing: bool,
                device) -> Rollout:
    """The trajectories as one Rollout: prompts left-padded to P columns, tails right-padded to T. The sampler's
    log-probs, kept mass and top-k are the batch's only where every row has them (as a single-turn rollout's)."""
    pad = tokenizer.pad_token_id
    P, T = max(len(r.prompt) for r in rows), max(len(r.tail) for r in rows)

    def tails(values, fill, dtype=torch.float32) -> torch.Tensor:
        return torch.tensor([v + [fill] * (T - len(v)) for v in values], dtype=dtype)

    prompts = torch.tensor([[pad] * (P - len(r.prompt)) + r.prompt for r in rows], dtype=torch.long)
    prompt_mask = torch.tensor([[0] * (P - len(r.prompt)) + [1] * len(r.prompt) for r in rows], dtype=torch.long)
    tail_mask = tails([[1] * len(r.tail) for r in rows], 0, torch.long)
    mine = tails([r.mine for r in rows], 0)
    routing = router_logp = None
    if capture_routing:  # each row's positions [P - len(prompt), P + len(tail)); -1 / 0 where none was recorded
        routing_rows, logp_rows = [], []
        for r in rows:
            idx, lp = (torch.cat([c[j] for c in r.routing]) for j in (0, 1))
            before = P - len(r.prompt)
            after = P + T - before - idx.shape[0]
            routing_rows.append(F.pad(idx.movedim(0, -1), (before, after), value=-1).movedim(-1, 0))
            logp_rows.append(F.pad(lp.movedim(0, -1), (before, after), value=0.0).movedim(-1, 0))
        routing, router_logp = torch.stack(routing_rows).to(device), torch.stack(logp_rows).to(device)
    topk_ids = topk_logp = None
    if all(r.topk is not None for r in rows):  # (None: rollout.keep_topk off, or a turn the sampler kept none of)
        topk_ids = torch.stack([F.pad(torch.cat([c[0] for c in r.topk]), (0, 0, 0, T - len(r.tail))) for r in rows])
        topk_logp = torch.stack([F.pad(torch.cat([c[1] for c in r.topk]), (0, 0, 0, T - len(r.tail))) for r in rows])
    logp = None if any(r.logp is None for r in rows) else tails([r.logp for r in rows], 0.0)
    kept = None if any(r.kept is None for r in rows) else tails([r.kept for r in rows], 1.0)
    texts = [r.answer for r in rows]
    moved = lambda x: None if x is None else x.to(device)  # noqa: E731
    return assemble(
        Tokens(prompt_ids=prompts.to(device), prompt_mask=prompt_mask.to(device),
               tail_ids=tails([r.tail for r in rows], pad, torch.long).to(device), tail_mask=tail_mask.to(device),
               model_mask=mine.to(device), pad_id=pad, group_size=group_size),
        Decoded(texts=texts, clean_texts=list(texts), truncated=torch.tensor([r.truncated for r in rows]).to(device),
                ill_formed=torch.tensor([r.ill_formed for r in rows])),
        Recorded(sampler_logp=moved(logp), kept_mass=moved(kept), topk_ids=moved(topk_ids),
                 topk_logp=moved(topk_logp), routing=None if routing is None else (routing, router_logp)),
        ToolRecord(conversations=[r.messages for r in rows], turns=torch.tensor([r.turns for r in rows]),
                   tool_calls=torch.tensor([r.calls for r in rows]),
                   tool_errors=torch.tensor([r.errors for r in rows])),
    )
