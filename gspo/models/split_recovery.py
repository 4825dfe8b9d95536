"""Recovery of a split MoE (gspo/models/split_experts.py): its experts trained back toward the dense model it was
split from, on the calibration text its caller gives.

Two ways, each a `model.split_experts` setting:
  * `recover` (`recovery_epochs`): the dense model distilled into the MoE end to end, teacher-forced per-token
    KL(dense || MoE) of the next-token distributions, every expert and router at once. A backward pass through the
    whole model per batch: 1.9 points back in 2,094 s on 17 k tokens on 2 cores (docs/results/smollm2-moe.md).
  * `recover_layers` (`layerwise_epochs`): each layer's MoE block trained to give the dense MLP's output on its own
    inputs, a regression on one MLP (about 30x cheaper per token), layer after layer on the MoE's own upstream
    outputs, so a layer learns the inputs the recovered layers below it give. Its routers stay as fitted: trained
    with the experts on this loss they got worse (docs/data/sparse_moe/explore). Each finished layer can be saved
    and a build interrupted midway continues from the last one (`state_dir`).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F


# ----------------------------------------------------------------------------- how close to the dense model
@torch.no_grad()
def next_token_kl(dense_logps: list[torch.Tensor], model, ids: torch.Tensor, mask: torch.Tensor,
                  batch: int = 8) -> float:
    """Mean per-token KL(dense || model) of the next-token distributions on the real tokens of `ids`;
    `dense_logps`: the dense model's log-probs there, per batch (`token_logps`)."""
    total, count = 0.0, 0
    for b, s in enumerate(range(0, ids.shape[0], batch)):
        logp = token_logps(model, ids[s : s + batch], mask[s : s + batch])
        ref = dense_logps[b]
        total += float((ref.exp() * (ref - logp)).sum())
        count += ref.shape[0]
    return total / max(count, 1)


@torch.no_grad()
def token_logps(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(real tokens, V) float32 next-token log-probs of `model` on a right-padded batch."""
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    return F.log_softmax(logits.float(), -1)[mask.bool()]


def batched_logps(model, ids: torch.Tensor, mask: torch.Tensor, batch: int = 8) -> list[torch.Tensor]:
    """`token_logps` of `model` on `ids`, per batch of `batch` rows: what `next_token_kl` takes as `dense_logps`."""
    return [token_logps(model, ids[s : s + batch], mask[s : s + batch]) for s in range(0, ids.shape[0], batch)]



# ----------------------------------------------------------------------------- the dense model distilled end to end
def recover(dense, moe, ids: torch.Tensor, mask: torch.Tensor, epochs: int, lr: float, batch: int = 8,
            log: Callable[[str], None] = print) -> list[float]:
    """Distil the dense model into the MoE's blocks on the calibration text, teacher-forced: `epochs` passes of
    AdamW (lr `lr`, batches of `batch` sequences) on every expert's and router's weights, the loss the per-token
    KL(dense || MoE) of the next-token distributions on the real tokens; attention, norms and embeddings stay the
    dense model's, frozen. The mean training loss of each epoch."""
    blocks = [p for layer in moe.model.layers for p in layer.mlp.parameters()]
    for p in moe.parameters():
        p.requires_grad_(False)
    for p in blocks:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(blocks, lr=lr, weight_decay=0.0)
    order = torch.Generator().manual_seed(0)
    losses = []
    try:  # (in eval mode: nothing in the model draws at random, the gradients flow all the same)
        for epoch in range(epochs):
            total, count = 0.0, 0
            for rows in torch.randperm(ids.shape[0], generator=order).split(batch):
                ref = token_logps(dense, ids[rows], mask[rows])
                logits = moe(input_ids=ids[rows], attention_mask=mask[rows], use_cache=False).logits
                logp = F.log_softmax(logits.float(), -1)[mask[rows].bool()]
                loss = (ref.exp() * (ref - logp)).sum(-1).mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total, count = total + loss.item() * ref.shape[0], count + ref.shape[0]
            losses.append(total / max(count, 1))
            log(f"gspo: split experts: recovery epoch {epoch + 1}/{epochs}: KL(dense || MoE) {losses[-1]:.4f} per "
                "token on the calibration text")
    finally:
        for p in moe.parameters():
            p.requires_grad_(False)
    return losses


# the tokens per optimizer step of the layer-wise regression, and the warm-up steps before its cosine decay
LAYER_BATCH = 256
WARMUP = 20


def recover_layers(dense, moe, ids: torch.Tensor, mask: torch.Tensor, epochs: int, lr: float, seed: int = 0,
                   state_dir: Optional[Path] = None, batch: int = 8,
                   log: Callable[[str], None] = print) -> list[dict]:
    """Train each layer's MoE block of `moe` to give the dense MLP's output on its input, layer after layer: the
    inputs are the MoE's own (its layers below already recovered), on the real tokens of the calibration text `ids`
    (right-padded, `mask`); `epochs` passes of Adam (lr `lr`, WARMUP steps up, then cosine to 0) over batches of
    LAYER_BATCH tokens in an order drawn from `seed` and the layer; the loss each token's squared error relative to
    its target's squared norm plus the mean one (so that the first token's massive outputs weigh as any other).
    What trains: the experts and the shared expert; routers and the shared expert's gate stay as built. Given
    `state_dir`, each finished layer's block is written there (`layer-NNN.safetensors`, `.json`), and a layer found
    there is loaded instead of trained. Per layer, its record: relative error before and after, seconds."""
    from safetensors.torch import load_file, save_file

    body, records = moe.model, []
    streams = [body.embed_tokens(ids[s : s + batch]).detach() for s in range(0, ids.shape[0], batch)]
    real = [mask[s : s + batch].bool() for s in range(0, ids.shape[0], batch)]
    rope = [body.rotary_emb(h, torch.arange(h.shape[1]).expand(h.shape[0], -1)) for h in streams]
    causal = [torch.full((h.shape[1], h.shape[1]), float("-inf")).triu(1)[None, None] for h in streams]
    for index, (layer, dense_layer) in enumerate(zip(body.layers, dense.model.layers)):
        clock = time.time()
        with torch.no_grad():  # the block's input on every token, the residual it adds to
            residual = [h + layer.self_attn(layer.input_layernorm(h), position_embeddings=r, attention_mask=c)[0]
                        for h, r, c in zip(streams, rope, causal)]
            inputs = [layer.post_attention_layernorm(h) for h in residual]
        saved = state_dir / f"layer-{index:03d}" if state_dir is not None else None
        if saved is not None and saved.with_suffix(".json").is_file():
            layer.mlp.load_state_dict(load_file(saved.with_suffix(".safetensors")))
            records.append(json.loads(saved.with_suffix(".json").read_text()))
        else:
            x = torch.cat([h[r] for h, r in zip(inputs, real)])
            with torch.no_grad():
                y = dense_layer.mlp(x)
            record = {"layer": index, "tokens": x.shape[0], **_fit_block(layer.mlp, x, y, epochs, lr, seed + index)}
            record["seconds"] = round(time.time() - clock, 1)
            if saved is not None:
                saved.parent.mkdir(parents=True, exist_ok=True)
                save_file({k: v.contiguous() for k, v in layer.mlp.state_dict().items()},
                          str(saved.with_suffix(".safetensors")))
                saved.with_suffix(".json").write_text(json.dumps(record))  # (last: the layer is done once it is there)
            records.append(record)
            log(f"gspo: split experts: layer {index} recovered: relative error {record['before']:.3f} -> "
                f"{record['after']:.3f} on {record['tokens']} tokens ({record['seconds']:.0f} s)")
        with torch.no_grad():
            streams = [h + layer.mlp(x) for h, x in zip(residual, inputs)]
    return records


def _fit_block(block, x: torch.Tensor, y: torch.Tensor, epochs: int, lr: float, seed: int) -> dict:
    """Adam on `block`'s experts (not its router or shared gate) toward `block(x) = y`: the relative error
    (`_relative_error`) over all of x before and after."""
    flags = {name: p.requires_grad for name, p in block.named_parameters()}
    train = [p for name, p in block.named_parameters() if not name.startswith(("gate.", "shared_expert_gate."))]
    scale = y.pow(2).sum(-1).mean()
    before = _relative_error(block, x, y, scale)
    steps = epochs * math.ceil(x.shape[0] / LAYER_BATCH)
    if steps:
        for p in block.parameters():
            p.requires_grad_(any(p is q for q in train))
        opt = torch.optim.Adam(train, lr=lr)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / WARMUP) * 0.5 * (1 + math.cos(math.pi * s / steps)))
        order = torch.Generator().manual_seed(seed)
        try:
            for _ in range(epochs):
                for rows in torch.randperm(x.shape[0], generator=order).split(LAYER_BATCH):
                    loss = _relative_error(block, x[rows], y[rows], scale, grad=True)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    sched.step()
        finally:
            for name, p in block.named_parameters():
                p.requires_grad_(flags[name])
    return {"before": before, "after": _relative_error(block, x, y, scale)}


def _relative_error(block, x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor, grad: bool = False):
    """Mean over tokens of ||block(x) - y||^2 / (||y||^2 + scale): with `grad` the loss tensor of a batch, else a
    float over all of x, in chunks of 4,096 tokens (a block's routing tensors grow with the tokens it is given)."""
    def errors(x, y):
        out = block(x.unsqueeze(0)).squeeze(0)  # (the blocks take (batch, tokens, hidden))
        return (out - y).pow(2).sum(-1) / (y.pow(2).sum(-1) + scale)

    if grad:
        return errors(x, y).mean()
    with torch.no_grad():
        return float(sum(errors(a, b).sum() for a, b in zip(x.split(4096), y.split(4096))) / x.shape[0])
