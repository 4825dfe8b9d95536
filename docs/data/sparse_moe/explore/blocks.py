"""Block-level sparsity: a shared expert (top mean-importance neurons) + E routed experts of m neurons (balanced
k-means on co-activation of the rest), top-k routed per token; oracle routing vs a ridge router (log contribution).
KL to the dense model on held-out calibration text, selection weights exactly 1 (the idealised carve)."""
import sys, time, json, argparse
import torch
from common import *

p = argparse.ArgumentParser()
p.add_argument("--configs", default="192:32:18,192:48:12,0:32:24,384:32:12")
p.add_argument("--target", default="lognorm", choices=["lognorm", "oracle"])
p.add_argument("--out", default="blocks")
args = p.parse_args()
torch.set_num_threads(1)
model, tok = dense()
ids, mask = calib(model, tok, "calib_train", 64, 160, 0)
hid, hmask = calib(model, tok, "calib_held", 16, 160, 1)
ref = se.batched_logps(model, hid, hmask)
L = len(model.model.layers)
downs = [layer.mlp.down_proj.weight for layer in model.model.layers]
norms = [d.norm(dim=0) for d in downs]
I = norms[0].shape[0]

# activations on the first 2048 train tokens (profiles) and importance over all
acts = {}
rows = int((mask.sum(-1).cumsum(0) < 2048).sum())
se.each_layer(model, ids[:rows], mask[:rows], lambda l, x, h: acts.__setitem__(l, h), batch=rows)
imp = {}
se.each_layer(model, ids, mask, lambda l, x, h: imp.__setitem__(l, imp.get(l, 0) + (h.abs() * norms[l]).sum(0)))


def carve(S, m, seed=0):
    """per layer: shared (S,) neuron ids, groups (E, m) neuron ids"""
    out = []
    for l in range(L):
        shared = imp[l].topk(S).indices if S else torch.zeros(0, dtype=torch.long)
        rest = torch.ones(I, dtype=torch.bool); rest[shared] = False
        rest_ids = torch.nonzero(rest).flatten()
        E = len(rest_ids) // m
        g = se.group_neurons(acts[l][:, rest_ids], E, seed)
        out.append((shared, rest_ids[g]))
    return out


def fit_router(carved, k, ridge=1e-3):
    xtx, xty = {}, {}
    def add(l, x, h):
        shared, g = carved[l]
        parts = h[:, g].permute(1, 0, 2)
        contrib = torch.bmm(parts, downs[l][:, g].permute(1, 2, 0)).norm(dim=-1).t().double()
        if args.target == "oracle":  # least-squares classification of the oracle's top-k (1 in, 0 out), centred
            t = torch.zeros_like(contrib).scatter_(-1, contrib.topk(k, -1).indices, 1.0)
        else:
            t = contrib.clamp_min(1e-12).log()
        t = t - t.mean(-1, keepdim=True)
        xd = x.double()
        xtx[l] = xtx.get(l, 0) + xd.t() @ xd
        xty[l] = xty.get(l, 0) + xd.t() @ t
    se.each_layer(model, ids, mask, add)
    ws = []
    for l in range(L):
        a = xtx[l]
        ws.append(torch.linalg.solve(a + ridge * a.diagonal().mean() * torch.eye(a.shape[0], dtype=a.dtype), xty[l]).t().float())
    return ws


def make_moe(carved, k, routers=None):
    def make(l, mlp):
        shared, g = carved[l]
        E, m = g.shape
        def fwd(x):
            h = act(mlp, x)
            flat = h.reshape(-1, I)
            if routers is None:  # oracle: the k largest contributions
                parts = flat[:, g].permute(1, 0, 2)
                score = torch.bmm(parts, downs[l][:, g].permute(1, 2, 0)).norm(dim=-1).t()
            else:
                score = x.reshape(-1, x.shape[-1]) @ routers[l].t()
            top = score.topk(k, dim=-1).indices  # (N, k)
            keep = torch.zeros(flat.shape[0], E).scatter_(-1, top, 1.0)
            nk = torch.zeros(flat.shape[0], I)
            nk[:, g.reshape(-1)] = keep.repeat_interleave(m, dim=1)
            nk[:, shared] = 1
            return mlp.down_proj((flat * nk).reshape(h.shape))
        return fwd
    return make


res = {}
for spec in args.configs.split(","):
    S, m, k = map(int, spec.split(":"))
    t = time.time()
    carved = carve(S, m)
    E = carved[0][1].shape[0]
    frac = (S + k * m) / I
    undo = patch_mlps(model, make_moe(carved, k)); kl_o = se.next_token_kl(ref, model, hid, hmask); undo()
    routers = fit_router(carved, k)
    undo = patch_mlps(model, make_moe(carved, k, routers)); kl_r = se.next_token_kl(ref, model, hid, hmask); undo()
    res[spec] = dict(shared=S, m=m, E=E, k=k, active=frac, kl_oracle=kl_o, kl_router=kl_r, s=round(time.time() - t))
    print(json.dumps(res[spec]), flush=True)
json.dump(res, open(HERE / f"{args.out}.json", "w"), indent=1)
