"""The benchmark scripts' helpers (scripts/bench_*.py): the work they set up must be the work they claim.

The scripts are not a package; they are imported from scripts/ as they import each other.
Smoke runs of the scripts themselves are marked slow.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import REPO, child_env

SCRIPTS = REPO / "scripts"
sys.path.insert(0, str(SCRIPTS))

import bench_common as bc  # noqa: E402
import bench_floor as bf  # noqa: E402
import bench_gpu as bg  # noqa: E402
import bench_workers as bw  # noqa: E402

from gspo.config.loading import compose  # noqa: E402
from gspo.rollout.decoding.generate import Rollout, generate, token_logprobs  # noqa: E402
from gspo.rollout.decoding.params import SamplingParams

ALPHABET = "0123456789+="
SHAPE = dict(vocab=64, hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16, intermediate=64, tie=True)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, router_aux_loss_coef=0.001)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bench-model")
    model, tok = bc.random_model(SHAPE, ALPHABET, seed=0)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_never_ending_tokenizer_puts_eos_one_past_the_model_vocabulary():
    tok = bc.never_ending_tokenizer(ALPHABET, 100)
    assert len(tok) == 101 and tok.eos_token_id == 100 and tok.pad_token_id == 0
    ids = tok("12+3=", add_special_tokens=False)["input_ids"]
    assert len(ids) == 5 and max(ids) < 100 and tok.unk_token_id not in ids
    assert tok.decode(ids) == "12+3="
    assert bc.never_ending_tokenizer(ALPHABET).eos_token_id == 2 + len(ALPHABET)  # smallest: pad, unk, characters
    with pytest.raises(ValueError, match="model_vocab=5"):
        bc.never_ending_tokenizer(ALPHABET, 5)


def test_random_model_has_the_asked_shape_and_no_eos_row():
    model, tok = bc.random_model(dict(SHAPE, vocab=80), ALPHABET, seed=0, moe=MOE)
    assert model.config.vocab_size == 80 == model.get_output_embeddings().weight.shape[0] == tok.eos_token_id
    assert model.config.num_experts == 4 and model.config.eos_token_id is None


def test_every_completion_runs_to_full_length_in_gspo_and_in_the_floor(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(0)
    ro = generate(model, tok, ["1+2=", "33+4="], 8, SamplingParams(12))
    assert ro.completion_mask.shape == (16, 12) and bool(ro.completion_mask.all()) and bool(ro.truncated.all())
    ids, mask = bf.left_pad([tok("1+2=")["input_ids"], tok("33+4=")["input_ids"]], tok.pad_token_id)
    comp, comp_mask = bf.sample(model, ids, mask, 12, tok.eos_token_id, tok.pad_token_id, 1.0,
                                torch.Generator().manual_seed(0))
    assert comp.shape == (2, 12) and bool(comp_mask.all())


class ScriptedLM(torch.nn.Module):
    """Emits row i's script one token per forward (then token 0), whatever the input."""

    def __init__(self, script: list[list[int]], vocab: int = 8):
        super().__init__()
        self.script, self.vocab, self.calls = script, vocab, 0

    def forward(self, input_ids, attention_mask, position_ids, past_key_values=None, use_cache=True, **_):
        t, self.calls = self.calls, self.calls + 1
        logits = torch.full((input_ids.shape[0], 1, self.vocab), -1e9)
        for i, s in enumerate(self.script):
            logits[i, -1, s[t] if t < len(s) else 0] = 0.0
        return SimpleNamespace(logits=logits, past_key_values=None)


def test_floor_sampler_masks_up_to_the_first_eos_and_stops_when_every_row_has_one():
    eos, pad = 7, 0
    lm = ScriptedLM([[3, eos, 4, 4], [5, 5, eos, 4], [eos, 4, 4, 4]])
    ids, mask = bf.left_pad([[1, 2], [1], [2, 2, 2]], pad)
    comp, comp_mask = bf.sample(lm, ids, mask, 6, eos, pad, 1.0, torch.Generator().manual_seed(0))
    assert comp.tolist() == [[3, eos, pad], [5, 5, eos], [eos, pad, pad]]  # rows after their EOS get pad
    assert comp_mask.tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0]]
    assert lm.calls == 3  # prefill + 2 steps: everyone is done after the third token


def _rollout(model, tok, group: int = 3, t: int = 6) -> Rollout:
    torch.manual_seed(1)
    return generate(model, tok, ["1+2=", "45+67=", "8="], group, SamplingParams(t))


def test_floor_log_probs_and_their_gradients_equal_gspo_token_logprobs(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)
    ro = _rollout(model, tok)
    m = ro.completion_mask
    ours, _ = bf.completion_logprobs(model, ro.input_ids, ro.attention_mask, ro.prompt_len)
    (ours * m).sum().backward()
    g_ours = model.model.embed_tokens.weight.grad.clone()
    model.zero_grad()
    theirs = token_logprobs(model, ro, 1.0)[0]
    (theirs * m).sum().backward()
    torch.testing.assert_close(ours * m, theirs * m, rtol=0, atol=1e-5)
    torch.testing.assert_close(g_ours, model.model.embed_tokens.weight.grad, rtol=1e-4, atol=1e-6)


def test_kv_cache_replay_matches_a_full_forward_in_float32(model_dir):
    """The GPU script's stand-in for sampler log-probs computes the same numbers as the trainer in float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)
    ro = _rollout(model, tok)
    with torch.no_grad():
        replay, full = bg.replay_logprobs(model, ro), token_logprobs(model, ro, 1.0)[0]
    assert replay.shape == full.shape == ro.completion_mask.shape
    torch.testing.assert_close(replay, full, rtol=0, atol=1e-5)


def test_mismatch_stats_against_hand_computed_numbers():
    sampler = torch.zeros(2, 3)
    trainer = torch.tensor([[0.001, -0.003, 9.0], [0.0002, 0.0002, 0.0002]])  # 9.0 sits on a masked position
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    s = bg.mismatch_stats(sampler, trainer, mask, clip=(3e-4, 4e-4))
    assert s["tokens"] == 5
    assert s["token_abs_diff_mean"] == pytest.approx((0.001 + 0.003 + 3 * 0.0002) / 5)
    assert s["token_abs_diff_max"] == pytest.approx(0.003)
    # per sequence: mean d = -0.001 (ratio 0.9990, below 1 - 3e-4: outside) and 0.0002 (inside)
    assert s["seq_abs_diff_mean"] == pytest.approx((0.001 + 0.0002) / 2)
    assert s["seq_abs_diff_max"] == pytest.approx(0.001)
    assert s["seq_outside_clip_frac"] == 0.5
    k3 = lambda d: torch.expm1(torch.tensor(d, dtype=torch.float64)).item() - d  # noqa: E731
    assert s["k3_mean"] == pytest.approx((k3(0.001) + k3(-0.003) + 3 * k3(0.0002)) / 5, rel=1e-6)


def _work(**kw) -> Namespace:
    a = dict(variant="toy", steps=None, prompts=None, group=None, max_new_tokens=None, minibatches=None, rounds=None,
             seed=0, threads=1, eval_size=4, override=[])
    a.update(kw)
    ns = Namespace(**a)
    bc.resolve_work(ns)
    return ns


def test_variants_take_their_defaults_and_flags_win():
    a = _work(variant="vocab")
    assert (a.prompts, a.group, a.max_new_tokens, a.minibatches) == (4, 8, 64, 2)
    a = _work(variant="long64", prompts=2)
    assert (a.prompts, a.group, a.max_new_tokens, a.minibatches) == (2, 8, 64, 4)
    with pytest.raises(SystemExit, match="divide"):
        _work(prompts=3, group=3, minibatches=2)


def test_gspo_overrides_compose_and_extra_overrides_win(model_dir):
    a = _work(variant="long16", override=["algo.eps_high=5e-4"])
    cfg = compose(bc.gspo_overrides(a, model_dir))
    assert cfg.algo.name == "gspo" and cfg.algo.eps_low == 3e-4 and cfg.algo.eps_high == 5e-4
    assert (cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.rollout.max_new_tokens) == (16, 8, 16)
    assert (cfg.train.minibatches, cfg.train.lr, cfg.train.warmup_steps) == (4, bc.LR, 0)
    assert cfg.model.path == str(model_dir) and cfg.hardware.dtype == "float32" and cfg.hardware.threads == 1
    gpu = compose(bc.gspo_overrides(a, model_dir, ["hardware=gpu"]))
    assert gpu.hardware.device == "cuda" and gpu.hardware.dtype == "bfloat16"


def test_trl_gets_the_same_gspo_settings(model_dir, tmp_path):
    pytest.importorskip("trl")
    cfg = compose(bc.gspo_overrides(_work(variant="long16"), model_dir))
    args = bw.trl_args(cfg, model_dir, tmp_path, "cpu", bf16=False)
    assert (args.importance_sampling_level, args.loss_type, args.epsilon, args.epsilon_high, args.beta) == \
        ("sequence", "grpo", 3e-4, 4e-4, 0.0)
    assert (args.per_device_train_batch_size, args.steps_per_generation, args.num_generations) == (32, 4, 8)
    assert (args.max_completion_length, args.learning_rate, args.max_grad_norm, args.max_steps) == (16, bc.LR, 1.0, 40)
    assert not args.gradient_checkpointing and args.router_aux_loss_coef is None  # a dense model: no aux loss
    with pytest.raises(SystemExit, match="no equivalent of algo.loss=dapo"):
        bw.trl_args(compose(bc.gspo_overrides(_work(override=["algo=dapo"]), model_dir)), model_dir, tmp_path, "cpu",
                    bf16=False)


def test_pooled_statistics_drop_each_runs_warm_up_and_tables_show_ratios():
    runs = [bc.Run([9.0, 1.0, 3.0], 100.0, 0.0, {"len": [0, 5, 7]}), bc.Run([8.0, 2.0], 120.0, 0.0, {"len": [0, 6]})]
    assert bc.pooled(runs) == [1.0, 3.0, 2.0] and bc.pooled(runs, "len") == [5, 7, 6]
    assert bc.median_after_warmup(runs[0]) == 2.0
    assert bc.ratio(0.5, 2.0) == "**0.25**" and bc.ratio(None, 1.0) == "—"
    table = bc.markdown_table(["a", "b"], [["x", "1"]])
    assert table.splitlines() == ["| a | b |", "|---|---:|", "| x | 1 |"]


def test_workers_keep_the_callers_pythonpath(monkeypatch):
    """On the GPU machine the carried wheels sit on PYTHONPATH: the workers must see them too."""
    monkeypatch.setenv("PYTHONPATH", "/tmp/site")
    env = bc.child_env(3)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(bc.ROOT), "/tmp/site"] and env["OMP_NUM_THREADS"] == "3"


def _wheel(path: Path, name: str, version: str, requires: list[str]) -> Path:
    import zipfile

    meta = "\n".join([f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)])
    with zipfile.ZipFile(path / f"{name}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta)
    return path / f"{name}-{version}-py3-none-any.whl"


def test_bench_env_names_missing_and_mismatched_requirements(tmp_path, capsys):
    from importlib import metadata

    import bench_env

    pytest_version = metadata.version("pytest")
    w = _wheel(tmp_path, "pytest", pytest_version,  # a wheel of what is installed: its own version matches
               ["torch>=1.0", "no-such-package-xyz>=1", "torch<0.1", "assumed-pkg>=2", "assumed-unknown",
                'only-on-old-python; python_version < "3.0"', 'an-extra-only; extra == "docs"'])
    problems = bench_env.check([w], {"assumed-pkg": "1.5", "assumed-unknown": None})
    assert sorted(problems) == sorted([
        f"pytest {pytest_version} needs no-such-package-xyz>=1: not installed",
        f"pytest {pytest_version} needs torch<0.1: found {metadata.version('torch')}",
        f"pytest {pytest_version} needs assumed-pkg>=2: found 1.5",
    ])
    assert "assumed-unknown: present, version unknown" in capsys.readouterr().out
    stale = _wheel(tmp_path, "pytest", "0.0.1", [])  # Python would import another version than the wheel's
    assert bench_env.check([stale], {})[0].startswith("pytest-0.0.1-py3-none-any.whl: Python sees pytest")


# --------------------------------------------------------------------------- smoke runs of the scripts


def _script(*args: str, timeout: int = 900) -> str:
    env = child_env()
    p = subprocess.run([sys.executable, *args], cwd=SCRIPTS.parent, env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


TINY_CPU = ["--steps", "2", "--rounds", "1", "--threads", "1", "--wait-idle", "0", "--retries", "0",
            "--prompts", "2", "--group", "2", "--minibatches", "2"]


@pytest.mark.slow
def test_bench_vs_trl_prints_one_table_at_a_small_size():
    pytest.importorskip("trl")
    old_attention = ["--model-override", "model.head_dim=16", "--model-override", "model.num_kv_heads=2"]
    out = _script("scripts/bench_vs_trl.py", "--variant", "long16", *old_attention, *TINY_CPU)
    assert "| **gspo sync / TRL** |" in out and "| **gspo async / TRL** |" in out and "| TRL GRPOTrainer |" in out
    assert out.count("| 16.0 |") == 3  # every trainer saw full-length completions (gspo async: one worker)
    assert "model preset changed: model.head_dim=16 model.num_kv_heads=2" in out


@pytest.mark.slow
def test_bench_floor_prints_one_table_at_a_small_size():
    trl = importlib.util.find_spec("trl") is not None  # with TRL beside them where it is installed
    out = _script("scripts/bench_floor.py", "--variant", "vocab", "--vocab-size", "512", "--hidden", "32",
                  "--max-new-tokens", "8", *TINY_CPU, *(["--trl"] if trl else []))
    assert "| **gspo / floor** |" in out and out.count("| 8.0 |") == 2 + trl
    assert ("| **gspo / TRL** |" in out and "| **floor / TRL** |" in out) == trl


@pytest.mark.slow
def test_bench_gpu_tiny_writes_every_measurement(tmp_path):
    pytest.importorskip("trl")
    out = _script("scripts/bench_gpu.py", "--tiny", "--models", "moe", "--out", str(tmp_path / "r.json"))
    res = json.loads((tmp_path / "r.json").read_text())["models"]["moe"]
    assert set(res) >= {"rollout", "mismatch", "step"} and res["mismatch"]["float32"]["token_abs_diff_max"] < 1e-4
    assert len(res["step"]["trl"]) == len(res["step"]["gspo"]) == 1
    for title in ("Rollout", "Time per RL step", "Peak memory", "Sampler vs trainer"):
        assert title in out


def test_floor_sampler_draws_the_same_tokens_through_the_fast_engine():
    """The floor decodes through gspo's engine when `rollout.engine` picks fast (MoE: the batched experts)."""
    model, tok = bc.random_model(SHAPE, ALPHABET, seed=0, moe=MOE)
    model.eval()
    ids, mask = bf.left_pad([[1, 2, 3], [4, 5], [6]] * 4, tok.pad_token_id)
    with torch.no_grad():
        hf, fast = (bf.sample(model, ids, mask, 24, tok.eos_token_id, tok.pad_token_id, 0.8,
                              torch.Generator().manual_seed(0), engine) for engine in ("hf", "fast"))
    assert torch.equal(hf[0], fast[0]) and torch.equal(hf[1], fast[1]) and hf[0].shape[1] == 24


@pytest.mark.slow
def test_bench_options_prints_one_row_per_side_with_its_ratio_to_the_first():
    out = _script("scripts/bench_options.py", "--variant", "long16", *TINY_CPU, "--option", "grouped",
                  "--option", "eager model.experts_implementation=eager")
    assert "| grouped | (none) |" in out and "| eager | model.experts_implementation=eager |" in out
    assert out.count("| 16.0 |") == 2 and "| **1.00** |" in out  # equal work; the first side is the unit


def test_bench_options_refuses_fewer_than_two_sides_and_a_missing_or_repeated_name():
    import bench_options

    for flags in (["a"], ["a x=1", "a y=2"], ["a", ""]):
        with pytest.raises(SystemExit):
            bench_options.options(type("A", (), {"option": flags})())
    assert bench_options.options(type("A", (), {"option": ["a", "b k=v j=w"]})()) == {"a": [], "b": ["k=v", "j=w"]}


def test_profile_table_nests_parts_and_the_rest_is_what_no_child_accounts_for():
    import profile_step as ps

    t = ps.Timers()
    for label, ms in {"rollout": 60, "generate": 50, "decode steps (fast engine)": 40, "scoring (task verifier, reward)": 4,
                      "update": 100, "backward": 30}.items():
        t.seconds[label][2] = ms / 1e3
        t.seconds[label][1] = 9.0  # the warm-up step: left out
    out = ps.table(t, [9.0, 0.160])
    lines = {line.split("|")[1].strip().replace("&nbsp;", ""): line.split("|")[2].strip() for line in out.splitlines()[2:]}
    assert lines["**step** (`time/step_s`)"] == "160.0" and lines["rollout"] == "60.0" and lines["update"] == "100.0"
    rests = [line.split("|")[2].strip() for line in out.splitlines() if "(rest)" in line]
    # decode - its LM head; generate - prefill - decode - draws; rollout - generate - scoring; the two forwards'
    # (nothing timed); backward - its LM head; update - its parts
    assert rests == ["40.0", "10.0", "6.0", "0.0", "0.0", "30.0", "70.0"]
    assert "| 25% |" in out  # decode: 40 of 160 ms


@pytest.mark.slow
def test_profile_step_prints_every_part_at_a_small_size():
    out = _script("scripts/profile_step.py", "--variant", "long16", "--steps", "3", "--threads", "1", "--prompts", "2",
                  "--group", "2", "--minibatches", "2", "--max-new-tokens", "4")
    import profile_step as ps

    for label, *_ in ps.PARTS:
        assert label in out
    assert "**step** (`time/step_s`)" in out
