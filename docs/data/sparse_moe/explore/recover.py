"""Layer-wise recovery: each layer's MLP replaced by a shared expert + E routed experts (top-k, softmax weights
renormalised, k folded in), trained to reproduce the dense MLP's output on the MoE's own upstream inputs, layer after
layer. KL to the dense model on held-out calibration text before and after.
--target stream: the MLP is fitted to what the dense model's residual stream holds after the layer minus the MoE's
own residual (dense stream_{l+1} - (MoE stream_l + attention)), so each layer also corrects the drift its upstream
left (the asymmetric calibration of GPTQv2-style quantization); --target mlp (the default) fits the dense MLP's
output on the MoE's inputs."""
import sys, time, json, argparse, math
import torch
import torch.nn as nn
import torch.nn.functional as F
from common import *

p = argparse.ArgumentParser()
p.add_argument("--spec", default="192:32:18")
p.add_argument("--epochs", type=int, default=4)
p.add_argument("--lr", type=float, default=1e-4)
p.add_argument("--router_lr", type=float, default=1e-3)
p.add_argument("--batch", type=int, default=256)
p.add_argument("--train", default="calib_train")
p.add_argument("--layers", type=int, default=0, help="recover only the first N layers (0 = all)")
p.add_argument("--out", default="recover")
p.add_argument("--target", choices=["mlp", "stream"], default="mlp")
args = p.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)
model, tok = dense()
ids, mask = calib(model, tok, "calib_train", 64, 160, 0) if args.train == "calib_train" else torch.load(HERE / f"{args.train}.pt")
hid, hmask = calib(model, tok, "calib_held", 16, 160, 1)
ref = se.batched_logps(model, hid, hmask)
L = len(model.model.layers)
I = model.config.intermediate_size
S, m, k = map(int, args.spec.split(":"))
downs = [layer.mlp.down_proj.weight for layer in model.model.layers]
norms = [d.norm(dim=0) for d in downs]


class SparseMLP(nn.Module):
    def __init__(self, mlp, shared, groups, router, k):
        super().__init__()
        Wg, Wu, Wd = mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach(), mlp.down_proj.weight.detach()
        E = groups.shape[0]
        self.sg = nn.Parameter(Wg[shared].clone()); self.su = nn.Parameter(Wu[shared].clone())
        self.sd = nn.Parameter(Wd[:, shared].clone())
        self.eg = nn.Parameter(Wg[groups].clone()); self.eu = nn.Parameter(Wu[groups].clone())  # (E, m, H)
        self.ed = nn.Parameter(Wd[:, groups].permute(1, 0, 2).clone() * k)  # (E, H, m), k folded in
        self.router = nn.Parameter(router.clone())  # (E, H)
        self.k = k

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        E, m, H = self.eg.shape
        out = (F.silu(x @ self.sg.t()) * (x @ self.su.t())) @ self.sd.t()
        probs = F.softmax(x @ self.router.t(), -1, dtype=torch.float32)
        topv, topi = probs.topk(self.k, -1)
        w = torch.zeros_like(probs).scatter(-1, topi, topv / topv.sum(-1, keepdim=True))
        h = F.silu(x @ self.eg.reshape(E * m, H).t()) * (x @ self.eu.reshape(E * m, H).t())  # (N, E*m)
        h = (h.view(-1, E, m) * w.unsqueeze(-1)).reshape(-1, E * m)
        out = out + h @ self.ed.permute(1, 0, 2).reshape(H, E * m).t()
        return out.reshape(shape)

    def choices(self, x):
        return (x.reshape(-1, x.shape[-1]) @ self.router.t()).topk(self.k, -1).indices


# carve: as blocks.py
rows = int((mask.sum(-1).cumsum(0) < 2048).sum())
acts, imp = {}, {}
se.each_layer(model, ids[:rows], mask[:rows], lambda l, x, h: acts.__setitem__(l, h), batch=rows)
se.each_layer(model, ids, mask, lambda l, x, h: imp.__setitem__(l, imp.get(l, 0) + (h.abs() * norms[l]).sum(0)))
carved = []
for l in range(L):
    shared = imp[l].topk(S).indices if S else torch.zeros(0, dtype=torch.long)
    rest = torch.ones(I, dtype=torch.bool); rest[shared] = False
    rest_ids = torch.nonzero(rest).flatten()
    carved.append((shared, rest_ids[se.group_neurons(acts[l][:, rest_ids], len(rest_ids) // m, 0)]))
del acts


@torch.no_grad()
def ridge_router(l, X, Hs):
    shared, g = carved[l]
    parts = Hs[:, g].permute(1, 0, 2)
    contrib = torch.bmm(parts, downs[l][:, g].permute(1, 2, 0)).norm(dim=-1).t().double()
    t = contrib.clamp_min(1e-12).log(); t = t - t.mean(-1, keepdim=True)
    xd = X.double(); a = xd.t() @ xd
    w = torch.linalg.solve(a + 1e-3 * a.diagonal().mean() * torch.eye(a.shape[0], dtype=a.dtype), xd.t() @ t).t()
    pred = X.double() @ w.t()
    spread = float(pred.std(-1).pow(2).mean().sqrt())
    return (w / spread * 0.1).float()  # logits of spread 0.1 nat: the weights near 1/k, the order the fit's


# the residual stream of every calibration sequence, advanced layer by layer through the MoE
B = 8
mod = model.model
with torch.no_grad():
    streams = [mod.embed_tokens(ids[s:s + B]) for s in range(0, len(ids), B)]
    dstreams = [h.clone() for h in streams]  # the dense model's own, for --target stream
    pos = [torch.arange(ids.shape[1]).expand(min(B, len(ids) - s), -1) for s in range(0, len(ids), B)]
    rot = [mod.rotary_emb(h, p_) for h, p_ in zip(streams, pos)]
real = [mask[s:s + B].bool() for s in range(0, len(ids), B)]

log = {"spec": args.spec, "layers": []}
t_all = time.time()
n_layers = args.layers or L
for l in range(n_layers):
    t = time.time()
    layer = mod.layers[l]
    dense_mlp = layer.mlp
    # attention part and MLP inputs
    Xs, Rs = [], []
    with torch.no_grad():
        for h, r in zip(streams, rot):
            a = layer.self_attn(layer.input_layernorm(h), position_embeddings=r, attention_mask=None)[0]
            res = h + a
            Xs.append(layer.post_attention_layernorm(res)); Rs.append(res)
        X = torch.cat([x[rm] for x, rm in zip(Xs, real)])
        Hs = act(dense_mlp, X)
        Y = dense_mlp.down_proj(Hs)
        if args.target == "stream":
            nxt = []
            for h, r in zip(dstreams, rot):
                a = layer.self_attn(layer.input_layernorm(h), position_embeddings=r, attention_mask=None)[0]
                nxt.append(h + a + dense_mlp(layer.post_attention_layernorm(h + a)))
            dstreams = nxt
            Y = torch.cat([(d - r_)[rm] for d, r_, rm in zip(dstreams, Rs, real)])
    router = ridge_router(l, X, Hs)
    del Hs
    moe = SparseMLP(dense_mlp, *carved[l], router, k)
    scale = Y.pow(2).sum(-1).mean()
    with torch.no_grad():
        before = float(((moe(X) - Y).pow(2).sum(-1) / (Y.pow(2).sum(-1) + scale)).mean())
        c0 = moe.choices(X)
    opt = torch.optim.Adam([{"params": [moe.router], "lr": args.router_lr},
                            {"params": [p_ for n_, p_ in moe.named_parameters() if n_ != "router"], "lr": args.lr}])
    N = X.shape[0]
    steps = args.epochs * math.ceil(N / args.batch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    for ep in range(args.epochs):
        perm = torch.randperm(N)
        for s in range(0, N, args.batch):
            b = perm[s:s + args.batch]
            loss = ((moe(X[b]) - Y[b]).pow(2).sum(-1) / (Y[b].pow(2).sum(-1) + scale)).mean()
            opt.zero_grad(); loss.backward(); opt.step(); sched.step()
    with torch.no_grad():
        after = float(((moe(X) - Y).pow(2).sum(-1) / (Y.pow(2).sum(-1) + scale)).mean())
        moved = float((torch.sort(moe.choices(X), -1).values != torch.sort(c0, -1).values).any(-1).float().mean())
        layer.mlp = moe
        streams = [r + moe(x) for r, x in zip(Rs, Xs)]
    rec = dict(layer=l, rel_err_before=before, rel_err_after=after, tokens=N, s=round(time.time() - t, 1))
    log["layers"].append(rec)
    print(json.dumps(rec), flush=True)

log["seconds"] = round(time.time() - t_all)
log["kl_held"] = se.next_token_kl(ref, model, hid, hmask)
print("KL held", log["kl_held"], flush=True)
json.dump(log, open(HERE / f"{args.out}.json", "w"), indent=1)
torch.save({l: mod.layers[l].mlp.state_dict() for l in range(n_layers)}, HERE / f"{args.out}.pt")
