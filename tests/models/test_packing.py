"""`train.shared_prefix` (gspo/models/packing.py): a minibatch's forward with the prompt prefix its rows share
computed once. It changes the work, not the numbers: log-probs, entropies, gradients and MoE routing as the plain
forward's, on float64 models to 1e-6 (parts of these models compute in float32 whatever their dtype: their two
attention kernels alone differ by ~2e-7 in a log-prob; a token that saw another row, or a wrong position, is off
by orders of magnitude more)."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from gspo.models import moe as moe_lib
from gspo.models.packing import for_forward, pack, shared_prefix_len
from gspo.rollout.decoding.generate import token_logprobs
from tests.rollout.decoding.test_rollout import TOK, _qwen3, _sampled

# the end-to-end test's data file is small on purpose
pytestmark = pytest.mark.filterwarnings("ignore:task.path=.*held-out problems:UserWarning")

SHARED = "1234567890+"  # every prompt opens with it: 11 shared tokens


def test_pack_lays_rows_behind_their_shared_prefix():
    """Left-padded rows [prefix 0 1 2 | own tokens]: one forward row holds the prefix once, then each row's own
    tokens with their positions; `spread` and `source` map the two layouts onto each other."""
    ids = torch.tensor([[9, 9, 0, 1, 2, 5, 6],  # 9: padding
                        [0, 1, 2, 7, 8, 8, 3],
                        [9, 0, 1, 2, 4, 4, 9]])
    mask = (ids != 9).long()
    assert shared_prefix_len(ids, mask, prompt_len=5) == 2  # row 0's prompt has 3 tokens: its last stays with it
    p = pack(ids, mask, prompt_len=5, capacity=64, pad_id=9, min_prefix=1)
    p_ids = p.input_ids.reshape(-1)
    assert p.input_ids.tolist() == [[0, 1, 2, 5, 6, 2, 7, 8, 8, 3, 2, 4, 4]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 2, 3, 4]]
    real = mask.reshape(-1).bool()
    assert torch.equal(p_ids[p.spread][real], ids.reshape(-1)[real])  # every real token found where it went
    assert torch.equal(ids.reshape(-1)[p.source], p_ids)  # every packed token stands for a real one
    m = p.attention_mask[0, 0]
    assert m[6].tolist() == [True, True, False, False, False, True, True] + [False] * 6  # row 1's 2nd own token
    assert m[12].tolist() == [True, True] + [False] * 8 + [True, True, True]  # row 2's last token
    two = pack(ids, mask, prompt_len=5, capacity=10, pad_id=9, min_prefix=1)  # at most 10 tokens a forward row: rows 0+1, then 2
    assert two.input_ids.shape == (2, 10) and two.input_ids[1].tolist() == [0, 1, 2, 4, 4] + [9] * 5


def test_nothing_to_share_is_not_packed():
    ids = torch.tensor([[0] * 10 + [1, 2], [3] * 10 + [1, 2]])
    mask = torch.ones_like(ids)
    assert pack(ids, mask, prompt_len=10, capacity=64) is None  # no shared prefix
    holes = torch.tensor([[1] * 12, [1] * 5 + [0] + [1] * 6])
    same = torch.tensor([[5] * 12, [5] * 12])
    assert pack(same, holes, prompt_len=10, capacity=64) is None  # a masked column between real ones
    assert pack(same, torch.ones_like(same), prompt_len=10, capacity=12) is None  # one row per forward row


def _split_mixtral(prefix: str):
    """test_split_experts' tiny Llama split into a Mixtral (as model=smollm2_moe is made), float64, and a sampled
    rollout of prompts opening with `prefix`."""
    from gspo.train.start import split_moe
    from tests.models.test_split_experts import SETTINGS, _dense

    model, _ = split_moe.build(_dense(), TOK, SETTINGS, log=lambda m: None)
    model = model.double().eval()
    model.config._experts_implementation = "eager"  # (grouped_mm has no float64)
    return model, _sampled(model, True, prefix)


@pytest.mark.parametrize("arch,attention,capacity", [("qwen3", "sdpa", None), ("qwen3", "eager", None),
                                                      ("qwen3", "sdpa", 40), ("qwen3_moe", "sdpa", None),
                                                      ("mixtral", "sdpa", None)])
def test_a_packed_minibatch_has_the_plain_logprobs_gradients_and_routing(arch, attention, capacity):
    """Log-probs, entropies, top-k log-probs and the gradient of a loss on them, packed (one forward row, or
    several at a small capacity; SDPA's boolean mask or eager's additive one) against the plain forward (SDPA:
    eager's plain forward of left-padded rows is NaN on this model); MoE (Qwen3-MoE, and a dense Llama split into a
    Mixtral as model=smollm2_moe is): the routing replayed from the sampler's (R3) through `source`, and the routing
    recorded through `spread` is the plain forward's at every real token."""
    moe = arch != "qwen3"
    model, r = _split_mixtral(SHARED) if arch == "mixtral" else _qwen3(moe, SHARED)
    rows = torch.tensor([0, 2, 5, 7, 1])
    sub = r.select(rows)
    sub.topk_ids = torch.randint(0, len(TOK), (*sub.completion_mask.shape, 3), generator=torch.Generator().manual_seed(0))
    weights = torch.linspace(-1, 1, sub.completion_mask.numel(), dtype=torch.float64).view_as(sub.completion_mask)
    out = []
    for packed in (False, True):
        model.config._attn_implementation = attention if packed else "sdpa"
        p = for_forward(model, sub.input_ids, sub.attention_mask, sub.prompt_len, sub.pad_id, capacity) \
            if packed else None
        if packed:
            assert p is not None and p.input_ids.numel() < sub.input_ids.numel()
            assert (p.input_ids.shape[0] > 1) == bool(capacity)
        model.zero_grad()
        with contextlib.ExitStack() as stack:
            if moe:
                stack.enter_context(moe_lib.replay_routing(model, r.routing[rows], None if p is None else p.source))
                trace = stack.enter_context(moe_lib.capture_routing(model, spread=None if p is None else p.spread))
            logp, entropy, _, top = token_logprobs(model, sub, temperature=0.8, with_entropy=True, topk=True,
                                                   packing=p)
            ((logp * weights).sum() + entropy.sum()).backward()
        routing = (trace.indices(len(rows)), trace.logprobs(len(rows))) if moe else None
        out.append((logp, entropy, top, [q.grad.clone() for q in model.parameters()], routing))
    (logp, ent, top, grads, routing), (logp_p, ent_p, top_p, grads_p, routing_p) = out
    for a, b in ((logp_p, logp), (ent_p, ent), (top_p, top), *zip(grads_p, grads)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    if moe:
        real = sub.attention_mask.bool()
        assert torch.equal(routing_p[0][real], routing[0][real])
        torch.testing.assert_close(routing_p[1][real], routing[1][real], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("model", ["qwen3-tiny", "qwen3-moe"])
def test_a_run_with_a_shared_prefix_is_the_plain_run(model, tmp_path, cache_dir, monkeypatch):
    """train.shared_prefix end to end, at its default (on) against train.shared_prefix=false: prompts that open
    alike (a data file), a reward with a spread (so every update moves the weights), 2 steps of 2 minibatches each
    packed; every logged number (the MoE's routing statistics, R2 replaying the old policy's routing, its
    load-balancing loss) and the final weights are the plain run's to float32 rounding; summary.json says which
    forward each ran."""
    import gspo.train.loop.trainer as trainer_mod
    from transformers import AutoModelForCausalLM

    from gspo.config.loading import compose
    from gspo.train.run import checkpoint
    from gspo.train.loop.trainer import train
    from tests.conftest import tiny

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{SHARED}{i}+{i}=", "answer": str(2 * i)}) + "\n"
                            for i in range(500)))
    fns = tmp_path / "r.py"
    fns.write_text("def ones(completions, **kw):\n    return [c.count('1') / (1 + len(c)) for c in completions]\n")
    packings = []
    plain = trainer_mod.packed
    monkeypatch.setattr(trainer_mod, "packed", lambda *a, **k: packings.append(plain(*a, **k)) or packings[-1])
    runs = {}
    for shared in (False, True):
        moe = {"moe.routing_replay": "R2", "model.router_aux_loss_coef": 0.01} if model == "qwen3-moe" else {}
        overrides = {**moe, "model": model, "task": "data", "task.path": str(data), "reward": "python",
                     "reward.fn": f"{fns}:ones", "train.lr": 0.01, "rollout.max_new_tokens": 6}
        cfg = compose(tiny(cache_dir, **overrides, **({} if shared else {"train.shared_prefix": False})))
        assert cfg.train.shared_prefix is shared  # on: the default
        train(cfg, tmp_path / str(shared))
        runs[shared] = [json.loads(x) for x in (tmp_path / str(shared) / "metrics.jsonl").read_text().splitlines()]
        record = json.loads((tmp_path / str(shared) / "summary.json").read_text())["shared_prefix"]
        assert record.startswith("packed: ") if shared else record == "plain: train.shared_prefix=false", record
    assert len(packings) == 4 and all(p is not None for p in packings)  # 2 steps x 2 minibatches, all packed
    assert any(r.get("train/grad_norm", 0) > 0 for r in runs[True])
    for a, b in zip(runs[False], runs[True]):
        for key, value in a.items():
            if not key.startswith(("time/", "throughput/")):
                assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    weights = [AutoModelForCausalLM.from_pretrained(checkpoint.latest(tmp_path / str(s))).state_dict() for s in runs]
    for name, w in weights[0].items():
        torch.testing.assert_close(weights[1][name], w, atol=1e-5, rtol=1e-4)


def test_on_the_default_task_nothing_is_shared_so_a_default_run_is_the_plain_run(tmp_path, cache_dir, monkeypatch):
    """The shared prefix, on by default, leaves the default run as it was: its prompts (`a+b=`) share fewer than
    MIN_PREFIX leading tokens, so every minibatch runs the plain forward (the runs kept from before the default,
    docs/data/readme_sweep, are what the default computes)."""
    import gspo.train.loop.trainer as trainer_mod

    from gspo.config.loading import compose
    from gspo.train.loop.trainer import train
    from tests.conftest import tiny

    packings = []
    plain = trainer_mod.packed
    monkeypatch.setattr(trainer_mod, "packed", lambda *a, **k: packings.append(plain(*a, **k)) or packings[-1])
    cfg = compose(tiny(cache_dir))
    assert cfg.task.name == "addition" and cfg.train.shared_prefix is True
    train(cfg, tmp_path / "run")
    assert len(packings) == 4 and all(p is None for p in packings)  # asked every minibatch, none packed


# --------------------------------------------------------------------------- every family: exact, or plain

# (family, config overrides, packed?): tests/models/test_families.py's tiny models (2 layers, width 32), float64. A
# window written "longest" is the longest row of the batch (then it hides nothing: packed), "longest-1" one less
# (plain).
FAMILIES = [
    ("qwen3", {}, True), ("qwen3_moe", {}, True), ("llama", {}, True), ("gpt2", {}, True), ("phi3", {}, True),
    ("mixtral", {}, True), ("olmoe", {}, True), ("qwen2", {}, True), ("qwen2_moe", {}, True), ("granite", {}, True),
    # Qwen2-MoE as the split from SmolLM2 is to be: no q/k/v biases, renormalised top-k, layer 1 a dense MLP
    ("qwen2_moe", dict(qkv_bias=False, norm_topk_prob=True, mlp_only_layers=[1]), True),
    ("granitemoe", {}, True), ("cohere", {}, True), ("ernie4_5_moe", {}, True), ("gpt_oss", {}, True),
    ("deepseek_v3", {}, True), ("glm4_moe", {}, True), ("hunyuan_v1_moe", {}, True), ("afmoe", {}, True),
    ("phimoe", {}, True), ("jetmoe", {}, True),  # (a window of 64 where the config has one: wider than every row)
    ("mistral", dict(sliding_window=4), False), ("mistral", dict(sliding_window="longest"), True),
    ("mistral", dict(sliding_window="longest-1"), False),
    ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=0), False),
    ("qwen2", dict(use_sliding_window=True, sliding_window="longest", max_window_layers=0), True),
    ("gemma2", dict(sliding_window=4), False), ("gemma2", dict(sliding_window="longest"), True),
    ("gemma3_text", dict(sliding_window=4), False), ("gemma3_text", dict(sliding_window="longest"), True),
    ("gemma3_text", dict(sliding_window="longest-1"), False),
    ("falcon_h1", {}, False), ("jamba", {}, False), ("mamba", {}, False),
    ("qwen3_next", dict(linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                        linear_value_head_dim=8), False),  # (its gated DeltaNet 16 x 128 wide by default: slow)
    ("lfm2", dict(layer_types=["conv", "full_attention"]), False),
    ("llama4_text", {}, False), ("openai-gpt", {}, False),
]


@pytest.fixture(scope="module")
def family_rows():
    """Rows every family's tiny model reads (one character vocabulary): 4 prompts of one length opening with 13
    shared characters, 2 sampled completions each (uneven lengths), by a tiny Llama."""
    from gspo.rollout.decoding.generate import generate
    from gspo.rollout.decoding.params import SamplingParams
    from tests.models.test_families import tiny_model

    model, tok = tiny_model("llama")
    prompts = [f"# sum these:\n{p}" for p in ("1+2=", "3+4=", "5*6=", "7-8=")]
    with torch.no_grad():
        return generate(model, tok, prompts, 2, SamplingParams(6), generator=torch.Generator().manual_seed(0))


def _family_model(family: str, extra: dict, dtype: torch.dtype = torch.float64):
    """test_families' tiny model of `family` with `extra` config values, in `dtype` (float64 unless told), experts
    computed eagerly."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from gspo.models.build import char_tokenizer, choose_attention, normalise_config
    from tests.models.test_families import ALPHABET, EXTRA, SMALL

    tok = char_tokenizer(ALPHABET)
    base = AutoConfig.for_model(family).to_dict()
    kw = {k: v for k, v in SMALL.items() if k in base} | dict(
        vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id) | EXTRA.get(family, {}) | extra
    config = AutoConfig.for_model(family, **kw)
    normalise_config(config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, experts_implementation="eager")  # (grouped_mm: no float64)
    for r in moe_lib.find_routers(model):  # spread, so that routing is not a tie
        torch.nn.init.normal_(moe_lib.router_weight(r), std=1.0)
    model.config._attn_implementation = choose_attention(type(model), "auto")
    return model.to(dtype).eval()


def _windows(extra: dict, rows) -> dict:
    """`extra` with a window written "longest" ("longest-1") as the batch's longest row (one less)."""
    longest = int(rows.attention_mask.sum(-1).max())
    return {k: longest - (v == "longest-1") if isinstance(v, str) and v.startswith("longest") else v
            for k, v in extra.items()}


def _family_skip(family: str) -> None:
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if family not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {family}")


def _logprobs_and_grads(model, sub, packings) -> list[list[torch.Tensor]]:
    """For each packing (None: the plain forward), the log-probs, entropies and every parameter's gradient of a
    loss on them, as the update computes them."""
    dtype = next(model.parameters()).dtype
    weights = torch.linspace(-1, 1, sub.completion_mask.numel(), dtype=dtype).view_as(sub.completion_mask)
    out = []
    for packed in packings:
        model.zero_grad()
        logp, entropy, _ = token_logprobs(model, sub, temperature=0.8, with_entropy=True, packing=packed)
        ((logp * weights).sum() + entropy.sum()).backward()
        out.append([logp, entropy, *(q.grad.clone() for q in model.parameters() if q.grad is not None)])
    return out


def _case(family: str, extra: dict) -> str:
    """A case's id: the family, and its window or dense layers where it sets them."""
    return family + (f"-window{extra['sliding_window']}" if "sliding_window" in extra else "") + (
        f"-dense{'_'.join(map(str, extra['mlp_only_layers']))}" if "mlp_only_layers" in extra else "")


@pytest.mark.parametrize("family,extra,exact", FAMILIES, ids=[_case(f, e) for f, e, _ in FAMILIES])
def test_every_family_packs_exactly_or_says_once_that_it_runs_plain(family, extra, exact, family_rows, monkeypatch,
                                                                    capsys):
    """Where the shared prefix is taken, the packed log-probs, entropies and gradients are the plain forward's to
    1e-6 in float64; where it would not be exact (a sliding window shorter than a row, a recurrent, state-space or
    convolutional layer, an attention that reads no 4-D mask, a family never checked), `for_forward` gives None (the
    trainer's plain forward), said once in one line naming the model class and why."""
    from gspo.models import packing

    _family_skip(family)
    sub = family_rows
    extra = _windows(extra, sub)
    model = _family_model(family, extra)
    monkeypatch.setattr(packing, "_SAID", set())
    p = for_forward(model, sub.input_ids, sub.attention_mask, sub.prompt_len, sub.pad_id)
    if p is not None:  # packed: the plain forward's numbers (None: the trainer's forward is the plain one)
        out = _logprobs_and_grads(model, sub, (None, p))
        assert len(out[0]) == len(out[1]) > 2
        for a, b in zip(*out):
            torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-6)
    again = for_forward(model, sub.input_ids, sub.attention_mask, sub.prompt_len, sub.pad_id)  # (said only once)
    said = capsys.readouterr().err.splitlines()
    if exact:
        assert p is not None and p.input_ids.numel() < sub.input_ids.numel() and said == []
    else:
        assert p is None and again is None and len(said) == 1, said
        assert said[0].startswith(f"gspo: train.shared_prefix: off for {type(model).__name__}: ")
        assert said[0].endswith("; the plain forward is used")
        if "sliding_window" in extra:
            assert f"its sliding window ({extra['sliding_window']}) is not kept by a packed 4-D mask" in said[0]


# float32 rounding: torch's float32 tolerances (a relative 1.3e-6, about 11 units in the last place, or 1e-5 where a
# number is near 0: a gradient summed from terms of either sign keeps the rounding of the terms it sums). Packed, the
# products have other shapes and sum in another order; a token that saw another row is off by 1e-2 or more.
FLOAT32 = dict(rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("family,extra,exact", FAMILIES, ids=[
    f + (f"-window{e['sliding_window']}" if "sliding_window" in e else "") for f, e, _ in FAMILIES])
def test_at_the_defaults_the_update_is_the_plain_forward_to_float32_rounding(family, extra, exact, family_rows,
                                                                              monkeypatch, capsys):
    """The update as a run with no override takes it (train.shared_prefix on by default, the trainer's own call), on
    every family's tiny model built from config in float32: where the family packs, the update's log-probs,
    entropies and gradients are the plain forward's to float32 rounding; where it does not, the update runs the plain
    forward, said once in one line, and the run's record (summary.json's `shared_prefix`) says which ran."""
    import gspo.train.loop.trainer as trainer_mod
    from gspo.config.loading import compose
    from gspo.models import packing

    _family_skip(family)
    cfg = compose([])
    assert cfg.train.shared_prefix is True
    sub = family_rows
    extra = _windows(extra, sub)
    model = _family_model(family, extra, torch.float32)
    monkeypatch.setattr(packing, "_SAID", set())
    update = lambda: trainer_mod.packed(model, sub.input_ids, sub.attention_mask, sub.prompt_len, sub.pad_id) \
        if cfg.train.shared_prefix else None  # noqa: E731  (trainer.py's line)
    p, again = update(), update()
    said = capsys.readouterr().err.splitlines()
    record = packing.recorded(model, cfg.train.shared_prefix)
    if exact:
        assert p is not None and p.input_ids.numel() < sub.input_ids.numel() and said == []
        assert record.startswith("packed: ")
        plain, packed = _logprobs_and_grads(model, sub, (None, p))
        assert len(plain) == len(packed) > 2 and all(x.dtype == torch.float32 for x in plain)
        for a, b in zip(plain, packed):
            torch.testing.assert_close(b, a, **FLOAT32)
    else:
        assert p is None and again is None and len(said) == 1, said
        assert said[0].startswith(f"gspo: train.shared_prefix: off for {type(model).__name__}: ")
        window = "sliding_window" in extra  # decided per batch: the record says where it is plain
        assert record.startswith("packed: ") and f"sliding window ({extra['sliding_window']})" in record \
            if window else record == f"plain: {packing.why_plain(model, 0)}", record


def test_every_family_taken_as_exact_is_checked():
    """`EXACT_FAMILIES` is what the family test checks packed: a family added there without a case here fails."""
    from gspo.models.packing import EXACT_FAMILIES

    assert EXACT_FAMILIES == {f for f, _, exact in FAMILIES if exact}


def test_flash_attention_and_an_unknown_family_run_plain():
    """Flash attention reads no 4-D mask; a family never checked is plain until it is."""
    from types import SimpleNamespace

    from gspo.models import packing

    flash = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2", model_type="llama"))
    unknown = SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa", model_type="bloom"))
    assert "attention flash_attention_2 reads no 4-D mask" == packing.why_plain(flash, 10)
    assert "'bloom' is not a family" in packing.why_plain(unknown, 10)
