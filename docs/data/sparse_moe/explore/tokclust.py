"""Token clustering first (LLaMA-MoE v2, arXiv 2411.15708): per layer, k-means of the MLP's inputs into E clusters;
expert e = the n neurons (outside the shared ones) most important on cluster e's tokens (experts may overlap); a token
runs the shared neurons and its k experts' (the union). Oracle routing (the experts capturing most of the token's
contribution) and centroid routing (the nearest k cluster centres, cosine). KL on held-out calibration text."""
import sys, time, json, argparse
import torch
import torch.nn.functional as F
from common import *

p = argparse.ArgumentParser()
p.add_argument("--configs", default="192:8:576:1,192:16:288:2,192:32:144:4")
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
X, SC = {}, {}
def visit(l, x, h):
    X.setdefault(l, []).append(x); SC.setdefault(l, []).append(h.abs() * norms[l])
se.each_layer(model, ids, mask, visit)
X = {l: torch.cat(v) for l, v in X.items()}; SC = {l: torch.cat(v) for l, v in SC.items()}


def kmeans(x, E, iters=25, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = F.normalize(x, dim=-1)
    c = x[torch.randperm(len(x), generator=g)[:E]].clone()
    for _ in range(iters):
        a = (x @ c.t()).argmax(-1)
        for e in range(E):
            sel = x[a == e]
            if len(sel):
                c[e] = F.normalize(sel.mean(0), dim=0)
    return c, a


def build(S, E, n):
    out = []
    for l in range(L):
        imp = SC[l].mean(0)
        shared = imp.topk(S).indices if S else torch.zeros(0, dtype=torch.long)
        c, a = kmeans(X[l], E)
        sc = SC[l].clone(); sc[:, shared] = -1
        experts = torch.stack([sc[a == e].mean(0).topk(n).indices if (a == e).any() else imp.topk(n).indices for e in range(E)])
        out.append((shared, experts, c))
    return out


def make(built, k, oracle):
    def mk(l, mlp):
        shared, experts, c = built[l]
        E, n = experts.shape
        def fwd(x):
            h = act(mlp, x)
            flat = h.reshape(-1, I)
            xf = x.reshape(-1, x.shape[-1])
            if oracle:
                s = (flat.abs() * norms[l])[:, experts].sum(-1)  # (N, E) contribution captured by each expert
            else:
                s = F.normalize(xf, dim=-1) @ c.t()
            top = s.topk(k, -1).indices
            keep = torch.zeros(flat.shape[0], I)
            for j in range(k):
                keep.scatter_(1, experts[top[:, j]], 1.0)
            keep[:, shared] = 1
            return mlp.down_proj((flat * keep).reshape(h.shape))
        return fwd
    return mk


res = {}
for spec in args.configs.split(","):
    S, E, n, k = map(int, spec.split(":"))
    t = time.time()
    built = build(S, E, n)
    r = dict(shared=S, E=E, n=n, k=k, budget=(S + k * n) / I)
    for oracle in (True, False):
        undo = patch_mlps(model, make(built, k, oracle))
        r["kl_oracle" if oracle else "kl_centroid"] = se.next_token_kl(ref, model, hid, hmask); undo()
    r["s"] = round(time.time() - t)
    res[spec] = r
    print(json.dumps(r), flush=True)
json.dump(res, open(HERE / "tokclust.json", "w"), indent=1)
