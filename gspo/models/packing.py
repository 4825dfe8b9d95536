"""The update's forward with the prompt prefix its rows share computed once (`train.shared_prefix`).

Rows of a rollout batch often open alike: a chat template and a system prompt (the real-model preset's rows share
their first 62 of about 140 tokens). The plain forward computes that prefix once per row. Packed, a forward row holds
the prefix once, then the rest of each of several rows; a 4-D attention mask lets each row's tokens see the prefix
and their own earlier tokens only, and their position ids continue the prefix's, so every token sees the context it
sees unpacked: the same log-probs and gradients up to float rounding (other matrix shapes sum in another order;
tests/test_packing.py). A forward row's attention is quadratic in its length, so rows are packed into as many forward
rows as make the work least (`_bins`), each holding the prefix.

Prefix Grouper (arXiv 2506.05433) encodes a group's prompt once for its G completions; gspo's minibatches hold about
one row of every group (`distributed.minibatches`), so what their rows share is the batch-wide prefix, which this
packs. Both at once (a prefix tree: the batch's prefix, then each group's prompt) is not built.

`Packing.spread` and `Packing.source` map between the two layouts, so what is recorded per token of the packed
forward (MoE routing) reads as the plain forward's (N, W) rows, and what is replayed per token is packed alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

# A shared prefix shorter than this is not worth a packed forward (its mask and bookkeeping).
MIN_PREFIX = 8


@dataclass
class Packing:
    """A (N, W) batch of left-padded rows laid out as (B, S) forward rows that each hold the shared prefix once."""

    input_ids: Tensor  # (B, S) the prefix, then whole rows' remaining tokens, then padding
    position_ids: Tensor  # (B, S) each token's position in its own row (the prefix's: 0 .. p-1)
    attention_mask: Tensor  # (B, 1, S, S) bool: True where a query position may attend to a key position
    spread: Tensor  # (N*W,) long: for each (row, column) of the plain batch, the flat (B*S) position of its token
    source: Tensor  # (B*S,) long: for each packed position, a flat (N*W) position whose token it holds

    def select(self, sel: Tensor) -> Tensor:
        """(B, S) bool: the packed positions of the plain batch's (N, W) positions `sel`, in the same row-major
        order (a row's tokens keep their order, rows keep theirs), so values gathered at either line up."""
        out = torch.zeros(self.input_ids.numel(), dtype=torch.bool, device=sel.device)
        out[self.spread[sel.reshape(-1)]] = True
        return out.view_as(self.input_ids)


def shared_prefix_len(input_ids: Tensor, attention_mask: Tensor, prompt_len: int) -> int:
    """The number of leading real tokens every row has in common, at most each row's prompt less its last token
    (the last prompt token predicts the first completion token: it stays with its row)."""
    lengths = attention_mask[:, :prompt_len].sum(-1)
    limit = int(lengths.min()) - 1
    if limit <= 0:
        return 0
    first = prompt_len - lengths  # each row's first real column (prompts are left-padded)
    cols = first[:, None] + torch.arange(limit, device=input_ids.device)
    tokens = input_ids.gather(1, cols)
    same = (tokens == tokens[:1]).all(0)
    return limit if bool(same.all()) else int((~same).int().argmax())


def contiguous(attention_mask: Tensor) -> bool:
    """Whether every row's real tokens are one run of columns (no masked column between two real ones)."""
    m = attention_mask.bool()
    starts = (m[:, 1:] & ~m[:, :-1]).sum(-1) + m[:, 0].long()
    return bool((starts <= 1).all())


# Where a forward row's attention costs, per token, what the rest of its layers cost: a row of S tokens costs about
# S x (1 + S / CROSSOVER). Measured on SmolLM2-135M (576 wide, 30 layers) on 2 CPU cores: 16 rows of 126 tokens
# sharing 62 took 0.79x the plain forward and backward packed as one row of 1,018 tokens, 0.73x as two of 540.
CROSSOVER = 2048


def _bins(tails: list[int], prefix: int, capacity: int) -> list[list[int]]:
    """Rows, in order, into consecutive forward rows of at most `capacity` tokens each (a row longer than that alone),
    as many as make the work least: each holds the prefix once, and a batch of forward rows is as long as its
    longest, so for each count the rows are split as evenly as order allows."""
    def split(limit: int) -> list[list[int]]:  # greedy: a new forward row when the next tail would pass `limit`
        out: list[list[int]] = []
        size = limit + 1
        for r, t in enumerate(tails):
            if size + t > limit and (not out or out[-1]):
                out.append([])
                size = 0
            out[-1].append(r)
            size += t
        return out

    longest, total = max(tails), sum(tails)
    best, best_cost = None, float("inf")
    for k in range(1, len(tails) + 1):
        lo, hi = longest, total
        while lo < hi:  # the least longest forward row that k of them can hold
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if len(split(mid)) > k else (lo, mid)
        bins = split(lo)
        S = prefix + lo
        if S > capacity and k < len(tails):
            continue
        cost = len(bins) * S * (1 + S / CROSSOVER)
        if cost < best_cost:
            best, best_cost = bins, cost
    return best


def pack(input_ids: Tensor, attention_mask: Tensor, prompt_len: int, capacity: int, pad_id: int = 0,
         min_prefix: int = MIN_PREFIX) -> Optional[Packing]:
    """The packed layout of a left-padded (N, W) batch, or None where packing saves nothing: a shared prefix
    shorter than `min_prefix`, rows with masked columns between real ones, or no forward row that holds two rows."""
    N, W = input_ids.shape
    if not contiguous(attention_mask):
        return None
    p = shared_prefix_len(input_ids, attention_mask, prompt_len)
    if p < max(1, min_prefix):
        return None
    lengths = attention_mask.sum(-1).tolist()
    starts = attention_mask.int().argmax(-1).tolist()  # each row's first real column
    bins = _bins([n - p for n in lengths], p, capacity)
    if len(bins) == N:
        return None
    S = max(p + sum(lengths[r] - p for r in rows) for rows in bins)
    device = input_ids.device
    ids = torch.full((len(bins), S), pad_id, dtype=input_ids.dtype, device=device)
    pos = torch.zeros((len(bins), S), dtype=torch.long, device=device)
    owner = torch.full((len(bins), S), -2, dtype=torch.long, device=device)  # -1: the prefix; -2: padding
    spread = torch.zeros(N * W, dtype=torch.long, device=device)
    source = torch.zeros(len(bins) * S, dtype=torch.long, device=device)
    for b, rows in enumerate(bins):
        first = rows[0]
        ids[b, :p] = input_ids[first, starts[first]:starts[first] + p]
        pos[b, :p] = torch.arange(p, device=device)
        owner[b, :p] = -1
        source[b * S: b * S + p] = first * W + starts[first] + torch.arange(p, device=device)
        at = p
        for r in rows:
            s0, n = starts[r], lengths[r]
            cols = torch.arange(s0, s0 + n, device=device)
            # the row's prefix columns are the forward row's prefix; the rest follows it
            spread[r * W + cols[:p]] = b * S + torch.arange(p, device=device)
            tail = n - p
            ids[b, at:at + tail] = input_ids[r, s0 + p:s0 + n]
            pos[b, at:at + tail] = torch.arange(p, n, device=device)
            owner[b, at:at + tail] = r
            spread[r * W + cols[p:]] = b * S + at + torch.arange(tail, device=device)
            source[b * S + at: b * S + at + tail] = r * W + cols[p:]
            at += tail
    causal = torch.ones((S, S), dtype=torch.bool, device=device).tril()
    # a query sees the prefix and its own row's earlier tokens; padding sees the prefix only (its output unused)
    visible = (owner[:, None, :] == -1) | (owner[:, :, None] == owner[:, None, :])
    mask = (causal & visible)[:, None]
    return Packing(ids, pos, mask, spread, source)


def for_forward(model, input_ids: Tensor, attention_mask: Tensor, prompt_len: int, pad_id: int = 0,
                capacity: Optional[int] = None) -> Optional[Packing]:
    """`pack` for `model` (or its DDP wrapper), its mask in the form the model's attention reads (bool for SDPA,
    additive for eager); None for another attention implementation (flash attention reads no 4-D mask) or where
    `pack` finds nothing to share. Default capacity (a bound on a forward row's memory; `_bins` picks the count by
    cost below it): 4,096 tokens or twice the plain row, whichever is more."""
    config = getattr(getattr(model, "module", model), "config", None)
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in ("sdpa", "eager"):
        return None
    W = input_ids.shape[1]
    packing = pack(input_ids, attention_mask, prompt_len, capacity or max(4096, 2 * W), pad_id)
    if packing is not None and impl == "eager":
        dtype = next(model.parameters()).dtype
        additive = torch.zeros(packing.attention_mask.shape, dtype=dtype, device=input_ids.device)
        packing.attention_mask = additive.masked_fill_(~packing.attention_mask, torch.finfo(dtype).min)
    return packing
