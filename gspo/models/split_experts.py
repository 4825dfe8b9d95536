"""A mixture of experts made from a dense Llama by splitting its MLP neurons into experts (`model.split_experts`).

MoEfication (arXiv 2110.01786) and LLaMA-MoE (arXiv 2406.16554): a gated MLP
`down(silu(gate x) * up x)` is a sum over its intermediate neurons, so partitioning the neurons into E groups
of equal size writes it exactly as the sum of E smaller MLPs, the experts. A router then picks k of them per token;
with all E picked (and weights that do not rescale) the model is the dense one, parameter for parameter.

The construction (`split`), on calibration text its caller gives (a run's: text the dense model writes itself,
gspo/train/start/split_moe.py), so no data is read or downloaded:

  1. neurons are grouped by co-activation (`group_neurons`): each neuron's magnitude profile over the calibration
     tokens, neurons that fire on the same tokens put together by a balanced k-means, so that on a given token
     most of the MLP's output sits in a few experts and dropping the others loses little;
  2. each layer's router is a ridge regression from the MLP's input to each expert's log contribution norm
     log ||down_e h_e||, less the token's mean over experts, on the calibration tokens (`fit_routers`): it ranks
     a token's experts as their contributions do (fitting the norms themselves let the first token's massive
     activations dominate the fit, and the routers missed the experts that carry them: KL 1.9 per token against
     0.32 for the log fit, at 7 of 8 experts on SmolLM2-135M);
  3. the result is a MixtralForCausalLM (`to_mixtral`): Mixtral's attention, norms and RoPE are Llama's exactly
     (no biases; a sliding window only if the config sets one), so the only difference from the dense model is
     the MoE block;
  4. optionally (`recovery_epochs` > 0), the dense model distilled into the experts and routers on the same text
     (`recover`: teacher-forced per-token KL(dense || MoE), everything but the MoE blocks frozen).

Mixtral's router renormalises its top-k softmax weights to sum 1, so the k chosen experts get weights of about
1/k where the dense model gives each group weight 1. The factor k is folded into every expert's down projection,
and the router's logits are scaled (`choose_scale`: the scale of SCALES closest to the dense model on held-out
calibration text) so that the weights stay near 1/k: the router *selects* and hardly rescales, as the dense sum
wants (on SmolLM2 a logit spread of 1 nat, weights free to move, was 9 nats per token from the dense model). With
top_k = E and a uniform router (logits all equal: weights exactly 1/E, the factor E) the MoE computes the dense
model's outputs (tested).

The built checkpoint is cached in `cache_dir`, and its calibration text written by the dense model, by
gspo/train/start/split_moe.py: here is the construction alone, on the models and tensors it is given.

The calibration text is sampled, and another CPU's kernels round otherwise: the same settings build a different
split on another CPU model (SmolLM2's 16-expert split: 8,562 calibration tokens and KL 0.142 to the dense model on
one CPU, 8,542 and 0.166 on another). So every build also writes its decisions, each layer's neuron groups and
router weights (1.3 MB for SmolLM2), as `split.safetensors` (`save_recipe`), and `model.split_experts.recipe`
makes the split from such a file instead (`from_recipe`): copies of the dense weights, the same bytes on any
machine. The `smollm2_moe` preset ships its recipe.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from gspo.config.schema import SplitExpertsConfig
from gspo.core.errors import ConfigError
from gspo.models.split_recovery import batched_logps, next_token_kl, recover, recover_layers

DENSE_FAMILIES = ("llama",)  # the families whose attention Mixtral's is, exactly (no q/k/v biases, no q/k norms)


# ----------------------------------------------------------------------------- statistics over the calibration text
@torch.no_grad()
def each_layer(model, ids: torch.Tensor, mask: torch.Tensor,
               visit: Callable[[int, torch.Tensor, torch.Tensor], None], batch: int = 8) -> None:
    """Run the dense model over the calibration text, calling visit(layer, x (N, H), h (N, I)) with each MLP's
    input x and its intermediate activations h = silu(gate x) * up x, on the real (unpadded) tokens only."""
    inputs: dict[int, torch.Tensor] = {}
    keep = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        def take_input(module, args, i=i):
            inputs[i] = args[0].reshape(-1, args[0].shape[-1])[keep["rows"]]

        def take_hidden(module, args, i=i):
            visit(i, inputs.pop(i), args[0].reshape(-1, args[0].shape[-1])[keep["rows"]])

        hooks += [layer.mlp.register_forward_pre_hook(take_input),
                  layer.mlp.down_proj.register_forward_pre_hook(take_hidden)]
    try:
        for s in range(0, ids.shape[0], batch):
            keep["rows"] = mask[s : s + batch].reshape(-1).bool()
            model.model(input_ids=ids[s : s + batch], attention_mask=mask[s : s + batch], use_cache=False)  # no head
    finally:
        for h in hooks:
            h.remove()


# ----------------------------------------------------------------------------- step 1: group the neurons
def balanced_kmeans(features: torch.Tensor, groups: int, iters: int = 20, seed: int = 0) -> torch.Tensor:
    """(n,) group of each row of `features` (n, d): k-means with every group holding exactly n / groups rows.

    Each round assigns greedily by distance under the capacity (all (row, centre) pairs in order of distance,
    a pair taken while its row is free and its centre not full), then moves the centres to their groups' means."""
    n = features.shape[0]
    if n % groups:
        raise ValueError(f"{n} rows do not split into {groups} groups of equal size")
    size = n // groups
    gen = torch.Generator().manual_seed(seed)
    x = features.float().contiguous()
    centres = x[torch.randperm(n, generator=gen)[:groups]].clone()
    assign = torch.full((n,), -1, dtype=torch.long)
    for _ in range(iters):
        # squared distances by one product (cdist's pairwise loop is slow on a CPU)
        dist = (x * x).sum(1, keepdim=True) - 2 * x @ centres.t() + (centres * centres).sum(1)
        new = _assign(dist, size)
        if torch.equal(new, assign):
            break
        assign = new
        centres = F.one_hot(assign, groups).float().t() @ x / size
    return assign


def _assign(dist: torch.Tensor, size: int) -> torch.Tensor:
    """(n,) each row's group under the capacity `size`: (row, group) pairs taken in order of distance (n, groups),
    a pair kept while its row is unplaced and its group not full."""
    n, groups = dist.shape
    group_of = [-1] * n
    fill = [0] * groups
    placed = 0
    for flat in torch.argsort(dist.flatten()).tolist():
        row, g = divmod(flat, groups)
        if group_of[row] < 0 and fill[g] < size:
            group_of[row] = g
            fill[g] += 1
            placed += 1
            if placed == n:
                break
    return torch.tensor(group_of)


# the calibration tokens whose activations the neurons are clustered on: enough to tell neurons apart, while the
# profiles of one layer (I x tokens) stay small
PROFILE_TOKENS = 2048


@torch.no_grad()
def group_all_layers(model, ids: torch.Tensor, mask: torch.Tensor, experts: int, seed: int,
                     shared: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, the shared expert's neurons (`shared` of them, sorted: `shared_neurons`) and (E, (I - shared) / E)
    the routed experts' neurons, sorted (`group_neurons` on the others), both on the first PROFILE_TOKENS
    calibration tokens, in one forward pass."""
    rows = max(1, int((mask.sum(-1).cumsum(0) < PROFILE_TOKENS).sum()))
    carved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    downs = [layer.mlp.down_proj.weight for layer in model.model.layers]

    def carve(layer: int, x: torch.Tensor, h: torch.Tensor) -> None:
        common = shared_neurons(h, downs[layer], shared)
        rest = torch.ones(h.shape[1], dtype=torch.bool)
        rest[common] = False
        others = torch.nonzero(rest).flatten()
        carved[layer] = common, others[group_neurons(h[:, others], experts, seed)]

    each_layer(model, ids[:rows], mask[:rows], carve, batch=rows)
    return [carved[layer][0] for layer in sorted(carved)], [carved[layer][1] for layer in sorted(carved)]


def shared_neurons(h: torch.Tensor, down: torch.Tensor, count: int) -> torch.Tensor:
    """The `count` neurons, sorted, with the largest mean contribution |h_i| * ||down[:, i]|| over the tokens of h
    (N, I): those that carry most of the MLP's output on most tokens, run for every token as the shared expert."""
    importance = (h.abs() * down.norm(dim=0)).mean(0)
    return importance.topk(count).indices.sort().values


def group_neurons(h: torch.Tensor, experts: int, seed: int) -> torch.Tensor:
    """(E, I / E) the neurons of each expert, sorted, from the activations h (N tokens, I neurons): a balanced
    k-means of the neurons' magnitude profiles |h[:, i]| scaled to unit length (so distance is 1 - their cosine:
    co-activation), putting neurons that are large on the same tokens in the same expert."""
    profiles = h.abs().t().float()
    profiles = profiles / profiles.norm(dim=1, keepdim=True).clamp_min(1e-12)
    assign = balanced_kmeans(profiles, experts, seed=seed)
    return torch.stack([torch.nonzero(assign == g).flatten() for g in range(experts)])


# ----------------------------------------------------------------------------- step 2: fit the routers
@torch.no_grad()
def fit_routers(model, ids: torch.Tensor, mask: torch.Tensor, groups: list[torch.Tensor],
                ridge: float = 1e-3) -> tuple[list[torch.Tensor], list[float]]:
    """Per layer, the (E, H) linear map from the MLP's input x to each expert's log contribution norm
    log ||down_e h_e|| (less the token's mean over experts), fitted by ridge regression on the calibration tokens (normal equations summed over batches, then solved); and
    the spread of its predictions across experts, the root mean square over tokens of their standard deviation
    (from the same sums): dividing the logits by it puts every layer's router on one scale (`choose_scale`)."""
    xtx: dict[int, torch.Tensor] = {}
    xty: dict[int, torch.Tensor] = {}
    downs = [layer.mlp.down_proj.weight for layer in model.model.layers]

    def add(layer: int, x: torch.Tensor, h: torch.Tensor) -> None:
        g = groups[layer]  # (E, I/E)
        parts = h[:, g].permute(1, 0, 2)  # (E, N, I/E): each expert's neurons
        contrib = torch.bmm(parts, downs[layer][:, g].permute(1, 2, 0)).norm(dim=-1).t().double()  # (N, E)
        # the top-k only ranks a token's experts: fit each one's log contribution relative to the token's mean, so
        # that tokens whose MLP output is thousands of times the usual (the first token's massive activations)
        # weigh in the fit as much as any other, and their ranking is learnt too
        target = contrib.clamp_min(1e-12).log()
        target = target - target.mean(-1, keepdim=True)
        xd = x.double()
        xtx[layer] = xtx.get(layer, 0) + xd.t() @ xd
        xty[layer] = xty.get(layer, 0) + xd.t() @ target

    each_layer(model, ids, mask, add)
    tokens = int(mask.sum())
    routers, spreads = [], []
    for layer in range(len(xtx)):
        a = xtx[layer]
        w = torch.linalg.solve(a + ridge * a.diagonal().mean() * torch.eye(a.shape[0], dtype=a.dtype), xty[layer]).t()
        second = w @ a @ w.t() / tokens  # (E, E): mean over tokens of y_e y_f, y = the predictions
        experts = w.shape[0]
        variance = second.trace() / experts - second.sum() / experts**2  # mean over tokens of the variance across E
        routers.append(w.float())
        spreads.append(float(variance.clamp_min(0).sqrt()))
    return routers, spreads


# ----------------------------------------------------------------------------- step 3: the MoE checkpoint
def _dense_shape(dense_config, experts: int, shared: int) -> dict:
    """The dense Llama's shape, attention and RoPE as keyword arguments of a MoE config; ConfigError where the dense
    model is not one a MoE here can hold (top_k in [1, experts] is the config's rule: gspo/config/checks.py)."""
    from gspo.config.checks import split_width_problem

    c = dense_config
    if c.model_type not in DENSE_FAMILIES:
        raise ConfigError(f"model.split_experts: {c.model_type} is not a dense family Mixtral's attention "
                          f"reproduces (supported: {', '.join(DENSE_FAMILIES)})")
    if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
        raise ConfigError("model.split_experts: the dense model has attention or MLP biases, which Mixtral has not")
    problem = split_width_problem(c.intermediate_size, experts, shared)
    if problem:
        raise ConfigError(problem)
    return dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None), hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_parameters=dict(c.rope_parameters), tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id,
        attention_dropout=c.attention_dropout, output_router_logits=False)


def check_shape(dense_config, settings: SplitExpertsConfig) -> None:
    """ConfigError in one line where `settings` cannot split the dense model of `dense_config`."""
    _dense_shape(dense_config, settings.experts, settings.shared)


def mixtral_config(dense_config, experts: int, top_k: int):
    """The MixtralConfig of the split model: the dense Llama's shape, attention and RoPE, E experts of
    intermediate_size / E neurons each, top-k."""
    from transformers import MixtralConfig

    return MixtralConfig(**_dense_shape(dense_config, experts, 0),
                         intermediate_size=dense_config.intermediate_size // experts, sliding_window=None,
                         num_local_experts=experts, num_experts_per_tok=top_k, router_jitter_noise=0.0,
                         architectures=["MixtralForCausalLM"])


def qwen2moe_config(dense_config, experts: int, top_k: int, shared: int):
    """The Qwen2MoeConfig of the split model with a shared expert of `shared` neurons: the dense Llama's shape and
    RoPE, q/k/v without biases (then Qwen2-MoE's attention is Llama's), every layer a MoE of E routed experts of
    (intermediate_size - shared) / E neurons, top-k with their weights renormalised (as Mixtral's)."""
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(**_dense_shape(dense_config, experts, shared), qkv_bias=False,
                          intermediate_size=dense_config.intermediate_size,
                          moe_intermediate_size=(dense_config.intermediate_size - shared) // experts,
                          shared_expert_intermediate_size=shared, num_experts=experts, num_experts_per_tok=top_k,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False,
                          architectures=["Qwen2MoeForCausalLM"])


@torch.no_grad()
def to_mixtral(dense, groups: list[torch.Tensor], routers: list[torch.Tensor], top_k: int,
               scales: Optional[list[float]] = None):
    """The MixtralForCausalLM computing `dense` with each layer's MLP split into the experts `groups[l]` (E, I/E),
    routed by `routers[l]` (E, H) times `scales[l]` (1 where None). Every other weight is the dense one, copied.
    Each expert's down projection carries the factor top_k that Mixtral's renormalised top-k weights (summing to
    1, about 1/k each) take away from the dense sum (weight 1 per neuron)."""
    return to_moe(dense, None, groups, routers, top_k, scales)


@torch.no_grad()
def to_moe(dense, shared: Optional[list[torch.Tensor]], groups: list[torch.Tensor], routers: list[torch.Tensor],
           top_k: int, scales: Optional[list[float]] = None):
    """The MoE computing `dense` with each layer's MLP split into the routed experts `groups[l]` (E, m) and, where
    `shared` is given and not empty, an always-on shared expert of the neurons `shared[l]`: a MixtralForCausalLM
    without one, a Qwen2MoeForCausalLM with one. Routers `routers[l]` (E, H) times `scales[l]` (1 where None);
    every other weight the dense one, copied. Each routed expert's down projection carries the factor top_k that
    the renormalised top-k weights (summing to 1, about 1/k each) take away from the dense sum (weight 1 per
    neuron); the shared expert's the factor 2 its gate, sigmoid(0) = 1/2 (its weights zero), takes away."""
    from transformers import MixtralForCausalLM, Qwen2MoeForCausalLM

    experts = groups[0].shape[0]
    width = int(shared[0].numel()) if shared else 0
    if width:
        config, cls = qwen2moe_config(dense.config, experts, top_k, width), Qwen2MoeForCausalLM
    else:
        config, cls = mixtral_config(dense.config, experts, top_k), MixtralForCausalLM
    config._attn_implementation = dense.config._attn_implementation
    moe = cls(config).to(next(dense.parameters()).dtype)
    state = {k: v for k, v in dense.state_dict().items() if ".mlp." not in k}
    missing, unexpected = moe.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    for layer, (src, dst) in enumerate(zip(dense.model.layers, moe.model.layers)):
        g = groups[layer]
        gate, up, down = src.mlp.gate_proj.weight, src.mlp.up_proj.weight, src.mlp.down_proj.weight
        dst.mlp.experts.gate_up_proj.copy_(torch.cat([gate[g], up[g]], dim=1))  # (E, 2m, H): gate rows, then up
        dst.mlp.experts.down_proj.copy_(down[:, g].permute(1, 0, 2) * top_k)  # (E, H, m)
        dst.mlp.gate.weight.copy_(routers[layer] * (1.0 if scales is None else scales[layer]))
        if width:
            s = shared[layer]
            dst.mlp.shared_expert.gate_proj.weight.copy_(gate[s])
            dst.mlp.shared_expert.up_proj.weight.copy_(up[s])
            dst.mlp.shared_expert.down_proj.weight.copy_(down[:, s] * 2)
            dst.mlp.shared_expert_gate.weight.zero_()
    if config.tie_word_embeddings:
        moe.tie_weights()
    return moe.eval()


# ----------------------------------------------------------------------------- the routers' scale
# the logit spreads tried: the typical spread across experts of a token's router logits, in nats; small keeps the
# chosen experts' weights near 1/k (select, hardly rescale), large lets the router weigh them
SCALES = (0.01, 0.03, 0.1)


@torch.no_grad()
def choose_scale(dense_logps: list[torch.Tensor], moe, routers: list[torch.Tensor], spreads: list[float],
                 ids: torch.Tensor, mask: torch.Tensor, log: Callable[[str], None]) -> tuple[float, dict[float, float]]:
    """The logit spread of SCALES whose MoE is closest to the dense model (next-token KL on `ids`, where the dense
    model's log-probs are `dense_logps`: `batched_logps`), set into `moe`'s routers; and the KL of each spread
    tried."""
    kls = {}
    for spread in SCALES:
        _set_routers(moe, routers, [spread / max(s, 1e-12) for s in spreads])
        kls[spread] = next_token_kl(dense_logps, moe, ids, mask)
        log(f"gspo: split experts: router logit spread {spread}: KL(dense || MoE) {kls[spread]:.4f} per token")
    best = min(kls, key=kls.get)
    _set_routers(moe, routers, [best / max(s, 1e-12) for s in spreads])
    return best, kls


def _set_routers(moe, routers: list[torch.Tensor], scales: list[float]) -> None:
    with torch.no_grad():
        for layer, r, s in zip(moe.model.layers, routers, scales):
            layer.mlp.gate.weight.copy_(r * s)


# ----------------------------------------------------------------------------- the split as a file
RECIPE = "split.safetensors"  # the name every build writes its recipe under, beside its checkpoint
RECIPE_FORMAT = "gspo-split-experts-1"


@torch.no_grad()
def recipe_of(dense, moe) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The decisions that made `moe` from `dense`, read back from the two models: each layer's neuron groups
    (E, I/E), found by matching every expert's gate rows to the dense gate's rows, and its router's weights (E, H)
    as they are (scaled). `to_mixtral(dense, *recipe_of(dense, moe), top_k)` is `moe` again, bit for bit. ValueError
    where an expert's rows are not the dense model's (a recovered split: its experts were trained)."""
    groups, routers = [], []
    for layer, (src, dst) in enumerate(zip(dense.model.layers, moe.model.layers)):
        gate = src.mlp.gate_proj.weight
        experts, width = dst.mlp.experts.gate_up_proj.shape[0], gate.shape[0] // dst.mlp.experts.gate_up_proj.shape[0]
        where = {row.numpy().tobytes(): i for i, row in enumerate(gate.float().cpu())}
        rows = dst.mlp.experts.gate_up_proj[:, :width].reshape(-1, gate.shape[1]).float().cpu()
        found = [where.get(row.numpy().tobytes(), -1) for row in rows]
        if len(where) != gate.shape[0] or -1 in found or len(set(found)) != len(found):
            raise ValueError(f"layer {layer}: the experts' rows are not the dense MLP's neurons, each once (a split "
                             "with recovery has no recipe)")
        groups.append(torch.tensor(found, dtype=torch.int32).view(experts, width))
        routers.append(dst.mlp.gate.weight.detach().float().cpu().clone())
    return groups, routers


def weights_digest(model) -> str:
    """sha256 of a model's weights, by name, shape, dtype and value (not of the files that hold them, whose bytes
    depend on the writer): the dense model a recipe applies to."""
    digest = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def save_recipe(path: Path, groups: list[torch.Tensor], routers: list[torch.Tensor], dense: str,
                record: dict) -> None:
    """`groups` and `routers` (`recipe_of`) as a safetensors file, with the digest of the dense weights it applies
    to (`weights_digest`) and the build's `record`."""
    from safetensors.torch import save_file

    tensors = {f"layers.{i}.{name}": t.contiguous() for i, (g, r) in enumerate(zip(groups, routers))
               for name, t in (("groups", g), ("router", r))}
    save_file(tensors, str(path), metadata={"format": RECIPE_FORMAT, "dense": dense, "record": json.dumps(record)})


def from_recipe(dense, path: Path, settings: SplitExpertsConfig, digest: str) -> tuple[object, dict]:
    """The MixtralForCausalLM the recipe at `path` (`save_recipe`) makes from `dense` (whose `weights_digest` is
    `digest`) at `settings.top_k`, and its record (the recipe's build record under `recipe_record`). ConfigError in
    one line where the recipe is for other dense weights or another number of experts or layers."""
    from safetensors import safe_open

    key = "model.split_experts.recipe"
    with safe_open(str(path), "pt") as fh:
        meta = fh.metadata() or {}
        if meta.get("format") != RECIPE_FORMAT:
            raise ConfigError(f"{key}={settings.recipe}: not a split recipe ({RECIPE_FORMAT}): make one with a build, "
                              f"which writes {RECIPE} beside its checkpoint")
        tensors = {name: fh.get_tensor(name) for name in fh.keys()}
    if meta.get("dense") != digest:
        raise ConfigError(f"{key}={settings.recipe}: made from other dense weights than model.path's (sha256 "
                          f"{meta.get('dense', '?')[:12]}... against {digest[:12]}...)")
    layers = len(dense.model.layers)
    groups = [tensors[f"layers.{i}.groups"].long() for i in range(layers) if f"layers.{i}.groups" in tensors]
    routers = [tensors[f"layers.{i}.router"] for i in range(layers) if f"layers.{i}.router" in tensors]
    if len(groups) != layers or len(tensors) != 2 * layers or groups[0].shape[0] != settings.experts:
        raise ConfigError(f"{key}={settings.recipe}: a split of {len(tensors) // 2} layers into "
                          f"{groups[0].shape[0] if groups else 0} experts, not of this model's {layers} layers into "
                          f"model.split_experts.experts={settings.experts}")
    moe = to_mixtral(dense, groups, routers, settings.top_k)
    return moe, {"settings": settings.__dict__, "recipe_record": json.loads(meta.get("record", "{}"))}


# ----------------------------------------------------------------------------- the whole construction
# held-out calibration tokens the KL to the dense model is measured on, at most: their dense log-probs are kept for
# every KL of the build, one float per vocabulary entry a token (2,048 x SmolLM2's 49,152: 400 MB)
HELD_TOKENS = 2048


def _save_carve(path: Path, moe, shared: list[torch.Tensor], groups: list[torch.Tensor], record: dict) -> None:
    """The split before any recovery (each layer's shared and routed neurons, its router as scaled) and its record
    so far, for an interrupted build to continue from (`_load_carve`)."""
    from safetensors.torch import save_file

    tensors = {}
    for i, (s, g, layer) in enumerate(zip(shared, groups, moe.model.layers)):
        tensors |= {f"{i}.shared": s.contiguous(), f"{i}.groups": g.contiguous(),
                    f"{i}.router": layer.mlp.gate.weight.detach().clone()}
    save_file(tensors, str(path), metadata={"record": json.dumps(record)})


def _load_carve(dense, path: Path, top_k: int) -> tuple[object, dict]:
    """The MoE `_save_carve` wrote the decisions of, made from `dense` again, and that build's record so far."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as fh:
        done = json.loads((fh.metadata() or {})["record"])
        t = {name: fh.get_tensor(name) for name in fh.keys()}
    layers = range(len(dense.model.layers))
    return to_moe(dense, [t[f"{i}.shared"] for i in layers], [t[f"{i}.groups"] for i in layers],
                  [t[f"{i}.router"] for i in layers], top_k), done


def split(dense, ids: torch.Tensor, mask: torch.Tensor, settings: SplitExpertsConfig,
          log: Callable[[str], None] = print, state_dir: Optional[Path] = None) -> tuple[object, dict]:
    """The MoE split from `dense` (a LlamaForCausalLM) as `settings` ask (a MixtralForCausalLM; with a shared expert
    a Qwen2MoeForCausalLM), on the calibration text `ids` (right-padded, `mask` 1 on its real tokens: the caller's,
    gspo/train/start/split_moe.py `calibration_ids`), and a record of the construction (its settings, the
    calibration tokens, the router scale chosen, the KL to the dense model on the held-out eighth of the calibration
    text (HELD_TOKENS of it at most), seconds per phase). Given `state_dir`, the split before recovery and each
    layer the layer-wise recovery finishes are kept there, and an interrupted build continues from them."""
    check_shape(dense.config, settings)  # refuse what cannot be split, before any work
    record: dict = {"settings": settings.__dict__, "seconds": {}}
    clock = time.time()

    def lap(name: str, done: str) -> None:
        nonlocal clock
        record["seconds"][name] = round(time.time() - clock, 1)
        log(f"gspo: split experts: {done} ({record['seconds'][name]:.0f} s)")
        clock = time.time()

    held, held_mask = ids[-max(1, len(ids) // 8):], mask[-max(1, len(ids) // 8):]  # kept out of the fit: the scale
    ids, mask = ids[: len(ids) - len(held)], mask[: len(ids) - len(held)]
    record["calibration_tokens"] = int(mask.sum()) + int(held_mask.sum())
    rows = max(1, int((held_mask.sum(-1).cumsum(0) <= HELD_TOKENS).sum()))  # the KL's share of them
    held, held_mask = held[:rows], held_mask[:rows]
    held_logps = batched_logps(dense, held, held_mask)  # the dense model on the held-out text, for every KL below
    if state_dir is not None:
        state_dir.mkdir(parents=True, exist_ok=True)
    carved = state_dir / "carve.safetensors" if state_dir is not None else None
    if carved is not None and carved.is_file():
        moe, done = _load_carve(dense, carved, settings.top_k)
        record.update(done)
        log(f"gspo: split experts: the split of an interrupted build reused ({carved})")
    else:
        shared, groups = group_all_layers(dense, ids, mask, settings.experts, settings.seed, settings.shared)
        lap("grouping", f"neurons grouped into {settings.experts} experts per layer"
                        + (f" beside a shared expert of {settings.shared}" if settings.shared else ""))
        routers, spreads = fit_routers(dense, ids, mask, groups)
        lap("routers", "routers fitted")
        moe = to_moe(dense, shared, groups, routers, settings.top_k)
        spread, kls = choose_scale(held_logps, moe, routers, spreads, held, held_mask, log)
        record.update(router_logit_spread=spread, kl_by_spread=kls, kl_to_dense=kls[spread])
        lap("scale", f"router logit spread {spread} chosen")
        if carved is not None:
            _save_carve(carved, moe, shared, groups, record)
    if settings.layerwise_epochs:
        record["layerwise"] = recover_layers(dense, moe, ids, mask, settings.layerwise_epochs, settings.layerwise_lr,
                                             settings.seed, state_dir, log=log)
        record["kl_to_dense_before_layerwise"] = record["kl_to_dense"]
        record["kl_to_dense"] = next_token_kl(held_logps, moe, held, held_mask)
        lap("layerwise", f"layer-wise recovery: KL(dense || MoE) {record['kl_to_dense_before_layerwise']:.4f} -> "
                         f"{record['kl_to_dense']:.4f} per token on held-out calibration text")
    if settings.recovery_epochs:
        record["kl_to_dense_before_recovery"] = record["kl_to_dense"]
        record["recovery_train_kl"] = recover(dense, moe, ids, mask, settings.recovery_epochs, settings.recovery_lr,
                                              log=log)
        record["kl_to_dense"] = next_token_kl(held_logps, moe, held, held_mask)
        lap("recovery", f"recovered: KL(dense || MoE) {record['kl_to_dense_before_recovery']:.4f} -> "
                        f"{record['kl_to_dense']:.4f} per token on held-out calibration text")
    return moe, record


