"""An int8 sampling copy (`rollout.dtype=int8`): the policy's Linear products in int8 for decoding on a CPU.

On a CPU without bf16 instructions the one precision that makes decoding's thin products faster is int8:
weights quantized symmetrically per output channel, each call's inputs per token (fbgemm's dynamic linear on rows
scaled to one magnitude: 1.7-2x float32's rate at a decode step's 32 rows, docs/benchmarks.md). Every `nn.Linear`
of the copy (attention and MLP projections, the LM head) becomes an `Int8Linear`; the rest (embeddings, norms, MoE
routers and fused experts) stays float32, so the routers choose as they would in float32 from slightly different
inputs. The weights are quantized again at every weight sync, from the trainer's float32 values. On SmolLM2 the
copy's samples are measurably worse than float32's (docs/results.md, a lower-precision sampler): an option to
study, not a default.

The sampled tokens come from another distribution than the trainer's, as under a bf16 copy: the old policy's
log-probs are recomputed (`rollout.old_logprobs=auto`) unless `rollout.old_logprobs=sampler` takes the
sampler's own, the mismatch then left to the ratio or to the corrections (`rollout.tis`, `rollout.mask`).

The kernels are torch's quantized-tensor ops (`torch.ops.quantized.linear_dynamic`), which torch deprecates in
favour of torchao: `check` refuses the option in one line where they are missing, and on a GPU (CPU kernels).
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import nn


def available() -> Optional[str]:
    """Why this torch cannot run the int8 copy (None: it can)."""
    ops = torch.ops.quantized
    if not (hasattr(ops, "linear_prepack") and hasattr(ops, "linear_dynamic")):
        return f"torch {torch.__version__} has no quantized.linear_dynamic kernel"
    return None


class Int8Linear(nn.Module):
    """`nn.Linear`'s product, its weight in int8 (per output channel, symmetric), each call's input quantized
    per token (row): y = dequant(quant(x) @ quant(W)^T) + b, accumulated in int32 by fbgemm."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())
        self.load(linear.weight)

    @torch.no_grad()
    def load(self, weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None) -> None:
        """Quantize `weight` (out, in) into the packed int8 weight, and/or copy `bias`; None keeps what is held."""
        if bias is not None:
            self.bias.copy_(bias)
        if weight is None:
            return
        w = weight.detach().float()
        scale = (w.abs().amax(1) / 127).clamp_min(1e-12).double()
        with warnings.catch_warnings():  # torch deprecates quantized tensors (module docstring)
            warnings.simplefilter("ignore")
            q = torch.quantize_per_channel(w, scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
            self.packed = torch.ops.quantized.linear_prepack(q, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, x = x.dtype, x.float()
        # per token: the kernel quantizes its whole input on one scale, and one token's massive activations (a
        # chat model's first tokens reach 100x the others) would flatten every other row to a few levels; each row
        # divided by its own largest magnitude first, the product scaled back (SmolLM2: KL to float32 1.2 -> 0.11)
        scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-12)
        # reduce_range: 7-bit inputs, so fbgemm's int16 pair sums cannot overflow on CPUs without VNNI
        out = torch.ops.quantized.linear_dynamic(x / scale, self.packed, True) * scale
        return (out if self.bias is None else out + self.bias).to(dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize(model: nn.Module) -> dict[str, list[tuple[Int8Linear, str]]]:
    """Replace every `nn.Linear` of `model` (in place) by an `Int8Linear`; the map from each replaced parameter's
    name (as `model.named_parameters()` named it before: a tied LM head's weight under its embedding's name) to
    the int8 modules and slot ("weight", "bias") it feeds, for the weight sync."""
    from gspo.models import moe

    names = {id(p): n for n, p in model.named_parameters()}
    routers = {id(r) for r in moe.find_routers(model)}  # the routing stays float32: near-ties decide it
    feeds: dict[str, list[tuple[Int8Linear, str]]] = {}
    for path, module in list(model.named_modules()):
        if type(module) is not nn.Linear or id(module) in routers:  # exact: no subclass (adapters) is a projection
            continue
        q = Int8Linear(module)
        for slot in ("weight", "bias"):
            p = getattr(module, slot)
            if p is not None:
                feeds.setdefault(names[id(p)], []).append((q, slot))
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent), leaf, q)
    return feeds
