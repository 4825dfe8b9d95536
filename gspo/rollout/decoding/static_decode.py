"""The fast engine's decode as a replay (`rollout.decode`): a static KV cache, and each decode step captured once
as a CUDA graph and replayed for every token.

On a GPU at gspo's sizes a decode step is launch-bound: fast_decode's step issues some sixty small kernels a
layer, one after another from Python (docs/benchmarks.md: about 39 ms a step on an H200 for the Qwen3-0.6B-shaped
model at 128 rows). Here the same step, fast_decode's arithmetic module for module (this decoder is a
`FastDecoder` that changes only where keys and values go and how the routers are called), runs on buffers that
never move, so it can be recorded once and replayed:

  * the cache: one key and one value tensor of [layers, rows, KV heads, S, head_dim], S the rollout's prompt and
    completion columns rounded up to a multiple of SLOTS. The prefill (the model's own forward, as under every
    engine) is copied into slots [0, P) and the rest zeroed; each step writes its key and value in place at its
    slot (`index_copy_` at a slot held in a tensor), and attention reads all S slots under a mask of the filled
    ones (`keep`, (rows, S) bool: the prompt's mask, each step's slot set as it is written);
  * the step's inputs are static buffers the host fills before each replay: the token fed (rows, 1), its
    position (rows, 1), its slot (1,), and the step's uniforms (rows,);
  * the graph holds the forward AND the draw (gspo/rollout/decoding/generate.py's `_draw`: the tokens, their log-probs,
    the nucleus's kept mass, the top-k, a non-finite flag), its outputs static tensors the sampler copies from;
    what the host does per token is what it does for every engine (padding after a stop, the rows done, the
    records at column t), plus four tiny copies;
  * the noise: generate() draws every row's uniforms for the whole rollout before the first token, from the
    rows' keyed generators (gspo/rollout/decoding/seeds.py), on the device. Each step's column is copied into the static
    uniforms before the replay; no generator is called inside the graph, so the graph draws the numbers the
    eager step draws, from the same seeds;
  * MoE routing capture (Routing Replay R3): the routers are called without their forward hooks (the only hooks
    this decode admits are those of the sampler's own capture, registered after `resolve` looked), their outputs
    are static tensors, and after each step the record the capture hook would have made is made from them. Hooks
    of any other kind on a router (a replay while sampling) fall back to `eager`, which calls the routers as
    modules.

`static` runs these buffers and calls op by op on any device (how the CPU tests check this decode against the
`fast` engine and `hf`); `graph` records them on CUDA (`torch.cuda.CUDAGraph`) at a rollout's first decode step,
after WARMUP eager runs on a side stream, and replays them: the same kernels on the same buffers, so graph and
static give the same bits (tests/rollout/decoding/test_fast_decode.py checks it on a GPU). A step is idempotent (the
same inputs write the same slot), so the warm-up and the capture can run at the first real step.

The graph reads the model's weights where they are: an update in place (the optimizer's step, a sampler copy's
re-sync) is seen by the next replay. Graphs are kept for the next rollout of the same shape (MAX_DECODERS, the
least recently used dropped, each holding its cache and its graph's memory; `static` allocates its cache per
rollout, as the eager engine does), keyed by the model, the rows, S, the cache's dtype and device, the sampling
settings the draw reads, and a signature of every parameter's and buffer's storage and the LoRA layers' state: a
replaced weight, a moved model or an adapter switched off (peft's disable_adapter) records a new graph. A capture
that fails (a kernel that syncs with the host, in some transformers version) is said once; that rollout goes on op
by op and later ones with `eager`.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
import weakref
from collections import OrderedDict
from typing import Callable, Optional

import torch

from gspo.models import moe
from gspo.rollout.decoding import fast_decode

DECODES = ("auto", "eager", "static", "graph")
SLOTS = 64  # the cache's columns are a multiple of this: rollouts whose prompts differ a little share a graph
MAX_DECODERS = 2  # decoders kept between rollouts (the training batch's and the evaluation's shapes, say)
WARMUP = 2  # eager runs of the step on a side stream before its capture (cuBLAS handles, the allocator)
_LOGGED: set[str] = set()
_FAILED: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()  # model -> failed capture
_DECODERS: "OrderedDict[tuple, StaticDecoder]" = OrderedDict()


def _on(device: torch.device):
    """`device` made the current CUDA device for the block (a CPU one: nothing; tests stand a graph in there)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _base(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if hasattr(model, "peft_config") else model


def unsupported(model: torch.nn.Module, graph: bool) -> Optional[str]:
    """Why the static decode (`graph`: and its capture) cannot run `model`, which the fast engine serves (None: it
    can). Asked before the sampler registers its own routing hooks."""
    base = _base(model)
    routers = {id(r) for r in moe.find_routers(base)}
    hooked = next((n for n, m in base.named_modules() if id(m) in routers
                   and (m._forward_hooks or m._forward_pre_hooks)), None)
    if hooked is not None:
        return f"forward hooks on the router {hooked} (a routing replay while sampling): the static decode calls " \
               "the routers without their hooks"
    rope = getattr(base.model.rotary_emb, "rope_type", "default")
    if "dynamic" in str(rope):
        return f"{rope} RoPE (its frequencies follow the longest position, a host-side decision every step)"
    if not graph:
        return None
    device = next(base.parameters()).device
    if device.type != "cuda":
        return f"no CUDA device (the model is on {device.type}): graphs are captured on CUDA only"
    active = next((n or "the model" for n, m in base.named_modules()
                   if isinstance(m, torch.nn.Dropout) and m.p > 0 and m.training), None)
    if active is not None:
        return f"dropout active at {active} (the model is in training mode): a graph would replay its draws"
    return _FAILED.get(base)


def resolve(decode: str, model: torch.nn.Module) -> str:
    """How the fast engine decodes `model`: `eager` (fast_decode's own cache), `static` or `graph`.

    `auto` (the default): `graph` on CUDA where the model is supported, quietly `eager` elsewhere (the CPU's
    decode unchanged); `static` and `graph` asked by name fall back to `eager` with a warning, once per reason.
    """
    if decode not in DECODES:
        raise ValueError(f"rollout.decode={decode!r}: expected one of {', '.join(DECODES)}")
    if decode == "eager":
        return "eager"
    if decode == "auto" and next(_base(model).parameters()).device.type != "cuda":
        return "eager"
    why = unsupported(model, graph=decode != "static")
    if why is None:
        return "static" if decode == "static" else "graph"
    if decode != "auto" and why not in _LOGGED:
        _LOGGED.add(why)
        warnings.warn(f"rollout.decode={decode}: decoding eagerly: {why}", stacklevel=2)
    return "eager"


def _signature(model: torch.nn.Module) -> tuple:
    """What a captured graph holds of the model besides its weights' values: every parameter's and buffer's
    storage, dtype and shape, each LoRA layer's switches and scaling, the attention and experts implementations."""
    tensors = tuple((t.data_ptr(), t.dtype, tuple(t.shape))
                    for t in itertools.chain(model.parameters(), model.buffers()))
    lora = tuple((m.disable_adapters, m.merged, tuple(m.active_adapters), tuple(sorted(m.scaling.items())))
                 for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "scaling"))
    cfg = model.config
    return tensors, lora, cfg._attn_implementation, getattr(cfg, "_experts_implementation", None)


def decoder(model: torch.nn.Module, prefill_cache, length: int, mode: str, draw: Callable, settings: tuple,
            matmul: str = "aten") -> "StaticDecoder":
    """The static decoder for a rollout of `length` columns after this prefill: under `graph` a kept one of the same
    key, or a new one (kept); under `static` a new one, dropped with the rollout as the eager engine's cache is.
    `draw(logits, u)` is the sampler's draw (generate.py's `_draw` with its settings); `settings` the values it
    reads (a new graph for others)."""
    base = _base(model)
    k0 = prefill_cache.layers[0].keys
    rows, slots = k0.shape[0], -(-length // SLOTS) * SLOTS
    if mode != "graph":
        return StaticDecoder(model, rows, slots, k0, draw, False, matmul)
    where = (id(base), rows, slots, k0.dtype, str(k0.device), k0.shape[1], k0.shape[3], settings, matmul,
             torch.is_inference_mode_enabled())  # buffers made under inference mode cannot be written outside it
    key = (*where, _signature(base))
    found = _DECODERS.get(key)
    if found is None:
        for stale in [k for k in _DECODERS if k[: len(where)] == where]:  # the same shape on weights no longer there
            del _DECODERS[stale]
        found = _DECODERS[key] = StaticDecoder(model, rows, slots, k0, draw, mode == "graph", matmul)
        while len(_DECODERS) > MAX_DECODERS:
            _DECODERS.popitem(last=False)
    _DECODERS.move_to_end(key)
    return found


def release() -> None:
    """Drop every kept decoder (their caches and graphs' memory go back to the allocator)."""
    _DECODERS.clear()


class StaticDecoder(fast_decode.FastDecoder):
    """Decode steps on a static cache of `rows` x `slots`, op by op or (`graph`) as one CUDA graph per step.

    Per rollout: `begin` (the prefill's cache and the prompts' mask and positions), then `step` per token, which
    returns the draw's outputs for the token after the one fed."""

    def __init__(self, model: torch.nn.Module, rows: int, slots: int, like: torch.Tensor, draw: Callable,
                 graph: bool, matmul: str = "aten"):
        self._bind(model)
        _, heads, _, dim = like.shape
        self.k = torch.zeros((len(self.layers), rows, heads, slots, dim), dtype=like.dtype, device=like.device)
        self.v = torch.zeros_like(self.k)
        self.keys, self.values = list(self.k.unbind(0)), list(self.v.unbind(0))
        longs = dict(dtype=torch.long, device=like.device)
        self.tok, self.pos, self.slot = torch.zeros((rows, 1), **longs), torch.zeros((rows, 1), **longs), \
            torch.zeros(1, **longs)
        self.keep = torch.zeros((rows, slots), dtype=torch.bool, device=like.device)
        self.u = torch.zeros(rows, dtype=torch.float32, device=like.device)
        self.draw, self.graphed, self.matmul = draw, graph, matmul
        self.routers = {id(r): (layer, r) for layer, r in enumerate(moe.find_routers(self.model))}  # trace numbering
        self.routed: dict[int, tuple] = {}  # trace layer -> (router, its outputs at the last step)
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.out: Optional[tuple] = None
        self.trace = None

    def begin(self, prefill_cache, mask: torch.Tensor, pos: torch.Tensor, trace=None) -> None:
        """A rollout's start: the prefill's keys and values in slots [0, P), the rest zeroed (a kept cache holds
        the last rollout's), the prompts' mask (N, P), their positions (N, P), the routing trace (None: none)."""
        p = mask.shape[1]
        for i, layer in enumerate(prefill_cache.layers):
            self.k[i, :, :, :p].copy_(layer.keys)
            self.v[i, :, :, :p].copy_(layer.values)
        self.k[:, :, :, p:].zero_()
        self.v[:, :, :, p:].zero_()
        self.keep.zero_()
        self.keep[:, :p].copy_(mask.bool())
        self.pos.copy_(pos[:, -1:])
        self.slot.fill_(p - 1)
        self.trace = trace
        self._pack(self.matmul, self.k.shape[1])  # oneDNN's copies (CPU) are made per rollout: never stale

    def step(self, nxt: torch.Tensor, u: Optional[torch.Tensor]) -> tuple:
        """Feed the tokens just drawn, `nxt` (N,), with the next position's uniforms `u` (N,) (None when greedy):
        the draw's outputs (static tensors under `graph`: read before the next step)."""
        self.tok.copy_(nxt[:, None])
        if u is not None:
            self.u.copy_(u)
        self.pos.add_(1)
        self.slot.add_(1)
        out = self._replay() if self.graphed else self._run()
        if self.trace is not None:
            self._record()
        return out

    def _run(self) -> tuple:
        """The step (what the graph records): the new slot unmasked, the logits, the draw."""
        self.keep.index_fill_(1, self.slot, True)
        logits = self._logits(self.tok, self.pos, self.slot, self.keep[:, None, None, :]).float()
        return self.draw(logits, self.u)

    def _replay(self) -> tuple:
        if self.graph is None:
            try:
                with _on(self.k.device):  # the cache's GPU, whichever is current
                    self._capture()
            except Exception as e:  # noqa: BLE001  (said once; this rollout goes on op by op, later ones eager)
                why = f"capturing the decode step failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
                _FAILED[_base(self.model)] = why
                self.graphed = False
                for key in [k for k, d in _DECODERS.items() if d is self]:
                    del _DECODERS[key]
                if why not in _LOGGED:
                    _LOGGED.add(why)
                    warnings.warn(f"rollout.decode: decoding eagerly: {why}", stacklevel=3)
                return self._run()
        with _on(self.k.device):
            self.graph.replay()
        return self.out

    def _capture(self) -> None:
        """WARMUP eager runs on a side stream, then the step recorded (its outputs kept as the static outputs)."""
        device = self.k.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                self._run()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = self._run()
        self.graph, self.out = graph, out

    def _store(self, i: int, k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's key and value written in place at `slot` (a tensor: no host value); attention reads every slot."""
        self.keys[i].index_copy_(2, slot, k)
        self.values[i].index_copy_(2, slot, v)
        return self.keys[i], self.values[i]

    def _route(self, i: int, gate: torch.nn.Module, flat: torch.Tensor) -> tuple:
        """The router's forward without its hooks (`unsupported` admits only the sampler's capture, whose record
        `_record` makes); its outputs kept for that record."""
        out = gate.forward(flat)
        layer, router = self.routers[id(gate)]
        self.routed[layer] = (router, out)
        return out

    def _record(self) -> None:
        """What the sampler's capture hook (gspo/models/moe.py `capture_routing`) records of each router's call, made
        from the step's router outputs (copied: under `graph` the next replay overwrites them)."""
        for layer, (router, out) in self.routed.items():
            logits, scores, idx = moe._unpack(out, router)
            self.trace._record(layer, idx.clone(), logits, None, moe._scoring(router, logits, scores, idx))
