"""The routing of the recovered sparse MoE (issue 97): rec32_frozen's experts (shared 192 + 42 x 32, top-18, trained
layer-wise under a frozen ridge router on calib_train) routed four ways, layer after layer on the MoE's own upstream
inputs:
  stored  the ridge router the experts were trained under (fitted before recovery, on log contribution);
  oracle  per token, the k experts of largest marginal gain 2<E_e(x), T> - ||E_e(x)||^2, T = dense MLP(x) - shared(x)
          (uses the dense output: what no router can beat by much, the bound for routing these experts);
  refit   a ridge router refitted to that gain on the recovered experts (the same logit spread, 0.1);
  and with --epochs N, the experts trained N more epochs under the refitted router (one round of alternation).
Per layer: the relative error of each routing on the calibration tokens; at the end, KL to the dense model on
calib_held under --route."""
import argparse
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from common import *

p = argparse.ArgumentParser()
p.add_argument("--init", default="rec32_frozen")
p.add_argument("--route", choices=["stored", "oracle", "refit"], default="refit")
p.add_argument("--epochs", type=int, default=0)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--k", type=int, default=18)
p.add_argument("--out", required=True)
args = p.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)
model, tok = dense()
ids, mask = calib(model, tok, "calib_train", 64, 160, 0)
hid, hmask = calib(model, tok, "calib_held", 16, 160, 1)
ref = se.batched_logps(model, hid, hmask)
init = torch.load(HERE / f"{args.init}.pt")
L = len(model.model.layers)
CHUNK = 1024


class SparseMLP(nn.Module):
    """recover.py's MoE MLP, with a routing mode: the router's top-k, or the gain oracle (needs the dense MLP)."""

    def __init__(self, state, k, dense_mlp):
        super().__init__()
        for name, value in state.items():
            setattr(self, name, nn.Parameter(value.clone()))
        self.k, self.mode, self.dense = k, "router", [dense_mlp]  # a list: not a submodule

    def shared_out(self, x):
        return (F.silu(x @ self.sg.t()) * (x @ self.su.t())) @ self.sd.t()

    def expert_outs(self, x):
        """(N, E, H): each routed expert's output at weight 1/k (ed holds k times the dense columns)."""
        E, m, H = self.eg.shape
        h = (F.silu(x @ self.eg.reshape(E * m, H).t()) * (x @ self.eu.reshape(E * m, H).t())).view(-1, E, m)
        return torch.einsum("nem,ehm->neh", h, self.ed) / self.k

    def gain(self, x, y):
        outs = self.expert_outs(x)
        t = y - self.shared_out(x)
        return 2 * torch.einsum("neh,nh->ne", outs, t) - outs.pow(2).sum(-1)

    def weights(self, x):
        probs = F.softmax(x @ self.router.t(), -1, dtype=torch.float32)
        if self.mode == "oracle":
            with torch.no_grad():
                topi = self.gain(x, self.dense[0].down_proj(act(self.dense[0], x))).topk(self.k, -1).indices
            topv = torch.full(topi.shape, 1.0 / self.k)
        else:
            topv, topi = probs.topk(self.k, -1)
            topv = topv / topv.sum(-1, keepdim=True)
        return torch.zeros_like(probs).scatter(-1, topi, topv)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        E, m, H = self.eg.shape
        out = self.shared_out(x)
        h = F.silu(x @ self.eg.reshape(E * m, H).t()) * (x @ self.eu.reshape(E * m, H).t())
        h = (h.view(-1, E, m) * self.weights(x).unsqueeze(-1)).reshape(-1, E * m)
        out = out + h @ self.ed.permute(1, 0, 2).reshape(H, E * m).t()
        return out.reshape(shape)


def rel_err(moe, X, Y, scale):
    with torch.no_grad():
        return float(torch.cat([((moe(X[s:s + CHUNK]) - Y[s:s + CHUNK]).pow(2).sum(-1)
                                 / (Y[s:s + CHUNK].pow(2).sum(-1) + scale)) for s in range(0, len(X), CHUNK)]).mean())


@torch.no_grad()
def refit_router(moe, X, Y):
    """Ridge from the MLP input to the centred gain, scaled to a logit spread of 0.1 (recover.py's choice)."""
    xd = X.double()
    a = xd.t() @ xd
    b = sum(xd[s:s + CHUNK].t() @ (lambda g: g - g.mean(-1, keepdim=True))(moe.gain(X[s:s + CHUNK], Y[s:s + CHUNK]).double())
            for s in range(0, len(X), CHUNK))
    w = torch.linalg.solve(a + 1e-3 * a.diagonal().mean() * torch.eye(a.shape[0], dtype=a.dtype), b).t()
    spread = float((xd @ w.t()).std(-1).pow(2).mean().sqrt())
    moe.router.copy_((w / spread * 0.1).float())


def agreement(moe, X, Y):
    """Mean fraction of the oracle's k experts the router also picks."""
    with torch.no_grad():
        hits = []
        for s in range(0, len(X), CHUNK):
            o = moe.gain(X[s:s + CHUNK], Y[s:s + CHUNK]).topk(moe.k, -1).indices
            r = (X[s:s + CHUNK] @ moe.router.t()).topk(moe.k, -1).indices
            hits.append((o.unsqueeze(-1) == r.unsqueeze(-2)).any(-1).float().mean(-1))
        return float(torch.cat(hits).mean())


B = 8
mod = model.model
with torch.no_grad():
    streams = [mod.embed_tokens(ids[s:s + B]) for s in range(0, len(ids), B)]
    pos = [torch.arange(ids.shape[1]).expand(min(B, len(ids) - s), -1) for s in range(0, len(ids), B)]
    rot = [mod.rotary_emb(h, p_) for h, p_ in zip(streams, pos)]
real = [mask[s:s + B].bool() for s in range(0, len(ids), B)]
log = {"args": vars(args), "layers": []}
t_all = time.time()
for l in range(L):
    t = time.time()
    layer = mod.layers[l]
    dense_mlp = layer.mlp
    Xs, Rs = [], []
    with torch.no_grad():
        for h, r in zip(streams, rot):
            a = layer.self_attn(layer.input_layernorm(h), position_embeddings=r, attention_mask=None)[0]
            Rs.append(h + a)
            Xs.append(layer.post_attention_layernorm(h + a))
        X = torch.cat([x[rm] for x, rm in zip(Xs, real)])
        Y = dense_mlp(X)
    scale = Y.pow(2).sum(-1).mean()
    moe = SparseMLP(init[l], args.k, dense_mlp)
    rec = {"layer": l, "stored": rel_err(moe, X, Y, scale), "agree_stored": agreement(moe, X, Y)}
    moe.mode = "oracle"
    rec["oracle"] = rel_err(moe, X, Y, scale)
    moe.mode = "router"
    stored_router = moe.router.detach().clone()
    refit_router(moe, X, Y)
    rec["refit"], rec["agree_refit"] = rel_err(moe, X, Y, scale), agreement(moe, X, Y)
    if args.route == "stored":
        moe.router.data.copy_(stored_router)
    if args.epochs:
        opt = torch.optim.Adam([q for n, q in moe.named_parameters() if n != "router"], lr=args.lr)
        N = X.shape[0]
        steps = args.epochs * math.ceil(N / 256)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / steps)))
        for _ in range(args.epochs):
            perm = torch.randperm(N)
            for s in range(0, N, 256):
                b = perm[s:s + 256]
                loss = ((moe(X[b]) - Y[b]).pow(2).sum(-1) / (Y[b].pow(2).sum(-1) + scale)).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
        rec["trained"] = rel_err(moe, X, Y, scale)
        moe.mode = "oracle"
        rec["trained_oracle"] = rel_err(moe, X, Y, scale)
    moe.mode = "oracle" if args.route == "oracle" else "router"
    with torch.no_grad():
        layer.mlp = moe
        streams = [r + moe(x) for r, x in zip(Rs, Xs)]
    rec["s"] = round(time.time() - t, 1)
    log["layers"].append(rec)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()}), flush=True)

log["seconds"] = round(time.time() - t_all)
with torch.no_grad():
    log["kl_held"] = se.next_token_kl(ref, model, hid, hmask)
print("KL held", log["kl_held"], flush=True)
json.dump(log, open(HERE / f"{args.out}.json", "w"), indent=1)
torch.save({l: {n: q for n, q in mod.layers[l].mlp.state_dict().items()} for l in range(L)}, HERE / f"{args.out}.pt")
