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
from test_rollout import TOK, _qwen3, _sampled

from gspo.models import moe as moe_lib
from gspo.models.packing import for_forward, pack, shared_prefix_len
from gspo.rollout.generate import token_logprobs

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
    from test_split_experts import SETTINGS, _dense

    from gspo.train import split_experts

    model, _ = split_experts.build(_dense(), TOK, SETTINGS, log=lambda m: None)
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
    """train.shared_prefix end to end: prompts that open alike (a data file), a reward with a spread (so every
    update moves the weights), 2 steps of 2 minibatches each packed; every logged number (the MoE's routing
    statistics, R2 replaying the old policy's routing, its load-balancing loss) and the final weights are the plain
    run's to float32 rounding."""
    import gspo.train.trainer as trainer_mod
    from conftest import tiny
    from transformers import AutoModelForCausalLM

    from gspo.config.loading import compose
    from gspo.train import checkpoint
    from gspo.train.trainer import train

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
                     "reward.fn": f"{fns}:ones", "train.lr": 0.01, "rollout.max_new_tokens": 6,
                     "train.shared_prefix": shared}
        train(compose(tiny(cache_dir, **overrides)), tmp_path / str(shared))
        runs[shared] = [json.loads(x) for x in (tmp_path / str(shared) / "metrics.jsonl").read_text().splitlines()]
    assert len(packings) == 4 and all(p is not None for p in packings)  # 2 steps x 2 minibatches, all packed
    assert any(r.get("train/grad_norm", 0) > 0 for r in runs[True])
    for a, b in zip(runs[False], runs[True]):
        for key, value in a.items():
            if not key.startswith(("time/", "throughput/")):
                assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    weights = [AutoModelForCausalLM.from_pretrained(checkpoint.latest(tmp_path / str(s))).state_dict() for s in runs]
    for name, w in weights[0].items():
        torch.testing.assert_close(weights[1][name], w, atol=1e-5, rtol=1e-4)
