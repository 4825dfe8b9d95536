"""Exploration helpers for the sparse MoE (issue 97): the dense SmolLM2, calibration text, KL with patched MLPs."""
import os, sys, time, json
from pathlib import Path
import torch
import torch.nn.functional as F

sys.path.insert(0, "/work/main")
from gspo.models.build import load_pretrained
from gspo.models import split_experts as se

DENSE = Path("/work/cache/gguf-SmolLM2-135M-Instruct.Q4_1-60884d3502233153")
HERE = Path("/work/explore")


def dense():
    m, tok = load_pretrained(DENSE, torch.float32, "sdpa")
    return m.eval(), tok


def calib(model, tok, name: str, sequences: int, length: int, seed: int):
    """(ids, mask) cached under HERE/name.pt: conversations the model writes itself (split_moe.calibration_ids)."""
    f = HERE / f"{name}.pt"
    if f.exists():
        return torch.load(f)
    from gspo.train.start.split_moe import calibration_ids
    t = time.time()
    ids, mask = calibration_ids(model, tok, sequences, length, seed)
    torch.save((ids, mask), f)
    print(f"calibration {name}: {int(mask.sum())} tokens in {time.time()-t:.0f}s", flush=True)
    return ids, mask


def patch_mlps(model, make):
    """Replace each layer's mlp.forward by make(layer_index, mlp) -> forward(x). Returns an undo function."""
    olds = []
    for i, layer in enumerate(model.model.layers):
        olds.append(layer.mlp.forward)
        layer.mlp.forward = make(i, layer.mlp)

    def undo():
        for layer, f in zip(model.model.layers, olds):
            layer.mlp.forward = f
    return undo


def act(mlp, x):
    return F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)
