"""LoRA adapters through `peft`: `model.lora.r > 0` trains low-rank adapters, the base stays frozen.

What is adapted (`model.lora.target_modules` / `target_parameters`, matched by name suffix):

* attention `q_proj k_proj v_proj o_proj` and dense-MLP `gate_proj up_proj down_proj` (Qwen3, and the
  dense layers / shared experts of MoE models) are `nn.Linear`: ordinary LoRA layers;
* Qwen3-MoE experts in transformers 5 are NOT one `nn.Linear` per expert but two fused 3-D parameters,
  `mlp.experts.gate_up_proj` (E, 2I, H) and `mlp.experts.down_proj` (E, H, I). `target_modules` cannot reach
  them; peft's `target_parameters` can (`ParamWrapper`, peft >= 0.17): one rank-r adapter per expert,
  stored as lora_A (r*E, in) and lora_B (out, r*E). peft refuses dropout there, so `model.lora.dropout`
  must be 0 on such models. Entries that name nothing in the model are skipped, so one default list
  serves dense and MoE models; a list that names nothing at all is an error;
* MoE routers (`mlp.gate`, found by duck typing as `gspo.models.moe.find_routers` finds them) are NEVER adapted
  and stay frozen: adapting them would move the routing that Routing Replay and the routing statistics
  measure. A target that would reach one is refused.

The reference policy of the KL term (`algo.beta > 0`) is the same weights with the adapters disabled
(`reference`): no second copy of the model. Checkpoints hold the adapter (`adapter_model.safetensors`,
`adapter_config.json` naming the base by absolute path), loadable with `peft.PeftModel.from_pretrained`;
`model.lora.save_merged=true` also writes base + adapter merged into one plain checkpoint (`export_merged`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from gspo.core.errors import ConfigError
from gspo.models.moe import find_routers

ADAPTER_CONFIG = "adapter_config.json"
ROUTER_NAMES = ("gate", "router")  # module names HF MoE models give their routers (Qwen, Mixtral: gate; others: router)


def _names_router(target: str) -> bool:
    parts = target.split(".")
    if parts[-1] in ("weight", "bias") and len(parts) > 1:  # a parameter: its module's name decides
        parts = parts[:-1]
    return parts[-1] in ROUTER_NAMES


def check(cfg) -> None:
    """Before any work (`gspo.train.preflight.check`): model.lora.* values."""
    lora = cfg.model.lora
    if lora.r < 0:
        raise ConfigError(f"model.lora.r={lora.r}: the LoRA rank must be >= 0 (0 = off, full fine-tuning)")
    if lora.r == 0:
        for key in ("save_merged", "sample_merged"):
            if lora[key]:
                raise ConfigError(f"model.lora.{key}=true needs adapters: set model.lora.r > 0")
        return
    if lora.alpha is not None and not lora.alpha > 0:
        raise ConfigError(f"model.lora.alpha={lora.alpha}: must be > 0 (or null for 2 * r)")
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(f"model.lora.dropout={lora.dropout}: must be in [0, 1)")
    if not list(lora.target_modules) and not list(lora.target_parameters):
        raise ConfigError("model.lora.target_modules and model.lora.target_parameters are both empty: nothing to adapt")
    for t in [*lora.target_modules, *lora.target_parameters]:
        if _names_router(str(t)):
            raise ConfigError(f"model.lora: '{t}' names an MoE router; routers are never adapted "
                              "(they decide the routing that Routing Replay and moe/* metrics measure)")
    if lora.dropout > 0 and cfg.model.arch == "qwen3_moe" and list(lora.target_parameters):
        raise ConfigError(f"model.lora.dropout={lora.dropout}: peft cannot apply dropout to the fused MoE expert "
                          "weights (model.lora.target_parameters); use dropout 0 or target_parameters=[]")


def is_adapted(model) -> bool:
    """Whether `model` (or the module under a DDP wrapper) carries peft adapters."""
    peft = sys.modules.get("peft")  # not imported: no PeftModel exists (importing it costs a process ~0.5 s)
    return peft is not None and isinstance(getattr(model, "module", model), peft.PeftModel)


def _present(model: torch.nn.Module, targets, kind: str) -> list[str]:
    names = [n for n, _ in (model.named_parameters() if kind == "parameters" else model.named_modules())]
    return [t for t in targets if any(n == t or n.endswith("." + t) for n in names)]


def apply(model: torch.nn.Module, lora, base_dir: str | Path, seed: int = 0) -> torch.nn.Module:
    """`model` with LoRA adapters (a peft PeftModel, base frozen), or `model` itself when `lora.r == 0`.

    `base_dir` is recorded (absolute) in the adapter's config, so `PeftModel.from_pretrained` finds the base.
    The adapters' initialisation is seeded by `seed` without touching the global RNG.
    """
    if lora.r <= 0:
        return model
    from peft import get_peft_model

    routers = {id(r) for r in find_routers(model)}
    config = lora_config(model, lora)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, config)
    peft_model.peft_config["default"].base_model_name_or_path = str(Path(base_dir).resolve())
    _assert_routers_untouched(peft_model, routers)
    checkpointing = getattr(model, "is_activation_checkpointing", None)  # transformers 5 name; 4.x: is_gradient_...
    if checkpointing is None:
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    if checkpointing:
        # the frozen embedding would give checkpointed blocks inputs without grad: no gradient reaches the adapters
        peft_model.enable_input_require_grads()
    return peft_model


def tied_adapted(model: torch.nn.Module) -> list[tuple[str, str]]:
    """(adapted weight, the parameter it is tied to) for each weight LoRA adapts that the model shares with another
    of its parameters: an LM head tied to the input embeddings (tie_word_embeddings: the tiny models, Qwen3-0.6B,
    SmolLM2). None of a plain model."""
    if not is_adapted(model):
        return []
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    names: dict[int, list[str]] = {}
    for name, p in base.named_parameters(remove_duplicate=False):  # a tied weight under each of its names
        names.setdefault(id(p), []).append(name.replace(".base_layer", ""))
    out = []
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer) and module.active_adapters:
            param = getattr(module, "parameter_name", None) or "weight"
            shared = names.get(id(getattr(module.get_base_layer(), param, None)), [])
            own = f"{name.replace('.base_layer', '')}.{param}"
            others = [other for other in shared if other != own]
            if others:
                out.append((own, others[0]))
    return out


def check_mergeable(model: torch.nn.Module) -> None:
    """Refuse (ConfigError, one line) an adapter that no merged checkpoint can hold: one on a tied weight. Merged,
    its delta would reach every parameter the weight is tied to (the LM head's reaching the input embeddings), so
    a sampler serving merged weights (rollout.dtype, rollout.engine=vllm, rollout.workers) would compute another
    model than the trainer's, as would model.lora.save_merged's checkpoint."""
    tied = tied_adapted(model)
    if tied:
        own, other = tied[0]
        raise ConfigError(f"model.lora adapts {own}, which this model ties to {other}: merged weights (a sampler in "
                          "rollout.dtype, rollout.engine=vllm, rollout.workers, model.lora.save_merged) cannot hold "
                          f"that adapter without changing {other} too; leave it out of model.lora.target_modules, or "
                          "sample with the trainer's model")


def lora_config(model: torch.nn.Module, lora):
    """peft's LoraConfig for `model.lora.*` on `model` (the targets it holds; alpha None = 2 r): what `apply` adapts
    (the TRL benchmark worker hands the same one to TRL's `peft_config`)."""
    from peft import LoraConfig

    modules = _present(model, list(lora.target_modules), "modules")
    params = _present(model, list(lora.target_parameters), "parameters")
    if not modules and not params:
        from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers

        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, Conv1D))})
        raise ConfigError(f"model.lora.target_modules={list(lora.target_modules)} and target_parameters="
                          f"{list(lora.target_parameters)} name nothing in this model; its Linear modules: {', '.join(linear)}")
    if params and lora.dropout > 0:
        raise ConfigError(f"model.lora.dropout={lora.dropout}: peft cannot apply dropout to the fused MoE expert "
                          f"weights {params}; use dropout 0 or model.lora.target_parameters=[]")
    return LoraConfig(
        r=int(lora.r), lora_alpha=float(lora.alpha if lora.alpha is not None else 2 * lora.r),
        lora_dropout=float(lora.dropout), target_modules=modules or None, target_parameters=params or None,
        bias="none", task_type="CAUSAL_LM",
    )


def merged_parameters(model: torch.nn.Module, whole_only: bool = False):
    """(name, value, adapted) for every parameter of the plain model `merge_and_unload()` would give, without
    building it: W0 + ΔW (peft's own `get_delta_weight`, scaling included) where LoRA adapts the weight, the
    frozen base weight itself elsewhere (`adapted` False: it never changes, so a sampler copies it once).

    This is what a separate sampler (and a rollout worker) takes at every weight sync of a LoRA run: the
    adapted weights only, computed from the rank-r factors, instead of a deep copy of the model merged.
    A plain (not adapted) model: its own parameters, all `adapted` (they all train). An adapter on a tied weight
    is refused (`check_mergeable`): one name per tensor would carry its delta to the other name, or drop it.
    `whole_only`: only the parameters held whole on this process now, not FSDP2's DTensor shards (the
    weights of the one FSDP unit that is gathered: gspo/train/ranks/distributed.py `Dist.merged_parameters`).
    """
    plain = not is_adapted(model)
    for name, p, module in _plain_parameters(model):
        if whole_only and _is_shard(p):
            continue
        if module is None:
            yield name, p.detach(), plain
            continue
        with torch.no_grad():
            delta = sum(module.get_delta_weight(a) for a in module.active_adapters)
        yield name, p.detach() + delta.to(p.dtype), True


def merged_layout(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter `merged_parameters` yields, in its order, computing none (an FSDP2
    shard gives its whole shape)."""
    return [(name, tuple(p.shape)) for name, p, _ in _plain_parameters(model)]


def _plain_parameters(model: torch.nn.Module):
    """(the plain model's name, the parameter, the LoRA layer adapting it or None) for every parameter but the
    adapters' factors."""
    if not is_adapted(model):
        for name, p in model.named_parameters():
            yield name, p, None
        return
    check_mergeable(model)
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    strip = lambda name: name.replace(".base_layer", "")  # noqa: E731  (peft's wrappers: the plain model's name)
    adapted = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer) and module.active_adapters:
            param = getattr(module, "parameter_name", None)  # a ParamWrapper (fused MoE experts) adapts that one
            adapted[f"{strip(name)}.{param or 'weight'}"] = module
    for name, p in base.named_parameters():
        if ".lora_" not in name:
            yield strip(name), p, adapted.get(strip(name))


def _is_shard(t: torch.Tensor) -> bool:
    """Whether `t` is an FSDP2 shard (a DTensor) rather than a whole tensor."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _assert_routers_untouched(peft_model, routers: set[int]) -> None:
    from peft.tuners.lora import LoraLayer

    for name, m in peft_model.named_modules():
        base = m.get_base_layer() if isinstance(m, LoraLayer) else None
        if base is not None and any(r is base for r in find_routers(base)):
            raise ConfigError(f"model.lora: the adapter reached the MoE router {name}; routers are never adapted")
    for r in find_routers(peft_model):
        if id(r) not in routers or any(p.requires_grad for p in r.parameters()):
            raise ConfigError(f"model.lora: the MoE router {type(r).__name__} changed under peft; routers are never adapted")


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


class Reference:
    """The reference policy for the KL term: the adapted model with its adapters disabled.

    Callable like the model, so `token_logprobs(ref, ...)` works unchanged; it holds no weights of its own.
    """

    def __init__(self, model) -> None:
        self.model = getattr(model, "module", model)  # the PeftModel, under any DDP wrapper

    def __call__(self, *args, **kwargs):
        with self.model.disable_adapter():
            return self.model(*args, **kwargs)

    def get_output_embeddings(self):
        """The LM head (never adapted): gspo.models.logprobs hooks it to take log-probs instead of logits."""
        return self.model.get_output_embeddings()


def reference(model) -> Reference:
    """The KL reference of an adapted model: the base, i.e. the same weights with the adapters off."""
    if not is_adapted(model):
        raise TypeError("reference() needs a model with peft adapters (model.lora.r > 0)")
    return Reference(model)


# --------------------------------------------------------------------------- checkpoints


def is_adapter_dir(path: str | Path) -> bool:
    """Whether a checkpoint directory holds a peft adapter (rather than full weights)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def base_of(adapter_dir: str | Path) -> Path:
    """The base checkpoint an adapter was trained on (recorded in its adapter_config.json)."""
    base = json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base or not (Path(base) / "config.json").is_file():
        raise ConfigError(f"{adapter_dir}: the adapter's base model {base!r} is not a checkpoint directory here; "
                          "it is needed to load the adapter")
    return Path(base)


def save(model, directory: Path, state_dict: dict | None = None) -> None:
    """Write the adapter of `model` (a PeftModel) to `directory`: adapter_model.safetensors + adapter_config.json."""
    # save_embedding_layers=False: the embeddings are never adapted, and "auto" may query the Hub about the base
    model.save_pretrained(directory, safe_serialization=True, save_embedding_layers=False, state_dict=state_dict)


def write_adapter(model, directory: str | Path, dtype: torch.dtype) -> None:
    """The adapter of `model` (a PeftModel, under any DDP wrapper) as peft saves it, its factors cast to `dtype`,
    into `directory`: what an inference engine's LoRA loader reads (rollout.vllm.lora_push=adapter). The config
    never changes during a run: written once; the factors are rewritten at every call."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / ADAPTER_CONFIG).is_file():
        getattr(model, "module", model).peft_config["default"].save_pretrained(str(directory))
    save_file({k: v.detach().to(dtype).contiguous() for k, v in adapter_state(model).items()},
              str(directory / "adapter_model.safetensors"))


def adapter_state(model) -> dict[str, torch.Tensor]:
    """The adapter's factors of `model` (a PeftModel, under any DDP wrapper) under peft's saved names, whole: under
    FSDP2 each gathered from its shards (a collective: every rank calls it)."""
    from peft import get_peft_model_state_dict

    # save_embedding_layers=False: the embeddings are never adapted, and "auto" may query the Hub about the base
    state = get_peft_model_state_dict(getattr(model, "module", model), save_embedding_layers=False)
    return {k: v.full_tensor() if _is_shard(v) else v for k, v in state.items()}


def load_weights(model, adapter_dir: str | Path) -> None:
    """Load a saved adapter's weights into an adapted model (resume); every adapter tensor must match."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(getattr(model, "module", model), state)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise ConfigError(f"{adapter_dir}: the adapter does not match this run's model.lora settings "
                          f"(missing {missing[:3]}, unexpected {list(result.unexpected_keys)[:3]})")


def load(adapter_dir: str | Path, dtype: torch.dtype = torch.float32, attn: str = "auto", base_dir=None):
    """(PeftModel, tokenizer) from an adapter checkpoint; `base_dir` overrides the recorded base."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    from gspo.models.build import load_pretrained

    base, _ = load_pretrained(base_dir or base_of(adapter_dir), dtype, attn)
    tokenizer = AutoTokenizer.from_pretrained(adapter_dir)  # the run's own copy, saved beside the adapter
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=False), tokenizer


def export_merged(adapter_dir: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32,
                  base_dir=None) -> Path:
    """Base + adapter merged into one plain Hugging Face checkpoint at `out_dir` (written to a temp name, renamed).

    Loads a fresh base rather than merging into the training model: the merge is exact and the run's adapter
    stays as it is.
    """
    import os
    import shutil

    from gspo.core.files import temp_dir, widen_to_open_modes

    model, tokenizer = load(adapter_dir, dtype, base_dir=base_dir)
    merged = model.merge_and_unload()
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(out_dir.parent, prefix=".tmp-merged-")  # (the umask's mode, as the run's other files: not 0o700)
    merged.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    widen_to_open_modes(tmp)  # (safetensors writes its files owner-only)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.rename(tmp, out_dir)
    return out_dir
