"""A GGUF file as an ordinary checkpoint: dequantized once by transformers, cached by its content.

transformers reads a GGUF file (`from_pretrained(dir, gguf_file=NAME)`, with the `gguf` package) into an
ordinary float32 model, but that model says it is quantized (`save_pretrained` refuses it) and has no
`architectures`. gspo dequantizes it once into `cache_dir/gguf-<name>-<key>/`: safetensors weights, a config
with `architectures` set, the tokenizer and its chat template, as `save_pretrained` writes them. Every later run,
evaluation, rollout worker, distillation teacher and the vLLM engine load that directory like any checkpoint.
The key is the file's content hash and what writes the copy (CACHE_VERSION, the transformers and gguf versions):
a changed file, or a copy written by other code, is never reused; a new one is made beside it.

One process writes a copy while the others that want it (the ranks of a DDP run, the jobs of a sweep sharing
cache_dir) wait on its lock file and then reuse it: dequantizing holds the whole float32 model in memory, once.
Written to a temporary directory and renamed, so nothing ever sees half of one (gspo/core/cache.py `build_once`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np
import torch

from gspo.config import model_path
from gspo.core.cache import build_once, file_sha256

# bump when what is written changes (2: the key holds what writes the copy; 3: the header's eos and pad tokens win,
# so that a copy transformers 5.17-5.18 wrote with <|im_start|> as eos is not reused under the same key)
CACHE_VERSION = 3


def checkpoint_dir(path: str | Path, cache_dir: str | Path, log: Optional[Callable[[str], None]] = print,
                   key: str = "model.path") -> Path:
    """The checkpoint directory `path` names: the directory itself, or for a GGUF file (`pkg:` included:
    gspo/config/model_path.py) its dequantized copy in `cache_dir`, made on first use. `log` gets one line
    saying the model comes from a quantized file (None: silent); `key` is the option that named `path`
    (`model.path`, `teacher.path`), for that line and for errors."""
    source = model_path.gguf_file(path, key)
    if source is None:
        return model_path.resolve(path, key)
    written_by = _written_by()
    digest = file_sha256(source)
    name = hashlib.sha256(json.dumps({"sha256": digest, **written_by}, sort_keys=True).encode()).hexdigest()[:16]
    target = Path(cache_dir) / f"gguf-{source.stem}-{name}"
    t0, made = time.time(), {}

    def write(tmp: Path) -> None:
        made["kind"] = dequantize(source, tmp, key)
        (tmp / "gguf.json").write_text(json.dumps({"source": str(source), "sha256": digest, "file_type": made["kind"],
                                                   **written_by, "seconds": round(time.time() - t0, 1)}))

    if not build_once(target, write):
        _reused(path, target, log, key)
        return target
    if log is not None:
        log(f"gspo: {key}={path}: a GGUF file ({made['kind']}), dequantized to float32 by transformers in "
            f"{time.time() - t0:.0f} s into {target} (every later run reuses it)")
    return target


def _written_by() -> dict[str, str | int]:
    """What decides the copy's bytes besides the file: gspo's way of writing it (CACHE_VERSION), transformers (its
    GGUF loader maps the tensors and the config, its save_pretrained writes them) and gguf (its dequantization)."""
    from importlib import metadata

    import transformers

    try:
        gguf_version = metadata.version("gguf")
    except metadata.PackageNotFoundError:  # transformers then refuses the file, with its own message
        gguf_version = "none"
    return {"version": CACHE_VERSION, "transformers": transformers.__version__, "gguf": gguf_version}


def _reused(path: str | Path, target: Path, log: Optional[Callable[[str], None]], key: str) -> None:
    if log is not None and int(os.environ.get("RANK", "0")) == 0:
        log(f"gspo: {key}={path}: a GGUF file ({_kind(target)}), dequantized to float32 once: reusing {target}")


def tokenizer_of(path: str | Path):
    """The tokenizer of the model `model.path` names, read from the GGUF file itself when it is one (no
    dequantization: the config checks call it)."""
    from transformers import AutoTokenizer

    source = model_path.gguf_file(path)
    if source is None:
        return AutoTokenizer.from_pretrained(model_path.resolve(path))
    return _header_specials(AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name), source)


def _header_specials(tokenizer, source: Path):
    """The tokenizer with the end-of-sequence and padding tokens the file's header names. transformers 5.17 read a
    GGUF's eos as its bos (SmolLM2: `<|im_start|>` for `<|im_end|>`, so no completion would end); 5.19 reads it
    right. Set only where it differs."""
    header = model_path.gguf_header(source)
    for name, key in (("eos", "eos_token_id"), ("pad", "padding_token_id")):
        i = header.get(f"tokenizer.ggml.{key}")
        if isinstance(i, int) and 0 <= i < len(tokenizer) and getattr(tokenizer, f"{name}_token_id") != i:
            setattr(tokenizer, f"{name}_token", tokenizer.convert_ids_to_tokens(i))
    return tokenizer


def dequantize(source: Path, out: Path, key: str = "model.path") -> str:
    """Write the GGUF file `source` to `out` as a plain Hugging Face checkpoint (float32 safetensors, config with
    `architectures`, tokenizer with its chat template); the quantization it was stored in, as a name. `key`: the
    option that named the file, for errors."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gspo.core.errors import ConfigError

    from transformers import modeling_gguf_pytorch_utils as reader

    transformers.utils.logging.disable_progress_bar()
    bar = reader.tqdm
    reader.tqdm = functools.partial(bar, disable=True)  # its own per-tensor progress bar, between our lines
    try:
        with _parsed_once():
            model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
            tokenizer = _header_specials(AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name), source)
    except (ValueError, KeyError, RuntimeError) as e:  # an architecture or tensor type transformers cannot read
        raise ConfigError(f"{key}={source}: transformers cannot read this GGUF file "
                          f"({type(e).__name__}: {str(e).splitlines()[0]})") from None
    finally:
        reader.tqdm = bar
    # what marks it as quantized: transformers' GGUF loader dequantizes every tensor to the dtype asked for, so the
    # weights are ordinary float32 ones; without these marks save_pretrained writes them as such
    model.config.quantization_config = None
    del model.config.quantization_config
    model.hf_quantizer = None
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return _file_type(source)


@contextlib.contextmanager
def _parsed_once() -> Iterator[None]:
    """While the block runs, gguf's reader and tensor-name maps are built once per file / architecture: transformers
    parses the file's metadata (the whole vocabulary) anew for the config, the weights and the tokenizer, and builds
    the name map again for each of the model's ~400 modules; and the reader reads a plain array (PlainArrayReader).
    Dequantizing SmolLM2-135M on a loaded 2-core machine: 111 s with neither, 47 s with the first, 30 s with both;
    the bytes written unchanged. Both are read-only there; outside the block gguf is as it was."""
    try:
        import gguf
    except ImportError:  # transformers refuses the file, with its own message
        yield
        return
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}

    class PlainArrayReader(reader):
        """gguf's reader on the file's bytes as a plain array view of its memory map: parsing the vocabulary indexes
        them a few million times, and numpy's memmap subclass adds ~2 µs of bookkeeping to each, 60% of the parse.
        The same bytes, the same mapping."""

        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value):
            self._plain = value.view(np.ndarray)

    def read_once(path, mode="r"):
        k = (os.fspath(path), mode)
        if k not in readers:
            readers[k] = PlainArrayReader(path, mode)
        return readers[k]

    gguf.GGUFReader, gguf.get_tensor_name_map = read_once, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def _file_type(source: Path) -> str:
    """The GGUF's quantization as llama.cpp names it (`general.file_type`), e.g. Q4_1."""
    code = model_path.gguf_header(source).get("general.file_type")
    try:
        from gguf import LlamaFileType

        return LlamaFileType(code).name.removeprefix("MOSTLY_").removeprefix("ALL_") if code is not None else "file type unknown"
    except (ImportError, ValueError):
        return f"file type {code}"


def _kind(target: Path) -> str:
    try:
        return json.loads((target / "gguf.json").read_text())["file_type"]
    except (OSError, ValueError, KeyError):
        return "quantized"
