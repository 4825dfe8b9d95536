"""The update's forward with the prompt prefix its rows share computed once (`train.shared_prefix`).

Rows of a rollout batch often open alike: a chat template and a system prompt (the real-model preset's rows share
their first 62 of about 140 tokens). The plain forward computes that prefix once per row. Packed, a forward row holds
the prefix once, then the rest of each of several rows; a 4-D attention mask lets each row's tokens see the prefix
and their own earlier tokens only, and their position ids continue the prefix's, so every token sees the context it
sees unpacked: the same log-probs and gradients up to float rounding (other matrix shapes sum in another order;
tests/models/test_packing.py). A forward row's attention is quadratic in its length, so rows are packed into as many
forward rows as make the work least (`_bins`), each holding the prefix.

Prefix Grouper (arXiv 2506.05433) encodes a group's prompt once for its G completions; gspo's minibatches hold about
one row of every group (`distributed.minibatches`), so what their rows share is the batch-wide prefix, which this
packs. Both at once (a prefix tree: the batch's prefix, then each group's prompt) is not built.

`Packing.spread` and `Packing.source` map between the two layouts, so what is recorded per token of the packed
forward (MoE routing) reads as the plain forward's (N, W) rows, and what is replayed per token is packed alike.

Exact only where nothing but the 4-D mask lets tokens meet: transformers uses a prepared 4-D mask as given, so a
sliding window is lost, and a recurrent, state-space or convolutional layer runs across the packed rows, one row's
state flowing into the next. `why_plain` decides per model (and per batch, for a window): an allow-list of checked
families (`EXACT_FAMILIES`) whose layers are all attention, a sliding window only where it hides no token of the
batch; anything else gets the plain forward, said once on stderr.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

# A shared prefix shorter than this is not worth a packed forward (its mask and bookkeeping).
MIN_PREFIX = 8

# Families (config.model_type) whose every layer is attention that reads a prepared 4-D mask as given and places
# tokens by their position ids, with nothing else mixing tokens: packed, each token computes what it computes
# unpacked. Each is checked against the plain forward in float64 (tests/models/test_packing.py, which fails when one
# here is not among its cases). Not here, so plain: recurrent and state-space hybrids (Mamba, Jamba, Falcon-H1,
# Qwen3-Next, LFM2), GPT-1 (its attention reads no 4-D mask), Llama 4 (chunked attention; an attention scale from the
# column), and every family never checked.
EXACT_FAMILIES = frozenset({
    "llama", "gpt2", "mistral", "gemma2", "gemma3_text", "phi3", "qwen2", "qwen3", "granite", "cohere", "mixtral",
    "olmoe", "qwen2_moe", "qwen3_moe", "granitemoe", "ernie4_5_moe", "gpt_oss", "deepseek_v3", "glm4_moe",
    "hunyuan_v1_moe", "afmoe", "phimoe", "jetmoe",
})
# the layer kinds (config.layer_types) an exact family may have; a sliding layer's window is checked per batch
_ATTENTION = frozenset({"full_attention", "sliding_attention"})
# layer kinds (or parts of their names) that carry state along the sequence: linear attention (gated DeltaNet; also
# transformers' name for Mamba layers), short convolutions (LFM2), Mamba beside attention (Falcon-H1's "hybrid")
_STATEFUL = ("linear", "conv", "hybrid", "mamba", "recurrent", "ssm")
_SAID: set[str] = set()  # the fallbacks said in this process (each once)


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


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a DDP (`module`) or peft (`get_base_model`) wrapper."""
    model = getattr(model, "module", model)
    return model.get_base_model() if hasattr(model, "peft_config") else model


def _window(config) -> Optional[int]:
    """The window of the model's sliding-window layers, or None where none has one: `sliding_window` where set,
    unless `layer_types` names no sliding layer (Qwen2/Qwen3 without `use_sliding_window`). Taken as applied
    wherever else it is set (Mistral, Phi-3, Mixtral: on every layer): at worst a plain forward more."""
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None)
    return int(window) if window and (kinds is None or "sliding_attention" in kinds) else None


def why_plain(model: torch.nn.Module, longest: int) -> Optional[str]:
    """Why a packed forward of rows of up to `longest` real tokens would not give `model`'s plain numbers (None: it
    gives them, to float rounding). A sliding window hides no token of a row no longer than it (a query sees the
    `window` keys up to itself), so the packed mask, which has no window, is exact there."""
    config = _unwrapped(model).config
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in ("sdpa", "eager"):
        return f"attention {impl} reads no 4-D mask"
    kinds = sorted(set(getattr(config, "layer_types", None) or ()) - _ATTENTION)
    stateful = [k for k in kinds if any(w in k for w in _STATEFUL)]
    if stateful:
        return f"its {'/'.join(stateful)} layers carry state along the sequence, from one packed row into the next"
    if kinds:
        return f"its {'/'.join(kinds)} layers are not known to read a packed 4-D mask as given"
    if getattr(config, "model_type", None) not in EXACT_FAMILIES:
        return f"{getattr(config, 'model_type', None)!r} is not a family whose packed forward is known to be exact"
    window = _window(config)
    if window is not None and window < longest:
        return f"its sliding window ({window}) is not kept by a packed 4-D mask"
    return None


def recorded(model: torch.nn.Module, on: bool = True) -> str:
    """What the update's forward is for `model` under `train.shared_prefix=on`, as summary.json's `shared_prefix`
    records it: "packed: ..." where the packed forward gives the plain numbers (a sliding window: for rows no longer
    than it), else "plain: WHY" (`why_plain`'s reason, as said on stderr)."""
    if not on:
        return "plain: train.shared_prefix=false"
    why = why_plain(model, 0)  # the model's reasons; a window is decided per batch, below
    if why is not None:
        return f"plain: {why}"
    window = _window(_unwrapped(model).config)
    limit = f"; plain for a minibatch with a row longer than its sliding window ({window})" if window else ""
    return f"packed: each minibatch whose rows share {MIN_PREFIX} or more leading tokens{limit}"


def _say_once(model: torch.nn.Module, why: str) -> None:
    """One line on stderr, once per model class and reason in this process (on rank 0 only under torch.distributed:
    every rank decides alike)."""
    name = type(_unwrapped(model)).__name__.removeprefix("FSDP")  # (fully_shard renames the class in place)
    line = f"gspo: train.shared_prefix: off for {name}: {why}; the plain forward is used"
    if line in _SAID:
        return
    _SAID.add(line)
    if not torch.distributed.is_available() or not torch.distributed.is_initialized() \
            or torch.distributed.get_rank() == 0:
        print(line, file=sys.stderr, flush=True)


def for_forward(model, input_ids: Tensor, attention_mask: Tensor, prompt_len: int, pad_id: int = 0,
                capacity: Optional[int] = None) -> Optional[Packing]:
    """`pack` for `model` (or its DDP or peft wrapper), its mask in the form the model's attention reads (bool for
    SDPA, additive for eager); None where `pack` finds nothing to share, or where the packed forward would not give
    the plain forward's numbers (`why_plain`: another attention implementation, a family not known to be exact, a
    sliding window shorter than a row), which is said once. Default capacity (a bound on a forward row's memory;
    `_bins` picks the count by cost below it): 4,096 tokens or twice the plain row, whichever is more."""
    why = why_plain(model, int(attention_mask.sum(-1).max()))
    if why is not None:
        _say_once(model, why)
        return None
    impl = getattr(_unwrapped(model).config, "_attn_implementation", None) or "eager"
    W = input_ids.shape[1]
    packing = pack(input_ids, attention_mask, prompt_len, capacity or max(4096, 2 * W), pad_id)
    if packing is not None and impl == "eager":
        dtype = next(model.parameters()).dtype
        additive = torch.zeros(packing.attention_mask.shape, dtype=dtype, device=input_ids.device)
        packing.attention_mask = additive.masked_fill_(~packing.attention_mask, torch.finfo(dtype).min)
    return packing
