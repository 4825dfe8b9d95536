"""Does the MoE lose its quality at the first token (the massive activations, arXiv 2402.17762)? The recovered
layers of --init (shared 192 + 42 x 32, top-18, under their stored router) on calib_held: KL to the dense model as
built, with every layer's MLP at position 0 the dense one (the rest the MoE's), and the per-layer share of the MLP
output's squared norm that position 0 holds."""
import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F
from common import *

p = argparse.ArgumentParser()
p.add_argument("--init", default="rec32_frozen")
p.add_argument("--k", type=int, default=18)
args = p.parse_args()
torch.set_num_threads(1)
model, tok = dense()
hid, hmask = calib(model, tok, "calib_held", 16, 160, 1)
ref = se.batched_logps(model, hid, hmask)
init = torch.load(HERE / f"{args.init}.pt")


class Moe(nn.Module):
    def __init__(self, state, k, dense_mlp):
        super().__init__()
        for name, value in state.items():
            setattr(self, name, nn.Parameter(value.clone(), requires_grad=False))
        self.k, self.dense, self.pos0_dense, self.share = k, [dense_mlp], False, []

    def moe(self, x):
        E, m, H = self.eg.shape
        out = (F.silu(x @ self.sg.t()) * (x @ self.su.t())) @ self.sd.t()
        probs = F.softmax(x @ self.router.t(), -1, dtype=torch.float32)
        topv, topi = probs.topk(self.k, -1)
        w = torch.zeros_like(probs).scatter(-1, topi, topv / topv.sum(-1, keepdim=True))
        h = F.silu(x @ self.eg.reshape(E * m, H).t()) * (x @ self.eu.reshape(E * m, H).t())
        h = (h.view(-1, E, m) * w.unsqueeze(-1)).reshape(-1, E * m)
        return out + h @ self.ed.permute(1, 0, 2).reshape(H, E * m).t()

    def forward(self, x):
        b, t, hdim = x.shape
        out = self.moe(x.reshape(-1, hdim)).view(b, t, hdim)
        d0 = self.dense[0](x[:, :1])
        self.share.append(float(d0.pow(2).sum() / self.dense[0](x).pow(2).sum()))
        if self.pos0_dense:
            out = torch.cat([d0, out[:, 1:]], 1)
        return out


moes = []
for l, layer in enumerate(model.model.layers):
    moes.append(Moe(init[l], args.k, layer.mlp))
    layer.mlp = moes[-1]
with torch.no_grad():
    res = {"kl_built": se.next_token_kl(ref, model, hid, hmask)}
    share = [sum(m.share) / len(m.share) for m in moes]
    for m in moes:
        m.pos0_dense = True
    res["kl_pos0_dense"] = se.next_token_kl(ref, model, hid, hmask)
res["pos0_share_of_mlp_output"] = [round(s, 4) for s in share]
print(json.dumps(res), flush=True)
