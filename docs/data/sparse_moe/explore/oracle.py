"""The oracle: per token keep the neurons (or blocks) with the largest contribution |h_i| * ||W_down[:, i]||; the KL
to the dense model on held-out calibration text. What no router can beat without training the experts."""
import sys, time, json
import torch
from common import *

torch.set_num_threads(1)
model, tok = dense()
ids, mask = calib(model, tok, "calib_train", 64, 160, 0)
hid, hmask = calib(model, tok, "calib_held", 16, 160, 1)
ref = se.batched_logps(model, hid, hmask)
norms = [layer.mlp.down_proj.weight.norm(dim=0) for layer in model.model.layers]  # (I,)

# per layer mean importance over the train text: for the shared expert
imp = {}
def visit(layer, x, h):
    imp[layer] = (h.abs() * norms[layer]).mean(0)
se.each_layer(model, ids, mask, visit)


def neuron_oracle(frac):
    def make(i, mlp):
        def fwd(x):
            h = act(mlp, x)
            score = h.abs() * norms[i]
            k = int(frac * h.shape[-1])
            top = score.topk(k, dim=-1).indices
            keep = torch.zeros_like(h).scatter_(-1, top, 1.0)
            return mlp.down_proj(h * keep)
        return fwd
    return make


def shared_oracle(shared_frac, routed_frac):
    """shared: the top neurons by mean importance, always on; per token the top routed neurons of the rest."""
    def make(i, mlp):
        I = norms[i].shape[0]
        s = int(shared_frac * I)
        shared = imp[i].topk(s).indices
        smask = torch.zeros(I); smask[shared] = 1
        def fwd(x):
            h = act(mlp, x)
            score = (h.abs() * norms[i]).masked_fill(smask.bool(), -1)
            k = int(routed_frac * I)
            top = score.topk(k, dim=-1).indices
            keep = torch.zeros_like(h).scatter_(-1, top, 1.0) + smask
            return mlp.down_proj(h * keep)
        return fwd
    return make


out = {}
for frac in (0.5, 0.375, 0.25):
    undo = patch_mlps(model, neuron_oracle(frac))
    kl = se.next_token_kl(ref, model, hid, hmask); undo()
    out[f"neuron_top{frac}"] = kl; print(f"neuron oracle {frac}: KL {kl:.4f}", flush=True)
for sf, rf in ((0.125, 0.375), (0.25, 0.25), (0.0625, 0.1875), (0.125, 0.125)):
    undo = patch_mlps(model, shared_oracle(sf, rf))
    kl = se.next_token_kl(ref, model, hid, hmask); undo()
    out[f"shared{sf}_routed{rf}"] = kl; print(f"shared {sf} + routed {rf} oracle: KL {kl:.4f}", flush=True)
json.dump(out, open(HERE / "oracle.json", "w"), indent=1)
