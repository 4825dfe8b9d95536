"""The `fast` decode engine (`rollout.engine`): decode steps of the Llama-shaped families without the generic forward.

One engine for Qwen3, Qwen3-MoE, Llama, Qwen2/Qwen2.5, Mistral, Mixtral and Qwen2-MoE: the same decoder layer
(RMSNorm, q/k/v projections, RoPE, GQA attention, gated MLP or sparse MoE), the families differing only
in what each module holds, read off it: q/k norms (Qwen3), projection biases (Qwen2's q/k/v, Qwen2-MoE's
where `qkv_bias`; Llama's `attention_bias`, `mlp_bias`), the MoE block (Qwen3-MoE, Mixtral, Qwen2-MoE: a `gate`
router and fused `experts`; Qwen2-MoE's also a shared expert, a gated MLP every token runs, scaled by
sigmoid(`shared_expert_gate`(x))), which layers are MoE (each layer's own module: Qwen3-MoE's and Qwen2-MoE's
`mlp_only_layers` and `decoder_sparse_step` leave dense MLPs between them), the RoPE variant (Llama 3's
`rope_scaling`, any `rope_type`: the model's own rotary module computes cos/sin), tied embeddings (the head is the
`lm_head` module's weight, whichever tensor that is). Llama's `pretraining_tp` changes nothing: the
model's forward no longer reads it.

At the sizes gspo's sweeps run, a Hugging Face decode step carries per-operator overhead around
the arithmetic (docs/benchmarks.md): building the attention mask, growing the `DynamicCache` by
concatenation, the output recorders and keyword plumbing of every module, and (MoE, `eager`
experts) a Python loop over the experts hit, with a host sync each. This engine runs the same
arithmetic without them:

  * the prefill is the model's own forward (one call): its KV cache is copied once into a
    preallocated cache, one key and one value tensor per layer, then written in place;
  * each decode step is one call per layer on the weights of the model's own modules, read
    afresh every step (no copy, no sync: a training update is seen by the next rollout);
  * the MoE's router is the model's router module, called as a module, so routing capture
    and replay hooks (gspo/models/moe.py) see and rewrite exactly what they do under `hf`; the
    experts run batched: through the experts module itself where its `experts_implementation`
    is a batched kernel (`grouped_mm`, transformers' default, or `batched_mm`), else (`eager`)
    as every expert on every row in two matmuls, the chosen pairs then picked (no loop, no sync);
  * attention goes through the model's configured attention function (`sdpa` or `eager`),
    with the same RoPE module, q/k norms and GQA handling.

On CUDA its steps run, by default, on a static KV cache and as one CUDA graph replayed per token
(`rollout.decode`, gspo/rollout/decoding/static_decode.py: a `FastDecoder` that changes only where keys and values go
and how the routers are called); elsewhere as described here.

It samples what the `hf` engine samples, given the same uniforms (tests/rollout/decoding/test_fast_decode.py:
identical tokens, log-probs within 1e-5, identical captured routing). `rollout.matmul=onednn` runs the decode
steps' Linear products through oneDNN on copies of their weights reordered for the rollout's row count, made at its
start and dropped at its end (a training update between rollouts is seen by the next one): on a CPU's thin decode
products oneDNN's kernels beat F.linear's (docs/benchmarks.md), at the price of one more copy of those weights while
sampling; the draws are hf's up to float32 rounding. A peft LoRA policy decodes
here too, its adapters computed unmerged as peft computes them (plain LoRA on the Linear projections and
the LM head). Anything else falls back to `hf`, a warning saying why (once per reason): another family,
adapters other than plain LoRA on Linear layers (the MoE experts' fused weights, DoRA), FSDP sharding, any other wrapper, `hardware.compile`, a sliding window that can bind (Mistral's and Mixtral's
`sliding_window`, Qwen2/Qwen3/Qwen2-MoE's `use_sliding_window`: one shorter than the model's
`max_position_embeddings`; the engine attends over every cached slot), an attention
implementation other than sdpa/eager, forward hooks on modules other than the routers.
"""

from __future__ import annotations

import sys
import warnings
from typing import Optional

import torch
import torch.nn.functional as F

from gspo.models import moe

ENGINES = ("hf", "fast", "auto")
MATMULS = ("aten", "onednn")
_LOGGED: set[str] = set()


def _families() -> tuple[type, ...]:
    from transformers import (LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM,
                              Qwen2MoeForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM)

    return (Qwen3ForCausalLM, Qwen3MoeForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM,
            MixtralForCausalLM, Qwen2MoeForCausalLM)


def _sliding_window(cfg) -> Optional[int]:
    """The window of the model's sliding-window layers, or None where none has one. Mistral applies
    `sliding_window` on every layer when set; Qwen2/Qwen3 only on the layers `layer_types` names (their
    config clears `sliding_window` unless `use_sliding_window`); Llama has none."""
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    return window if window is not None and (types is None or "sliding_attention" in types) else None


def unsupported(model: torch.nn.Module, compile: bool = False) -> Optional[str]:
    """Why the fast engine cannot decode `model` (None: it can)."""
    if compile:
        return "hardware.compile decodes through torch.compile's static cache (the hf engine)"
    name = type(model).__name__
    if name.startswith("FSDP"):  # fully_shard swaps the class in place
        return "FSDP-sharded weights (hardware.strategy=fsdp)"
    if hasattr(model, "peft_config"):
        why = _unsupported_adapters(model)
        if why is not None:
            return why
        model = model.get_base_model()
        name = type(model).__name__
    families = _families()
    if type(model) not in families:  # exact classes: any other wrapper or subclass is refused
        return f"{name} is not a supported family ({', '.join(f.__name__ for f in families)})"
    cfg = model.config
    if cfg._attn_implementation not in ("sdpa", "eager"):
        return f"attention implementation {cfg._attn_implementation!r} (supported: sdpa, eager)"
    window = _sliding_window(cfg)
    # a window at least as long as the model's positions hides no key within them: there hf's mask is the engine's
    if window is not None and window < cfg.max_position_embeddings:
        return (f"sliding-window attention (a window of {window} positions, shorter than the model's "
                f"{cfg.max_position_embeddings}: the engine attends over every cached position)")
    if getattr(cfg, "final_logit_softcapping", None):
        return "final logit soft-capping"
    routers = {id(r) for r in moe.find_routers(model)}  # called as modules: their hooks (capture, replay) run
    hooked = next((n or "the model" for n, m in model.named_modules()
                   if (m._forward_hooks or m._forward_pre_hooks) and id(m) not in routers), None)
    if hooked is not None:
        return f"forward hooks on {hooked}, which the decode steps would bypass"
    return None


def _unsupported_adapters(model: torch.nn.Module) -> Optional[str]:
    """Why the engine cannot compute a peft model's adapters (None: every adapted module is a plain LoRA `Linear`
    on an `nn.Linear`, which `_linear` computes as peft does: the attention and MLP projections, the LM head)."""
    from peft.tuners.lora import Linear as LoraLinear

    for name, module in model.get_base_model().named_modules():
        kind = type(module)
        if not kind.__module__.startswith("peft."):
            continue
        if kind is not LoraLinear or not isinstance(module.get_base_layer(), torch.nn.Linear):
            return (f"a peft {kind.__name__} on {name} (the engine computes LoRA on Linear projections only; "
                    "model.lora.target_parameters reaches the MoE experts' fused weights)")
        if module.lora_variant:  # DoRA and the other variants compute more than B A x
            return f"a LoRA variant ({', '.join(type(v).__name__ for v in module.lora_variant.values())}) on {name}"
    return None


def resolve(engine: str, model: torch.nn.Module, compile: bool = False) -> str:
    """`hf` or `fast` for this model: `fast`/`auto` fall back to `hf` where unsupported (`fast`: a warning, once per reason).

    `auto` (the default) picks `fast` wherever it is supported: its equality tests against `hf` pass
    for every family it serves (tests/rollout/decoding/test_fast_decode.py), and it was faster on every CPU benchmark
    (docs/benchmarks.md, measured on Qwen3 and Qwen3-MoE).
    """
    if engine == "vllm":  # the trainer's own model decodes (evaluation): gspo's engines, as `auto` picks them
        engine = "auto"
    if engine not in ENGINES:
        raise ValueError(f"rollout.engine={engine!r}: expected one of {', '.join(ENGINES)}")
    if engine == "hf":
        return "hf"
    why = unsupported(model, compile)
    if why is None:
        return "fast"
    if engine == "fast" and why not in _LOGGED:  # asked for by name: say why not; `auto` (the default) falls back quietly
        _LOGGED.add(why)
        warnings.warn(f"rollout.engine={engine}: sampling with the hf engine: {why}", stacklevel=2)
    return "hf"


def _onednn_unsupported(model: torch.nn.Module) -> Optional[str]:
    """Why oneDNN cannot run `model`'s decode products (None: it can): float32 weights on the CPU only."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (torch.backends.mkldnn)"
    w = model.get_output_embeddings().weight
    if w.device.type != "cpu" or w.dtype != torch.float32:
        return f"its weights are {w.dtype} on {w.device.type} (oneDNN's decode products: float32 on the CPU)"
    return None


def _projections(model: torch.nn.Module):
    """The `nn.Linear` modules whose weights the decode steps multiply by (`_linear`'s, a LoRA layer's base layer):
    the attention projections, the MLPs' (`_mlp_linears`) and the LM head. The MoE routers and fused experts are not
    among them."""
    def linear(m):
        m = getattr(m, "base_layer", m)
        return m if type(m) is torch.nn.Linear else None

    for layer in model.model.layers:
        a = layer.self_attn
        yield from filter(None, map(linear, (a.q_proj, a.k_proj, a.v_proj, a.o_proj, *_mlp_linears(layer.mlp))))
    if (head := linear(model.lm_head)) is not None:
        yield head


def reordered_weights(model: torch.nn.Module, rows: int) -> dict[int, torch.Tensor]:
    """oneDNN's copies of the decode products' weights (by module id), each reordered once for `rows` rows: what
    `rollout.matmul=onednn` multiplies by during one rollout. A copy: made again at every rollout's start."""
    return {id(m): torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), rows) for m in _projections(model)}


class FastDecoder:
    """Decode steps of one rollout: a preallocated KV cache of `rows` x `length` slots per layer; under
    `matmul="onednn"`, the Linear weights reordered for oneDNN for this rollout (`reordered_weights`)."""

    def __init__(self, model: torch.nn.Module, prefill_cache, length: int, matmul: str = "aten"):
        self._bind(model)
        self.keys, self.values = [], []
        for i in range(len(self.layers)):  # the prefill's cache, copied once into slots [0, P)
            k, v = prefill_cache.layers[i].keys, prefill_cache.layers[i].values
            n, h, p, d = k.shape
            self.keys.append(k.new_empty((n, h, length, d)))
            self.values.append(v.new_empty((n, h, length, d)))
            self.keys[-1][:, :, :p].copy_(k)
            self.values[-1][:, :, :p].copy_(v)
        self._pack(matmul, self.keys[0].shape[0])

    def _bind(self, model: torch.nn.Module) -> None:
        """The model's modules this decoder calls, and the attention function its attention modules call."""
        if hasattr(model, "peft_config"):  # its LoRA layers stay in place: `_linear` adds their products
            model = model.get_base_model()
        self.model, self.body = model, model.model
        self.layers = list(self.body.layers)
        cfg = model.config
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        # the attention function the model's attention modules call: sdpa's, or their module's eager one
        self.eager = cfg._attn_implementation == "eager"
        self.attend = sys.modules[type(self.layers[0].self_attn).__module__].eager_attention_forward if self.eager \
            else ALL_ATTENTION_FUNCTIONS[cfg._attn_implementation]

    def _pack(self, matmul: str, rows: int) -> None:
        """Under `matmul="onednn"`, the Linear weights reordered for oneDNN for this rollout's `rows`; else none."""
        if matmul not in MATMULS:
            raise ValueError(f"rollout.matmul={matmul!r}: expected one of {', '.join(MATMULS)}")
        self.packed: dict[int, torch.Tensor] = {}
        if matmul == "onednn":
            why = _onednn_unsupported(self.model)
            if why is None:
                self.packed = reordered_weights(self.model, rows)
            elif why not in _LOGGED:
                _LOGGED.add(why)
                warnings.warn(f"rollout.matmul=onednn: decoding with F.linear: {why}", stacklevel=3)

    def step(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Logits (N, V) after feeding `ids` (N, 1) at positions `pos` (N, 1); `mask` (N, S) the
        keys seen (left padding 0), the new token's slot being S-1."""
        return self._logits(ids, pos, mask.shape[1] - 1, mask.bool()[:, None, None, :])

    def _logits(self, ids: torch.Tensor, pos: torch.Tensor, slot, keep: torch.Tensor) -> torch.Tensor:
        """The step's arithmetic: `slot` where the new keys and values go (an int here; a tensor in
        gspo/rollout/decoding/static_decode.py), `keep` (N, 1, 1, S) bool: one query, every cached key but the
        padding."""
        h = self.body.embed_tokens(ids)
        cos, sin = self.body.rotary_emb(h, pos)
        if self.eager:  # eager attention adds its mask
            keep = torch.zeros(keep.shape, dtype=h.dtype, device=h.device).masked_fill_(~keep, torch.finfo(h.dtype).min)
        for i, layer in enumerate(self.layers):
            h = self._layer(i, layer, h, cos, sin, slot, keep)
        return self.head(_rms(self.body.norm, h)[:, -1])

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits (N, V) from the final norm's output (N, H): the LM head, on its weight as read now."""
        return _linear(self.model.lm_head, h, self.packed)

    def _store(self, i: int, k: torch.Tensor, v: torch.Tensor, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's new key and value (N, KV heads, 1, D) written at `slot`; the keys and values attention reads:
        the slots filled so far."""
        kc, vc = self.keys[i], self.values[i]
        kc[:, :, slot : slot + 1].copy_(k)
        vc[:, :, slot : slot + 1].copy_(v)
        return kc[:, :, : slot + 1], vc[:, :, : slot + 1]

    def _route(self, i: int, gate: torch.nn.Module, flat: torch.Tensor) -> tuple:
        """Layer i's router on its rows: a module call, so routing capture/replay hooks apply as under hf."""
        return gate(flat)

    def _layer(self, i: int, layer, h, cos, sin, slot, mask) -> torch.Tensor:
        a = layer.self_attn
        n = h.shape[0]
        x = _rms(layer.input_layernorm, h)
        q, k, v = (_linear(proj, x, self.packed).view(n, 1, -1, a.head_dim) for proj in (a.q_proj, a.k_proj, a.v_proj))
        if hasattr(a, "q_norm"):  # Qwen3's per-head q/k norms; Llama, Qwen2, Mistral have none
            q, k = _rms(a.q_norm, q), _rms(a.k_norm, k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
        keys, values = self._store(i, k, v, slot)
        # no sliding window: unsupported() admits only windows that never bind
        o, _ = self.attend(a, q, keys, values, mask, dropout=0.0, scaling=a.scaling)
        h = h + _linear(a.o_proj, o.reshape(n, 1, -1), self.packed)
        x = _rms(layer.post_attention_layernorm, h)
        return h + _mlp(layer.mlp, x, self.packed, lambda flat: self._route(i, layer.mlp.gate, flat))


def _rms(norm, x: torch.Tensor) -> torch.Tensor:
    """The families' RMSNorm (one formula in Qwen3, Llama, Qwen2, Mistral) with the module's weight and epsilon,
    in its order of operations."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x.to(dtype)


def _linear(proj: torch.nn.Module, x: torch.Tensor, packed: dict[int, torch.Tensor]) -> torch.Tensor:
    """The projection on its weight and bias (None where the family has none), as read now: no copy, unless
    `packed` holds a oneDNN copy of the weight (`reordered_weights`). A peft LoRA layer (`_unsupported_adapters`
    admits only plain ones): its base layer's product plus, per active adapter, scaling x B(A(dropout(x))), in peft's
    order of operations, so the sum is the one its forward computes."""
    base = getattr(proj, "base_layer", None)
    if base is None:  # a plain projection; another module (an int8 copy's, gspo/rollout/decoding/quantized.py) computes itself
        return _product(proj, x, packed) if isinstance(proj, torch.nn.Linear) else proj(x)
    out = _product(base, x, packed)
    if proj.disable_adapters or proj.merged:  # peft's forward: the base layer alone (merged: the delta is in it)
        return out
    dtype = out.dtype
    for name in proj.active_adapters:
        if name in proj.lora_A:
            a = proj.lora_A[name]
            out = out + proj.lora_B[name](a(proj.lora_dropout[name](x.to(a.weight.dtype)))) * proj.scaling[name]
    return out.to(dtype)


def _product(linear: torch.nn.Linear, x: torch.Tensor, packed: dict[int, torch.Tensor]) -> torch.Tensor:
    """x W^T + b: oneDNN's matmul on the rollout's reordered copy of W where `packed` has one, else F.linear."""
    w = packed.get(id(linear))
    if w is None:
        return F.linear(x, linear.weight, linear.bias)
    return torch.ops.mkldnn._linear_pointwise(x, w, linear.bias, "none", [], "")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _mlp_linears(mlp) -> tuple:
    """The projections `_mlp` runs through `_linear`: a dense MLP's three; a MoE block's shared expert's three and
    its gate (Qwen2-MoE); none of a MoE block without a shared expert (its router and fused experts are not Linear
    products)."""
    if not hasattr(mlp, "experts"):
        return mlp.gate_proj, mlp.up_proj, mlp.down_proj
    shared = getattr(mlp, "shared_expert", None)
    return () if shared is None else (*_mlp_linears(shared), mlp.shared_expert_gate)


def _gated(mlp, x: torch.Tensor, packed: dict[int, torch.Tensor]) -> torch.Tensor:
    """A dense gated MLP, down(act(gate(x)) * up(x)), biases where Llama's `mlp_bias` gives them: a dense layer's
    MLP, or a MoE block's shared expert."""
    return _linear(mlp.down_proj, mlp.act_fn(_linear(mlp.gate_proj, x, packed)) * _linear(mlp.up_proj, x, packed),
                   packed)


def _mlp(mlp, x: torch.Tensor, packed: dict[int, torch.Tensor], route=None) -> torch.Tensor:
    """The dense MLP (`_gated`), or the sparse MoE block: its routed experts (`_routed`), plus where the block has
    one (Qwen2-MoE) its shared expert, a dense MLP every token runs, scaled by sigmoid(shared_expert_gate(x)): the
    block's forward, in its order of operations."""
    if not hasattr(mlp, "experts"):
        return _gated(mlp, x, packed)
    n, t, dim = x.shape
    flat = x.view(-1, dim)
    out = _routed(mlp, flat, route)
    if getattr(mlp, "shared_expert", None) is not None:
        out = out + torch.sigmoid(_linear(mlp.shared_expert_gate, flat, packed)) * _gated(mlp.shared_expert, flat,
                                                                                          packed)
    return out.view(n, t, dim)


def _routed(mlp, flat: torch.Tensor, route=None) -> torch.Tensor:
    """The MoE block's routed experts on its rows (N, H): the model's router module (through `route(rows)` where
    given: the decoder's `_route`), then every (token, slot) at once."""
    _, weights, idx = mlp.gate(flat) if route is None else route(flat)  # a module call: capture/replay hooks apply
    ex = mlp.experts
    if ex.config._experts_implementation not in (None, "eager"):  # a batched kernel already (grouped_mm, batched_mm)
        return ex(flat, idx, weights)
    # eager loops over the experts hit, a host sync each: instead every expert on every row, two matmuls in all
    # (E/k times the arithmetic of the chosen pairs: cheaper than the loop at gspo's sizes), then the chosen pairs
    gate, up = torch.matmul(ex.gate_up_proj, flat.t()).chunk(2, dim=1)  # (E, I, rows) each
    out = torch.matmul(ex.down_proj, ex.act_fn(gate) * up).permute(2, 0, 1)  # (rows, E, H)
    chosen = out[torch.arange(flat.shape[0], device=flat.device)[:, None], idx]  # (rows, k, H)
    return (chosen * weights.unsqueeze(-1)).sum(1).to(flat.dtype)
