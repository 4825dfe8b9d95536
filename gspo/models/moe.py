"""Mixture-of-Experts routing: capture, Routing Replay (R2/R3) and routing statistics.

Works on any Hugging Face MoE whose router is a module with ``top_k``, ``num_experts``
and a weight (its own, or its only child's, a Linear) that returns ``(router_logits (N, E),
scores (N, k), indices (N, k))`` or, like Llama 4's, ``(dense scores (N, E), router_logits)``
(transformers >= 5: Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, GPT-OSS, Granite-MoE, DeepSeek-V3,
GLM-4 MoE, Llama 4, HunYuan-MoE ...; docs/contracts.md section 6 lists those tested). How a
router turns logits into the weights of its experts (its `Scoring`: softmax or sigmoid,
renormalised over the top-k or not, times a constant) is read off its own output on its
first call; replay and the router's distribution use that rule. `check_routers` refuses,
in one line, what cannot be read or replayed.

We wrap routers with forward hooks rather than re-implementing their forward: the
router computes exactly what it always does and the hook only reads (capture) or
rewrites (replay) its output tuple. Hooks are removed on context exit, and replay
hooks are *prepended* so that capture, whatever the nesting order, records the
routing the experts actually used.

Conventions (shared by every tensor below):
  * a router call sees ``N = B*T`` rows: the MoE block flattens ``(B, T, H)`` with
    ``view(-1, H)``, i.e. row-major, row ``n = b*T + t``;
  * "layer" ``l`` is the l-th router in :func:`find_routers` order (the l-th *MoE*
    layer; dense layers such as Qwen3-MoE's and Qwen2-MoE's ``mlp_only_layers`` are skipped);
  * routing indices are ``(B, T, L, k)`` long, ``-1`` meaning "no routing recorded"
    (e.g. the last sampled token, which never went through the model);
  * router log-probs are ``(B, T, L, E)`` float32 log-probs of the router's distribution
    over experts (`Scoring.log_probs`): ``log_softmax(logits)`` for a softmax router; for a
    sigmoid router its sigmoid affinities normalised to sum 1 (DeepSeek-V3's s'_i).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from gspo.core.errors import ConfigError

__all__ = [
    "RoutingTrace", "Scoring", "capture_routing", "check_routers", "expert_load", "find_routers", "is_moe", "load_balancing_loss",
    "moe_metrics", "replay_routing", "router_shift", "routing_volatility",
]


# ----------------------------------------------------------------------------- discovery
def router_weight(module: nn.Module) -> Optional[torch.Tensor]:
    """A router's (E, H) weight: its own ``weight``, or that of its only child, a Linear (HunYuan's ``wg``, AFMoE's
    ``gate``, LongCat's ``classifier``)."""
    w = getattr(module, "weight", None)
    if isinstance(w, torch.Tensor):
        return w
    children = list(module.children())
    return children[0].weight if len(children) == 1 and isinstance(children[0], nn.Linear) else None


def _is_router(module: nn.Module) -> bool:
    """A top-k router by duck typing: the attributes every HF (>= 5) MoE router carries."""
    top_k, num_experts = getattr(module, "top_k", None), getattr(module, "num_experts", None)
    # The sparse MoE block of some models also has top_k/num_experts, but no weight of its own and
    # several children; the experts module has num_experts but no top_k; Qwen2-MoE's shared_expert_gate
    # (a Linear to one output, the shared expert's sigmoid gate) has neither.
    return (isinstance(top_k, int) and isinstance(num_experts, int) and 0 < top_k <= num_experts
            and router_weight(module) is not None)


_ROUTERS: "weakref.WeakKeyDictionary[nn.Module, list[nn.Module]]" = weakref.WeakKeyDictionary()


def find_routers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE routers in layer order (module registration order); [] for dense models.

    Remembered per model object: walking every module costs ~1 ms and the loop asks on every
    forward it hooks. (peft adapts layers in place but never routers, and wraps the model in
    a new object, which is scanned afresh.)
    """
    if model not in _ROUTERS:
        _ROUTERS[model] = [m for _, m in model.named_modules() if _is_router(m)]
    return list(_ROUTERS[model])


def is_moe(model: nn.Module) -> bool:
    """True when the model has at least one top-k router."""
    return bool(find_routers(model))


class RouterFormatError(TypeError):
    """A module that looks like a router returned something gspo cannot read as routing."""


_ORDER: "weakref.WeakKeyDictionary[nn.Module, tuple[int, int, int]]" = weakref.WeakKeyDictionary()


def _positions(output: tuple, router: nn.Module) -> tuple[int, int, int]:
    """Where a 3-tuple router output holds (logits, weights, indices), read from the tensors themselves: the
    indices are the integer tensor, the logits the float one over all experts. Most routers return them in that
    order; some do not (GraniteMoe's router before transformers 5.21 returns (indices, weights, logits)), and a
    positional read would replay weights as logits without a word. Where the router picks every expert (top_k =
    num_experts) both float tensors span the experts, and the values tell them apart (`_order_by_values`)."""
    if not all(isinstance(t, torch.Tensor) for t in output):
        raise RouterFormatError(f"{type(router).__name__} returns a 3-tuple that is not all tensors")
    ints = [i for i, t in enumerate(output) if not (t.is_floating_point() or t.is_complex())]
    floats = [i for i in range(3) if i not in ints]
    if len(ints) != 1:
        raise RouterFormatError(f"{type(router).__name__} returns {len(ints)} integer tensors among three; routing "
                                "capture/replay needs exactly one (the chosen experts)")
    a, b = floats
    wide_a, wide_b = (output[i].shape[-1] == router.num_experts for i in (a, b))
    if wide_a != wide_b:  # the one spanning every expert is the logits, the other the k chosen experts' weights
        return (b, a, ints[0]) if wide_b else (a, b, ints[0])
    if router.top_k != router.num_experts:
        raise RouterFormatError(f"{type(router).__name__}'s float outputs have last dims "
                                f"{output[a].shape[-1]} and {output[b].shape[-1]}: neither reads as the logits over "
                                f"its {router.num_experts} experts")
    if router not in _ORDER:
        order, settled = _order_by_values(output, a, b, ints[0], router)
        if not settled:  # (not remembered: a later call's values may settle it)
            return order
        _ORDER[router] = order
    return _ORDER[router]


@torch.no_grad()
def _order_by_values(output: tuple, a: int, b: int, i: int, router: nn.Module) -> tuple[tuple[int, int, int], bool]:
    """(logits, weights, indices) positions of a router output whose two float tensors both span every expert
    (top_k = num_experts), and whether its values settled it. The weights are a scoring rule of the logits at the
    indices (`_fit`: a softmax or sigmoid, renormalised or not, times a positive constant); read the other way round
    they are almost never (weights are positive and ranked as their logits, logits are neither). Where both readings
    or neither fit (equal logits, an empty call, a rule gspo does not know), the weights are the float tensor beside
    the indices, as in both orders routers use ((logits, weights, indices), and GraniteMoe's (indices, weights,
    logits)); where both are beside them, the tuple's order."""
    indices = output[i]
    fits = []
    if indices.numel():
        k = indices.shape[-1]
        rows = indices.reshape(-1, k)
        for logits, weights in ((a, b), (b, a)):
            z, w = output[logits].reshape(-1, output[logits].shape[-1]), output[weights].reshape(-1, k)
            if _fit(router, z, w, rows) is not None:
                fits.append((logits, weights, i))
    if len(fits) == 1:
        return fits[0], True
    if abs(a - i) == 1 and abs(b - i) != 1:  # a beside the indices: a the weights
        return (b, a, i), False
    return (a, b, i), False


def _unpack(output: object, router: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits (N, E), weights (N, k), indices (N, k)) from a router's output, in either format:

    ``(logits, weights, indices)`` in any order (most routers; see `_positions`), or ``(dense weights (N, E),
    logits (N, E))`` with zeros off the chosen experts (Llama 4, whose MoE block weights every expert by it).
    """
    if isinstance(output, (tuple, list)) and len(output) == 3:
        return tuple(output[i] for i in _positions(output, router))
    if (isinstance(output, (tuple, list)) and len(output) == 2 and all(isinstance(t, torch.Tensor) for t in output)
            and output[0].shape == output[1].shape and output[0].shape[-1] == router.num_experts):
        dense, logits = output
        indices = dense.topk(router.top_k, dim=-1).indices
        return logits, dense.gather(-1, indices), indices
    raise RouterFormatError(f"{type(router).__name__} looks like a router but returns neither (logits, scores, "
                            "indices) nor (dense scores, logits); routing capture/replay cannot wrap it")


def _pack(output: object, router: nn.Module, logits: torch.Tensor, weights: torch.Tensor,
          indices: torch.Tensor) -> object:
    """The router's output with `weights` at `indices` instead of its own, in its own format and order."""
    if len(output) == 3:
        out = [None] * 3
        for i, t in zip(_positions(output, router), (logits, weights, indices)):
            out[i] = t
        return type(output)(out)
    dense = torch.zeros_like(output[0]).scatter(-1, indices.reshape(-1, indices.shape[-1]).long(),
                                                weights.reshape(-1, weights.shape[-1]).to(output[0].dtype))
    return type(output)((dense.view_as(output[0]), output[1]))


# ----------------------------------------------------------------------------- scoring
@dataclass(frozen=True)
class Scoring:
    """A router's rule from logits (N, E) to the gating weights of the experts it picked.

    ``kind``: ``softmax`` (Mixtral, Qwen, OLMoE, GPT-OSS's softmax over the top-k logits =
    the renormalised softmax) or ``sigmoid`` (DeepSeek-V3, GLM-4 MoE: the bias-corrected,
    group-limited choice decides *which* experts; the weights are the plain sigmoids);
    ``normalise``: weights renormalised to sum 1 over the k experts; ``scale``: then times
    this (DeepSeek-V3's ``routed_scaling_factor``).
    """

    kind: str
    normalise: bool
    scale: float = 1.0

    def affinities(self, logits: torch.Tensor) -> torch.Tensor:
        """(N, E) float32 per-expert scores the weights are gathered from."""
        z = logits.float()
        return F.softmax(z, dim=-1) if self.kind == "softmax" else torch.sigmoid(z)

    def weights(self, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """(N, k) float32 gating weights of `indices` (any experts, e.g. replayed ones), differentiable in logits."""
        w = self.affinities(logits).gather(-1, indices.long())
        if self.normalise:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * self.scale

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(N, E) float32 the router's distribution over experts: `log_probs`, exponentiated."""
        a = self.affinities(logits)
        return a if self.kind == "softmax" else a / a.sum(-1, keepdim=True)

    def log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(N, E) float32 log of the router's distribution over experts (rows sum to 1 in prob).

        Softmax: log_softmax(logits). Sigmoid: log(sigmoid(z_e) / sum_j sigmoid(z_j)), the
        normalised affinities DeepSeek-V3's balance loss uses; the selection bias is not in it.
        """
        z = logits.float()
        if self.kind == "softmax":
            return F.log_softmax(z, dim=-1)
        ls = F.logsigmoid(z)
        return ls - ls.logsumexp(-1, keepdim=True)


# Router classes whose routing is not a scoring rule of their logits: named, refused for replay.
UNREPLAYABLE = {
    "PhimoeTopKRouter": "sparsemixer routing (a thresholded softmax per slot, a sampled second expert and a "
                        "straight-through gradient estimator in training)",
}

_SCORING: "weakref.WeakKeyDictionary[nn.Module, Optional[Scoring]]" = weakref.WeakKeyDictionary()


@torch.no_grad()  # a check only: saving tensors here would break checkpoint recomputation
def _detect(router: nn.Module, logits: torch.Tensor, scores: torch.Tensor, indices: torch.Tensor) -> Optional[Scoring]:
    """The `Scoring` that reproduces the router's own weights at its own experts (`_fit`), or None (and None for
    the routers UNREPLAYABLE names, whatever their weights)."""
    if type(router).__name__ in UNREPLAYABLE:
        return None
    return _fit(router, logits, scores, indices)


@torch.no_grad()
def _fit(router: nn.Module, logits: torch.Tensor, scores: torch.Tensor, indices: torch.Tensor) -> Optional[Scoring]:
    """The `Scoring` under which `logits` (N, E) give `scores` (N, k) at `indices` (N, k), or None.

    Tried in the order the router's attributes suggest (``e_score_correction_bias``: sigmoid
    first; ``norm_topk_prob``: the declared normalisation first), so that an output both
    rules explain (k=1 renormalised: all weights 1) is read as the router declares. The
    constant factor (DeepSeek-V3's ``routed_scaling_factor``, HY-V3's ``router_scaling_factor``
    ...) is fitted by least squares, then the fit must hold on every weight.
    """
    kinds = ("sigmoid", "softmax") if hasattr(router, "e_score_correction_bias") else ("softmax", "sigmoid")
    declared = getattr(router, "norm_topk_prob", None)
    norms = (declared, not declared) if isinstance(declared, bool) else (True, False)
    tol = 1e-4 if scores.dtype in (torch.float32, torch.float64) else 2e-2
    target = scores.float()
    for kind in kinds:
        for norm in norms:
            w = Scoring(kind, norm).weights(logits, indices)
            scale = float((w * target).sum() / (w * w).sum().clamp_min(1e-30))
            if scale > 0 and torch.allclose(w * scale, target, atol=tol * max(1.0, scale)):
                return Scoring(kind, norm, _snap(router, scale))
    return None


def _snap(router: nn.Module, scale: float) -> float:
    """The fitted factor, or the router's declared one (or 1) where the fit is that up to rounding."""
    for declared in (getattr(router, "routed_scaling_factor", None), getattr(router, "router_scaling_factor", None), 1.0):
        if isinstance(declared, (int, float)) and declared > 0 and abs(scale / declared - 1) < 1e-4:
            return float(declared)
    return scale


def _scoring(router: nn.Module, logits: torch.Tensor, scores: torch.Tensor, indices: torch.Tensor) -> Optional[Scoring]:
    """The router's rule, detected on its first non-empty call and then remembered."""
    if router not in _SCORING and indices.numel():
        k = indices.shape[-1]
        _SCORING[router] = _detect(router, logits.reshape(-1, logits.shape[-1]), scores.reshape(-1, k),
                                   indices.reshape(-1, k))
    return _SCORING.get(router)


SOFTMAX = Scoring("softmax", False)  # how an unrecognised router's logits are read for log-probs and the aux loss


def _unsupported(router: nn.Module) -> str:
    name = type(router).__name__
    what = UNREPLAYABLE.get(name, "its weights are neither a softmax nor a sigmoid of its logits at its experts")
    return (f"moe.routing_replay: {name} cannot be replayed: {what}; "
            "use moe.routing_replay=none for this model")


def check_routers(model: nn.Module, replay: bool) -> Optional[str]:
    """Whether gspo can handle the model's routing as asked: refuse (ConfigError, one line), or a note.

    A model with expert modules but no router `find_routers` finds, or whose routers return
    a format gspo cannot read, is never taken for a dense one in silence: with `replay` it is
    refused; without, the returned note (to log) says it trains without routing statistics
    or aux loss (None: the routers are usable). With `replay`, a router whose scoring rule
    replay cannot reproduce is refused too. One tiny forward (eval mode, no grad) reads each
    router's output and rule.
    """
    routers = find_routers(model)
    what = None
    if not routers:
        blocks = {n.rpartition(".")[0] for n, m in model.named_modules() if type(m).__name__.lower().endswith("experts")}
        if not blocks:
            return None  # a dense model
        block = model.get_submodule(sorted(blocks)[0])
        gates = sorted({type(c).__name__ for c in block.children()
                        if any(w in type(c).__name__.lower() for w in ("router", "gate"))})
        what = (f"{type(model).__name__}'s experts are routed by {', '.join(gates) or 'no router module'}, which gspo "
                "cannot wrap (it needs a module with top_k, num_experts and weight that returns (logits, scores, indices))")
    else:
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), capture_routing(model, logprobs=False):
                vocab = model.get_input_embeddings().weight.shape[0]
                model(input_ids=torch.arange(8, device=router_weight(routers[0]).device)[None] % vocab, use_cache=False)
        except RouterFormatError as e:
            what = str(e)
        finally:
            model.train(was_training)
    if what is not None:
        if replay:
            raise ConfigError(f"moe.routing_replay: {what}; use moe.routing_replay=none")
        return f"gspo: note: {what}: it trains without routing statistics, replay or load-balancing loss"
    if replay:
        for r in routers:
            if _SCORING.get(r) is None:
                raise ConfigError(_unsupported(r))
    return None


# ----------------------------------------------------------------------------- capture
class RoutingTrace:
    """Routing recorded by :func:`capture_routing`, one entry per router per forward call.

    Calls may differ in N (prefill ``B*P`` rows, then decode steps of ``B*1``); the
    accessors reshape each call to ``(B, N/B, ...)`` and concatenate calls along T.
    """

    def __init__(self, num_layers: int, record_logprobs: bool, device: torch.device | str | None,
                 keep_logits: bool = False, max_calls: int | None = None, spread: Optional[torch.Tensor] = None):
        self._idx: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self._live: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self._lp: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self._logits: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.scorings: list[Scoring] = [SOFTMAX] * num_layers  # per layer, the router's rule once it has run
        self.record_logprobs, self.keep_logits, self.max_calls = record_logprobs, keep_logits, max_calls
        self.device = device
        self.spread = spread  # a packed forward's tokens -> the plain batch's rows (gspo/models/packing.py)

    def _record(self, layer: int, indices: torch.Tensor, logits: torch.Tensor,
                live: Optional[torch.Tensor] = None, scoring: Optional[Scoring] = None) -> None:
        if self.max_calls is not None and len(self._idx[layer]) >= self.max_calls:
            return  # e.g. gradient checkpointing re-running the forward inside backward
        k = indices.shape[-1]
        self.scorings[layer] = scoring or SOFTMAX
        if self.spread is not None:  # recorded as the plain forward's (N*W) rows would have been
            at = self.spread.to(indices.device)
            indices, logits = indices.reshape(-1, k)[at], logits.reshape(-1, logits.shape[-1])[at]
            live = None if live is None else live.reshape(-1, k)[at]
        self._idx[layer].append(indices.detach().reshape(-1, k).to(self.device, torch.long))
        self._live[layer].append(self._idx[layer][-1] if live is None else
                                 live.detach().reshape(-1, k).to(self.device, torch.long))
        if self.record_logprobs:
            lp = self.scorings[layer].log_probs(logits.detach().reshape(-1, logits.shape[-1]))
            self._lp[layer].append(lp.to(self.device))
        if self.keep_logits:  # with their graph: the load-balancing loss backpropagates into the routers
            self._logits[layer].append(logits.reshape(-1, logits.shape[-1]))

    def logits(self, call: int = 0) -> list[torch.Tensor]:
        """Per layer, the live router logits (N, E) of forward call `call`, with grad (needs keep_logits)."""
        if not self.keep_logits:
            raise RuntimeError("trace was captured with keep_logits=False")
        return [calls[call] for calls in self._logits]

    def live(self, call: int = 0) -> list[torch.Tensor]:
        """Per layer, the experts (N, k) the router itself picked in forward call `call` (under replay too)."""
        return [calls[call] for calls in self._live]

    @property
    def num_layers(self) -> int:
        return len(self._idx)

    @property
    def num_calls(self) -> int:
        """Number of complete forward calls recorded."""
        counts = {len(calls) for calls in self._idx}
        if len(counts) > 1:  # a crashed forward, or checkpoint recomputation inside the context
            raise RuntimeError(f"routers recorded unequal numbers of calls: {sorted(counts)}")
        return counts.pop() if counts else 0

    def clear(self) -> None:
        for calls in (*self._idx, *self._live, *self._lp, *self._logits):
            calls.clear()

    def _assemble(self, per_layer: list[list[torch.Tensor]], batch_size: int,
                  length: int | None, pad: float) -> torch.Tensor:
        chunks = []
        for c in range(self.num_calls):
            rows = torch.stack([calls[c] for calls in per_layer], dim=1)  # (N, L, *)
            if rows.shape[0] % batch_size:
                raise ValueError(f"call {c} routed {rows.shape[0]} rows, not a multiple of B={batch_size}")
            chunks.append(rows.view(batch_size, -1, *rows.shape[1:]))
        if not chunks:
            raise RuntimeError("no forward pass was recorded")
        out = torch.cat(chunks, dim=1)
        if length is not None:
            if length < out.shape[1]:
                raise ValueError(f"length={length} is shorter than the {out.shape[1]} recorded positions")
            out = F.pad(out.movedim(1, -1), (0, length - out.shape[1]), value=pad).movedim(-1, 1)
        return out

    def indices(self, batch_size: int, length: int | None = None) -> torch.Tensor:
        """(B, T, L, k) expert indices the experts used; positions past T padded with -1 up to length."""
        return self._assemble(self._idx, batch_size, length, -1)

    def logprobs(self, batch_size: int, length: int | None = None) -> torch.Tensor:
        """(B, T, L, E) float32 log-probs of the live routers' distributions (`Scoring.log_probs`); padding is 0."""
        if not self.record_logprobs:
            raise RuntimeError("trace was captured with logprobs=False")
        return self._assemble(self._lp, batch_size, length, 0.0)

    def live_indices(self, batch_size: int, length: int | None = None) -> torch.Tensor:
        """(B, T, L, k) the experts each router itself picked (its own rule: group limits, biases ...).

        Equals :meth:`indices` without replay; under replay it is the live routing needed
        for ``moe/routing_volatility``, while :meth:`indices` is the replayed one.
        """
        return self._assemble(self._live, batch_size, length, -1)

    def batch(self, batch_size: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices (B, T, L, k), logprobs (B, T, L, E))."""
        return self.indices(batch_size, length), self.logprobs(batch_size, length)


@contextlib.contextmanager
def capture_routing(model: nn.Module, logprobs: bool = True, device: torch.device | str | None = None,
                    keep_logits: bool = False, max_calls: int | None = None,
                    spread: Optional[torch.Tensor] = None) -> Iterator[RoutingTrace]:
    """Record every router's routing for all forward passes run inside the context.

    ``logprobs=False`` skips the (N, E) log-probs (they dominate memory on wide MoEs);
    ``device="cpu"`` offloads the records; ``keep_logits`` keeps the live logits with their
    graph (for a loss on them). ``max_calls`` stops recording after that many forward calls,
    so gradient-checkpoint recomputation during a backward inside the context is not
    recorded; without it, run backward outside the context. ``spread`` (a packed forward's
    `Packing.spread`): each call's routing recorded as the plain (N, W) batch's rows.
    """
    routers = find_routers(model)
    trace = RoutingTrace(len(routers), logprobs, device, keep_logits, max_calls, spread)

    def make_hook(layer: int):
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            logits, scores, indices = _unpack(output, module)
            live = _LIVE.pop(module, None)  # set by a replay hook that ran before this one (and read the rule)
            trace._record(layer, indices, logits, live, _scoring(module, logits, scores, indices))
        return hook

    handles = [r.register_forward_hook(make_hook(l)) for l, r in enumerate(routers)]
    try:
        yield trace
    finally:
        for h in handles:
            h.remove()


# ----------------------------------------------------------------------------- replay
# router -> the experts it picked itself in the call a replay hook just rewrote (read by capture)
_LIVE: "weakref.WeakKeyDictionary[nn.Module, torch.Tensor]" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def replay_routing(model: nn.Module, indices: torch.Tensor, source: Optional[torch.Tensor] = None) -> Iterator[None]:
    """Force each router's experts to ``indices`` (B, T, L, k) for forward passes inside.

    The forward done inside must route exactly ``B*T`` rows per router (same (B, T) as
    ``indices``); it may run several times. With gradient checkpointing, run backward
    inside the context too: the recomputed forward must see the same forced experts.
    Rows whose k entries contain a -1 keep the live routing. Forced experts get live
    weights, the router's own `Scoring` of its live logits at the forced experts (softmax
    or sigmoid, renormalised and scaled as the router does), so the router weight still
    gets gradient; the live logits are returned unchanged, so ``output_router_logits`` and
    the aux loss still work (the aux loss balances the live, not the forced routing). A
    router whose rule is not recognised is refused (a ConfigError naming its class). ``source`` (a
    packed forward's `Packing.source`): the packed tokens replay the plain rows they hold.
    """
    routers = find_routers(model)
    if indices.dim() != 4 or indices.shape[2] != len(routers):
        raise ValueError(f"indices must be (B, T, L={len(routers)}, k), got {tuple(indices.shape)}")
    if indices.dtype.is_floating_point or indices.dtype == torch.bool:
        raise TypeError(f"indices must be an integer tensor, got {indices.dtype}")
    B, T, _, k = indices.shape
    for r in routers:
        if r.top_k != k:
            raise ValueError(f"indices have k={k} but a router has top_k={r.top_k}")
    if indices.numel() and int(indices.max()) >= min(r.num_experts for r in routers):
        raise ValueError("indices contain an expert id >= num_experts")
    # (B, T, L, k) -> per layer (B*T, k), row-major like the MoE block's view(-1, H).
    forced = [indices[:, :, l, :].reshape(B * T, k) for l in range(len(routers))]
    if source is not None:
        forced = [f[source.to(f.device)] for f in forced]
    rows = forced[0].shape[0] if forced else B * T

    def make_hook(layer: int):
        def hook(module: nn.Module, args: tuple, output: object) -> tuple:
            logits, scores, live = _unpack(output, module)
            shape = live.shape
            live = live.reshape(-1, k)
            if live.shape[0] != rows:
                raise ValueError(f"replay_routing got {live.shape[0]} rows at router {layer}, "
                                 f"expected {rows} from the replayed indices")
            if not live.shape[0]:
                return output
            scoring = _scoring(module, logits, scores, live)
            if scoring is None:
                raise ConfigError(_unsupported(module))
            _LIVE[module] = live.reshape(shape)
            want = forced[layer].to(live.device)
            keep_live = (want < 0).any(-1, keepdim=True)
            idx = torch.where(keep_live, live, want.to(live.dtype))
            # The router's own weights of the forced experts: the gradient path to the router.
            w = scoring.weights(logits.reshape(-1, logits.shape[-1]), idx)
            w = torch.where(keep_live, scores.reshape(-1, k), w.to(scores.dtype))
            return _pack(output, module, logits, w.reshape(scores.shape), idx.reshape(shape))
        return hook

    # prepend: run before capture hooks (and HF's own output recorders) on the same router.
    handles = [r.register_forward_hook(make_hook(l), prepend=True) for l, r in enumerate(routers)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for r in routers:
            _LIVE.pop(r, None)


# ----------------------------------------------------------------------------- statistics
def _valid_rows(idx: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T, L) bool: token in mask and a full routing recorded (no -1) for that layer."""
    return mask.bool()[..., None] & (idx >= 0).all(-1)


@torch.no_grad()
def routing_volatility(old_idx: torch.Tensor, new_idx: torch.Tensor,
                       mask: torch.Tensor) -> tuple[float, list[float]]:
    """Fraction of old (token, layer, slot) expert choices absent from the new top-k set.

    old_idx, new_idx: (B, T, L, k); mask: (B, T). Compared as sets per token and layer
    (slot order does not matter). Returns (overall, per-layer); 0 where nothing is valid.
    """
    valid = (_valid_rows(old_idx, mask) & _valid_rows(new_idx, mask)).float()  # (B, T, L)
    moved = ~(old_idx[..., :, None] == new_idx[..., None, :]).any(-1)  # (B, T, L, k)
    changed = (moved.float().sum(-1) * valid).flatten(0, 1).sum(0)  # (L,)
    slots = valid.flatten(0, 1).sum(0) * old_idx.shape[-1]  # (L,)
    per_layer = (changed / slots.clamp_min(1)).tolist()
    return float(changed.sum() / slots.sum().clamp_min(1)), per_layer


@torch.no_grad()
def router_shift(old_logprobs: torch.Tensor, new_logprobs: torch.Tensor, old_idx: torch.Tensor,
                 mask: torch.Tensor) -> tuple[torch.Tensor, float]:
    """RSPO-style router-shift factor per token, and its masked mean (1 = no shift).

    Per token: geometric mean over layers of mean_{e in old top-k} exp(-|log p_new(e) -
    log p_old(e)|). Log-probs (B, T, L, E), old_idx (B, T, L, k), mask (B, T). Layers
    without recorded routing (-1) are left out; masked-out tokens get 1.
    """
    valid = _valid_rows(old_idx, mask)  # (B, T, L)
    at = old_idx.clamp_min(0)
    gap = (new_logprobs.float().gather(-1, at) - old_logprobs.float().gather(-1, at)).abs()
    log_layer = torch.exp(-gap).mean(-1).log()  # (B, T, L)
    n_layers = valid.sum(-1)
    log_tok = torch.where(valid, log_layer, 0.0).sum(-1) / n_layers.clamp_min(1)
    per_token = torch.where(n_layers > 0, log_tok.exp(), 1.0)
    counted = n_layers > 0
    mean = float(per_token[counted].mean()) if counted.any() else 1.0
    return per_token, mean


@torch.no_grad()
def expert_load(idx: torch.Tensor, mask: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(L, E) share of routed (token, slot) pairs per expert per layer; rows sum to 1 (or 0 if empty)."""
    valid = _valid_rows(idx, mask)  # (B, T, L)
    L = idx.shape[2]
    flat = idx.clamp_min(0).movedim(2, 0).reshape(L, -1)  # (L, B*T*k)
    weight = valid.movedim(2, 0).reshape(L, -1, 1).expand(-1, -1, idx.shape[-1]).reshape(L, -1)
    counts = torch.zeros(L, num_experts, device=idx.device).scatter_add_(1, flat, weight.float())
    return counts / counts.sum(-1, keepdim=True).clamp_min(1)


@torch.no_grad()
def moe_metrics(old_idx: torch.Tensor, new_idx: torch.Tensor, old_logprobs: Optional[torch.Tensor],
                new_logprobs: torch.Tensor, mask: torch.Tensor, num_experts: int) -> dict[str, float]:
    """Routing diagnostics between the old (rollout) and new (updated) policy on the same tokens.

    new_idx must be the *live* routing of the new policy (under replay use
    ``RoutingTrace.live_indices``, else volatility is 0 by construction). Expert load is
    measured on new_idx. ``moe/router_shift`` needs the old router log-probs (None: left out).
    """
    vol, vol_layers = routing_volatility(old_idx, new_idx, mask)
    load = expert_load(new_idx, mask, num_experts)  # (L, E)
    # Normalised entropy: 1 = perfectly balanced, 0 = one expert takes everything.
    entropy = -torch.xlogy(load, load).sum(-1) / math.log(num_experts) if num_experts > 1 \
        else torch.ones(load.shape[0])
    out = {"moe/routing_volatility": vol,
           "moe/expert_load_max": float(load.max()) if load.numel() else 0.0,
           "moe/expert_load_entropy": float(entropy.mean()) if load.numel() else 0.0}
    if old_logprobs is not None:
        out["moe/router_shift"] = router_shift(old_logprobs, new_logprobs, old_idx, mask)[1]
    out.update({f"moe/routing_volatility/layer_{i}": v for i, v in enumerate(vol_layers)})
    for i, row in enumerate(load.tolist()):
        out.update({f"moe/expert_load/layer_{i}/expert_{j}": v for j, v in enumerate(row)})
    return out


def load_balancing_loss(logits: list[torch.Tensor], top_k: int, mask: torch.Tensor,
                        all_sum: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
                        scorings: Optional[list[Scoring]] = None,
                        chosen: Optional[list[torch.Tensor]] = None) -> torch.Tensor:
    """Switch-Transformer load-balancing loss (arXiv 2101.03961 eqs. 4-6), as Hugging Face computes it.

    logits: per MoE layer the live router logits (N, E), N = B*T rows; mask (B, T) 1 on real
    tokens. With f_e the share of (token, layer, slot) assignments to expert e and P_e the mean
    router probability of e over (token, layer): loss = E * sum_e f_e P_e.

    The probabilities are each router's distribution (`scorings`, default softmax: for a
    sigmoid router its normalised affinities, as in DeepSeek-V3's sequence-wise balance
    loss), and the assignments `chosen` (N, k) per layer are the experts each router picked
    itself (default: the top-k of those probabilities, which is the pick of a softmax router).

    f_e and P_e are means over the whole batch, so a rank cannot compute its part of them
    alone. `all_sum` sums a tensor over ranks (identity in one process): the counts (no
    gradient) are summed, and each rank returns E * sum_e f_e (its own probability sum) /
    (global rows), the sum over ranks of which is the one-process loss.
    """
    E = logits[0].shape[-1]
    m = mask.reshape(-1).to(torch.float32)
    counts = torch.zeros(E, dtype=torch.float32, device=logits[0].device)
    prob_sum = torch.zeros(E, dtype=torch.float32, device=logits[0].device)
    for l, layer in enumerate(logits):
        p = (scorings[l] if scorings else SOFTMAX).probs(layer)
        picked = chosen[l] if chosen is not None else p.topk(top_k, dim=-1).indices
        counts = counts.scatter_add(0, picked.reshape(-1).to(counts.device), m.repeat_interleave(top_k))
        prob_sum = prob_sum + (p * m[:, None]).sum(0)
    totals = all_sum(torch.cat([counts, (m.sum() * len(logits))[None]]).detach())
    rows = totals[-1].clamp_min(1.0)
    return E * (totals[:-1] / rows * prob_sum / rows).sum()
