"""The split MoE a run starts from (`model.split_experts`): its calibration text, and the split built once, cached.

The construction itself (neurons grouped, routers fitted, the Mixtral checkpoint, the recipe file) is
gspo/models/split_experts.py's, on the tensors it is given. Here is what a run adds: the calibration text, which the
dense model writes itself (`calibration_ids`: a user's message from the chat template's opening, then its answer,
sampled by gspo's own decoder), so no data is read or downloaded; and the cache. The built checkpoint is cached like
the dense GGUF copy (gspo/models/gguf.py, gspo/core/cache.py): in `cache_dir/moe-<dense name>-<key>/`, keyed by the
content of the dense checkpoint's files it reads or copies (weights, config, tokenizer and chat template, generation
config: `keyed_files`), the construction's settings and what builds it (BUILD_VERSION, torch, transformers), written
once under a lock, renamed into place when complete. With `model.split_experts.recipe` the split is made from a
recipe file instead (gspo/models/split_experts.py `from_recipe`): the same bytes on any machine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from gspo.config.model_path import split_recipe
from gspo.config.schema import SplitExpertsConfig
from gspo.core.cache import build_once, file_sha256
from gspo.core.provenance import cpu, machine
from gspo.models import split_experts
from gspo.models.build import load_pretrained

BUILD_VERSION = 1  # bump when what is built changes, so stale copies are rebuilt


def settings_of(scfg) -> SplitExpertsConfig:
    """`model.split_experts` (a config node, or a mapping of its keys) as the schema's dataclass, each value of its
    type (a key the node lacks, from a config saved before the key existed: its default)."""
    values = {}
    for f in dataclasses.fields(SplitExpertsConfig):
        value = scfg.get(f.name, f.default)
        values[f.name] = value if value is None or f.name == "recipe" else type(f.default)(value)
    return SplitExpertsConfig(**values)


def keyed(settings: SplitExpertsConfig) -> dict:
    """What of the settings decides the build: from a recipe, the file's content (`_key`) and top_k; else all of
    them but the parts that do not run (no recovery, no layer-wise recovery, no shared expert: then their settings
    stay out, and a build made before they existed keeps its key)."""
    if settings.recipe:
        return {"experts": settings.experts, "top_k": settings.top_k}
    idle = set() if settings.recovery_epochs else {"recovery_epochs", "recovery_lr"}
    idle |= set() if settings.layerwise_epochs else {"layerwise_epochs", "layerwise_lr"}
    idle |= set() if settings.shared else {"shared"}
    return {k: v for k, v in settings.__dict__.items() if k != "recipe" and k not in idle}


# ----------------------------------------------------------------------------- calibration text
@torch.no_grad()
def calibration_ids(model, tokenizer, sequences: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask), each (sequences, <= length), right-padded: conversations the model writes itself, sampled by
    gspo's own sampler at temperature 1.

    The model first writes a user's message after the chat template's opening (its system prompt, `user`), then
    answers it as the assistant; the calibration text is the whole conversation. Where the tokenizer has no chat
    template, the model writes from its BOS token, once."""
    from gspo.rollout.decoding.generate import encode_prompts

    gen = torch.Generator().manual_seed(seed)
    opening = _chat_opening(tokenizer)
    rows: list[list[int]] = []
    for start in range(0, sequences, CALIBRATION_CHUNK):  # (the same draws as one batch up to CALIBRATION_CHUNK)
        count = min(CALIBRATION_CHUNK, sequences - start)
        if not tokenizer.chat_template:
            rows += [opening + c for c in _completions(model, tokenizer, [opening] * count, length, gen)]
            continue
        users = _completions(model, tokenizer, [opening] * count, length // 3, gen)
        texts = [tokenizer.decode(ids, skip_special_tokens=True).strip() for ids in users]
        prompts = encode_prompts(tokenizer, texts, chat_template=True)
        answers = _completions(model, tokenizer, prompts, max(1, length - max(map(len, prompts))), gen)
        rows += [p + a for p, a in zip(prompts, answers)]
    return _rows(rows, tokenizer, length)


# conversations sampled at once: a batch's KV cache stays small (hundreds of MB for SmolLM2) however many are asked
CALIBRATION_CHUNK = 64


def _completions(model, tokenizer, prompts: list[list[int]], new: int, gen: torch.Generator) -> list[list[int]]:
    """Up to `new` tokens sampled after each prompt (temperature 1, the fast engine where it serves the model),
    without their EOS."""
    from gspo.rollout.decoding.generate import generate
    from gspo.rollout.decoding.params import SamplingParams

    ro = generate(model, tokenizer, None, 1, SamplingParams(new, engine="auto"), generator=gen, prompt_ids=prompts)
    out = ro.input_ids[:, ro.prompt_len :]
    keep = ro.completion_mask.bool() & ~torch.isin(out, torch.tensor([tokenizer.eos_token_id]))
    return [row[k].tolist() for row, k in zip(out, keep)]


def _rows(rows: list[list[int]], tokenizer, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (ids, mask) of `rows`, each cut to `length` tokens: every row starts at position 0."""
    rows = [r[:length] for r in rows]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id or 0, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids, mask


def _chat_opening(tokenizer) -> list[int]:
    """The tokens before a user's message in the chat template (its default system prompt, the user's turn), or
    the BOS token (EOS where there is none) without a template."""
    if not tokenizer.chat_template:
        return [tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id]
    marker = "\u2063MSG\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    return tokenizer(text.split(marker)[0], add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------- the whole construction, cached
def build(dense, tokenizer, settings: SplitExpertsConfig, log: Callable[[str], None] = print,
          state_dir: Optional[Path] = None) -> tuple[object, dict]:
    """The MoE split from `dense` (a LlamaForCausalLM) as `settings` ask, on calibration text it writes itself
    (`calibration_ids`), and a record of the construction (gspo/models/split_experts.py `split`: its settings, the
    router scale chosen, the KL to the dense model on held-out calibration text, seconds per phase, the
    calibration's first). `state_dir`: where the calibration text and a layer-wise recovery's finished layers are
    kept (a build interrupted midway continues there)."""
    split_experts.check_shape(dense.config, settings)  # refuse before any work
    t0 = time.time()
    torch.manual_seed(settings.seed)
    kept = state_dir / "calibration.pt" if state_dir is not None else None
    if kept is not None and kept.is_file():
        ids, mask = torch.load(kept)
    else:
        ids, mask = calibration_ids(dense, tokenizer, settings.calibration_sequences, settings.calibration_tokens,
                                    settings.seed)
        if kept is not None:
            torch.save((ids, mask), kept)
    seconds = round(time.time() - t0, 1)
    log(f"gspo: split experts: {int(mask.sum())} tokens of calibration text the model wrote ({seconds:.0f} s)")
    moe, record = split_experts.split(dense, ids, mask, settings, log, state_dir)
    record["seconds"] = {"calibration": seconds, **record["seconds"]}
    return moe, record


def checkpoint(dense_dir: Path, scfg, cache_dir: str | Path, log: Optional[Callable[[str], None]] = print) -> Path:
    """The split checkpoint of the dense checkpoint `dense_dir` (`model.split_experts` = `scfg`), built on first use
    into `cache_dir/moe-<dense name>-<key>/` (the key: the content of the dense files it reads or copies, the
    settings, what builds it)."""
    settings = settings_of(scfg)
    recipe = split_recipe(settings.recipe) if settings.recipe else None  # (with recovery: refused by the checks)
    key = _key(dense_dir, settings, recipe)
    target = Path(cache_dir) / f"moe-{dense_dir.name}-{key}"
    quiet = log is None or int(os.environ.get("RANK", "0")) != 0
    t0 = time.time()

    def write(tmp: Path) -> None:
        dense, tokenizer = load_pretrained(dense_dir, torch.float32, "sdpa")
        digest = split_experts.weights_digest(dense)
        if recipe is not None:
            moe, record = split_experts.from_recipe(dense.eval(), recipe, settings, digest)
        else:
            moe, record = build(dense.eval(), tokenizer, settings, log=(lambda m: None) if log is None else log,
                                state_dir=_partial_dir(target) if settings.layerwise_epochs else None)
        if not (settings.recovery_epochs or settings.layerwise_epochs or settings.shared):
            # the split's decisions, to make the same split anywhere (a Mixtral's without recovery)
            split_experts.save_recipe(tmp / split_experts.RECIPE, *split_experts.recipe_of(dense, moe), digest,
                                      record.get("recipe_record", record))
        moe.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _copy_generation_config(dense_dir, tmp)
        record.update(dense=str(dense_dir), key=key, total_seconds=round(time.time() - t0, 1), **_written_by(),
                      machine=machine())
        (tmp / "split_experts.json").write_text(json.dumps(record, indent=1))

    if build_once(target, write):
        shutil.rmtree(target.with_name(target.name + ".partial"), ignore_errors=True)
        if log is not None:
            how = f" by the recipe {recipe}" if recipe is not None else ""
            log(f"gspo: model.split_experts: {settings.experts} experts, top-{settings.top_k}, built from {dense_dir}"
                f"{how} in {time.time() - t0:.0f} s into {target} (every later run reuses it)")
    elif not quiet:
        log(f"gspo: model.split_experts: reusing {target} ({settings.experts} experts, top-{settings.top_k})")
    return target


def _partial_dir(target: Path) -> Path:
    """Where a layer-wise recovery of `target` keeps its finished layers until the build completes: kept from an
    interrupted build on this machine (the calibration text, which is sampled, is the same here), emptied where it
    came from another CPU model."""
    partial = target.with_name(target.name + ".partial")
    stamp, here = partial / "cpu.json", {**cpu(), "torch": torch.__version__}
    if partial.is_dir() and (not stamp.is_file() or json.loads(stamp.read_text()) != here):
        shutil.rmtree(target.with_name(target.name + ".partial"), ignore_errors=True)
    partial.mkdir(parents=True, exist_ok=True)
    stamp.write_text(json.dumps(here))
    return partial


def _copy_generation_config(src: Path, dst: Path) -> None:
    """The dense checkpoint's generation_config.json (its end tokens), beside the split one."""
    if (src / "generation_config.json").is_file():
        shutil.copy(src / "generation_config.json", dst / "generation_config.json")


def _written_by() -> dict:
    import transformers

    return {"version": BUILD_VERSION, "torch": torch.__version__, "transformers": transformers.__version__}


# The dense checkpoint's files a build reads or copies, as globs in its directory: its weights and config (loaded),
# its tokenizer and chat template (loaded, the calibration text rendered with the template, and saved beside the
# split), its generation config (copied: the end tokens). Not records such as a GGUF copy's gguf.json, which holds
# its timings: the key of the same checkpoint is the same on every machine.
KEYED_FILES = ("config.json", "*.safetensors", "*.safetensors.index.json", "generation_config.json",
               "tokenizer*", "special_tokens_map.json", "added_tokens.json", "chat_template.*",
               "additional_chat_templates/*", "vocab.*", "merges.txt", "*.model", "*.tiktoken")


def keyed_files(dense_dir: Path) -> list[Path]:
    """The files of `dense_dir` that decide the split checkpoint (KEYED_FILES), sorted by their path in it."""
    found = {p for pattern in KEYED_FILES for p in dense_dir.glob(pattern) if p.is_file()}
    return sorted(found, key=lambda p: p.relative_to(dense_dir).as_posix())


def _key(dense_dir: Path, settings: SplitExpertsConfig, recipe: Optional[Path] = None) -> str:
    """What decides the split checkpoint's bytes: the dense checkpoint's files it reads or copies (their content:
    `keyed_files`), the settings (from a recipe: its content), and what builds it (the calibration text is sampled
    by torch, the model classes are transformers')."""
    files = {p.relative_to(dense_dir).as_posix(): file_sha256(p) for p in keyed_files(dense_dir)}
    blob = {"files": files, "settings": keyed(settings), **_written_by()}
    if recipe is not None:
        blob["recipe"] = file_sha256(recipe)
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]
