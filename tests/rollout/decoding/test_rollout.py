"""Rollout: EOS handling and masks, left padding, log-probs that ignore padding."""

import contextlib
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from gspo.config.schema import ModelConfig
from gspo.models.build import build_model, char_tokenizer
from gspo.rollout.decoding.generate import Rollout, cat_rollouts, generate, token_logprobs
from gspo.rollout.decoding.params import SamplingParams

TOK = char_tokenizer("0123456789+=")
EOS, PAD = TOK.eos_token_id, TOK.pad_token_id


class ScriptedLM(torch.nn.Module):
    """Emits, for row i, the tokens script[i] one per step (then EOS), whatever the input."""

    def __init__(self, script: list[list[int]]):
        super().__init__()
        self.script = script
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask, position_ids, past_key_values=None, use_cache=True, logits_to_keep=0):
        t = 0 if past_key_values is None else past_key_values + 1
        logits = torch.full((input_ids.shape[0], input_ids.shape[1], len(TOK)), -1e9)
        for i, s in enumerate(self.script):
            logits[i, -1, s[t] if t < len(s) else EOS] = 0.0
        return SimpleNamespace(logits=logits, past_key_values=t)


def tok(s):
    return TOK.convert_tokens_to_ids(list(s))


def test_masks_stop_at_the_first_eos_and_flag_truncation():
    script = [tok("12") + [EOS], tok("3") + [EOS, *tok("99")], tok("4567")]
    r = generate(ScriptedLM(script), TOK, ["1+1=", "2+22=", "3="], 1, SamplingParams(4, greedy=True))
    assert r.texts == ["12", "3", "4567"]
    assert r.completion_mask.tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]  # EOS counts as a token
    assert r.truncated.tolist() == [False, False, True]
    assert r.completion_ids[1].tolist() == [tok("3")[0], EOS, PAD, PAD]  # nothing after EOS survives
    # left padding: every prompt ends in the last prompt column
    assert r.prompt_len == 5
    assert r.attention_mask[:, :5].tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 1, 1]]
    assert r.input_ids[2, :3].tolist() == [PAD] * 3


def test_loop_stops_once_every_row_has_ended():
    r = generate(ScriptedLM([[EOS], tok("1") + [EOS]]), TOK, ["1=", "2="], 1, SamplingParams(8, greedy=True))
    assert r.completion_mask.shape[1] == 2


def test_groups_are_contiguous():
    r = generate(ScriptedLM([[EOS]] * 6), TOK, ["1=", "2=", "3="], 2, SamplingParams(2, greedy=True))
    assert r.prompt_index.tolist() == [0, 0, 1, 1, 2, 2]
    assert r.input_ids[0].tolist() == r.input_ids[1].tolist()


@pytest.fixture(scope="module")
def tiny_model():
    cfg = OmegaConf.structured(ModelConfig(name="t", arch="qwen3", hidden_size=32, num_heads=2, num_kv_heads=1,
                                           head_dim=16, intermediate_size=64, num_layers=2))
    return build_model(cfg, len(TOK), TOK, seed=0).eval()


def test_greedy_generation_ignores_left_padding(tiny_model):
    prompts = ["1+1=", "12+345=", "7="]
    batched = generate(tiny_model, TOK, prompts, 1, SamplingParams(6, greedy=True))
    alone = [generate(tiny_model, TOK, [p], 1, SamplingParams(6, greedy=True)).texts[0] for p in prompts]
    assert batched.texts == alone


def test_logprobs_match_kv_cached_sampling_and_ignore_padding(tiny_model):
    prompts = ["1+1=", "12+345="]
    r = generate(tiny_model, TOK, prompts, 2, SamplingParams(5), generator=torch.Generator().manual_seed(0))
    logp, entropy, _ = token_logprobs(tiny_model, r, temperature=0.7, with_entropy=True)
    assert logp.shape == r.completion_mask.shape and torch.all(entropy >= 0)
    for i in range(len(r.texts)):  # one row at a time, no padding at all
        n = int(r.completion_mask[i].sum())
        keep = r.attention_mask[i].bool()
        ids = r.input_ids[i][keep][None]
        logits = tiny_model(input_ids=ids).logits[0, -n - 1 : -1] / 0.7
        ref = torch.log_softmax(logits, -1).gather(-1, ids[0, -n:, None]).squeeze(-1)
        torch.testing.assert_close(logp[i, :n], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("engine", ["hf", "fast"])
def test_a_group_prefills_its_prompt_once_and_samples_what_every_row_prefilled_would(tiny_model, monkeypatch, engine):
    """The G rows of a prompt share it: one prefill row per prompt, its KV cache repeated G times. The
    completions, their sampler log-probs and the log-probs recomputed from them are those of prefilling
    every row (the fallback, used where the cache is not a plain key/value cache)."""
    import gspo.rollout.decoding.generate as gen

    prompts, g = ["1+1=", "12+345=", "7="], 4
    rows_seen = []
    hook = tiny_model.register_forward_pre_hook(lambda m, a, kw: rows_seen.append(kw["input_ids"].shape), with_kwargs=True)
    try:
        shared = generate(tiny_model, TOK, prompts, g, SamplingParams(6, engine=engine),
                          generator=torch.Generator().manual_seed(0))
        with monkeypatch.context() as m:
            m.setattr(gen, "_prefill_once_per_group", lambda *a: None)
            rows_seen.append("fallback")
            every = generate(tiny_model, TOK, prompts, g, SamplingParams(6, engine=engine),
                             generator=torch.Generator().manual_seed(0))
    finally:
        hook.remove()
    assert rows_seen[0] == (3, 7) and rows_seen[rows_seen.index("fallback") + 1] == (12, 7)  # P rows, then P x G
    assert shared.texts == every.texts and torch.equal(shared.completion_mask, every.completion_mask)
    torch.testing.assert_close(shared.sampler_logp, every.sampler_logp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(token_logprobs(tiny_model, shared)[0], token_logprobs(tiny_model, every)[0])


def test_cat_rollouts_repads_prompts_and_completions():
    a = generate(ScriptedLM([tok("1") + [EOS]]), TOK, ["1="], 1, SamplingParams(4, greedy=True))
    b = generate(ScriptedLM([tok("123")]), TOK, ["12+3="], 1, SamplingParams(3, greedy=True))
    c = cat_rollouts([a, b])
    assert c.prompt_len == 5 and c.completion_mask.shape == (2, 3)
    assert c.completion_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert c.attention_mask[0].tolist() == [0, 0, 0, 1, 1, 1, 1, 0]
    assert c.texts == ["1", "123"]


def test_special_token_inside_a_completion_is_ill_formed():
    """`1<pad>25` must not be scored as `125`: the verifier judges what the model wrote."""
    from gspo.tasks import Problem
    from gspo.tasks.arithmetic import Addition
    from gspo.tasks.rewards import score

    script = [tok("1") + [PAD] + tok("25") + [EOS], tok("125") + [EOS]]
    r = generate(ScriptedLM(script), TOK, ["100+25=", "100+25="], 1, SamplingParams(5, greedy=True))
    assert r.texts == ["1<pad>25", "125"]
    assert r.ill_formed.tolist() == [True, False]
    task = Addition(OmegaConf.create({"digits": 2, "eval_fraction": 0.1}))
    p = Problem("100+25=", "125")
    reward_cfg = OmegaConf.create({"name": "tinyzero", "correct": 1.0, "format_score": 0.1})
    rewards, parts = score(task, reward_cfg, r.texts, [p, p], r.ill_formed)
    assert rewards.tolist() == [0.0, 1.0] and parts["format"].tolist() == [0.0, 1.0]
    # the flag alone is enough, whatever the text says
    assert score(task, reward_cfg, ["125", "125"], [p, p], r.ill_formed)[0].tolist() == [0.0, 1.0]


def test_inverse_cdf_sampling_draws_the_softmax_distribution():
    """`_sample` with uniforms draws token v with probability softmax(logits / temp)_v, never a token top-p removed."""
    from gspo.rollout.decoding.generate import _sample

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0]]))  # the last token has probability 0
    u = torch.rand(200_000, generator=torch.Generator().manual_seed(0))
    draws = _sample(logits.expand(len(u), -1), 1.0, 1.0, False, u)
    freq = torch.bincount(draws, minlength=5).float() / len(u)
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0]), atol=4e-3, rtol=0)
    # top_p = 0.8 keeps {0.5, 0.3} (the smallest set reaching 0.8), renormalised to 0.625 / 0.375
    draws = _sample(logits.expand(len(u), -1), 1.0, 0.8, False, u)
    freq = torch.bincount(draws, minlength=5).float() / len(u)
    torch.testing.assert_close(freq, torch.tensor([0.625, 0.375, 0.0, 0.0, 0.0]), atol=4e-3, rtol=0)
    assert _sample(logits, 1.0, 1.0, False, torch.zeros(1)).item() == 0  # u = 0 takes the first token with mass
    assert _sample(torch.tensor([[-1e9, 0.0, 0.0]]), 1.0, 1.0, False, torch.zeros(1)).item() == 1


def test_the_sampler_stops_at_every_end_token_the_generation_config_lists():
    """A chat checkpoint ends its turn with a token other than the tokenizer's EOS (Gemma's <end_of_turn>,
    Llama 3's <|eot_id|>): its generation_config lists both, and the sampler stops at either, as generate does.
    (Before: it sampled on past the turn end, and the row was scored ill-formed.)"""
    turn_end = TOK.convert_tokens_to_ids("=")  # stands in for <end_of_turn>
    lm = ScriptedLM([tok("12") + [turn_end, *tok("34")], tok("5") + [EOS]])
    lm.generation_config = SimpleNamespace(eos_token_id=[EOS, turn_end])
    r = generate(lm, TOK, ["1=", "2="], 1, SamplingParams(6, greedy=True))
    assert r.texts == ["12", "5"] and r.truncated.tolist() == [False, False]
    assert r.completion_mask.tolist() == [[1, 1, 1], [1, 1, 0]]  # the turn end is a completion token, as EOS
    assert r.ill_formed.tolist() == [False, False]


def test_non_finite_logits_stop_the_rollout_in_one_line():
    """HF's sampler raises on NaN logits; gspo's did sample them (the last vocabulary id, log-prob NaN)."""
    from gspo.rollout.decoding.generate import NonFiniteLogits

    class NaNLM(ScriptedLM):
        def forward(self, *a, **k):
            out = super().forward(*a, **k)
            out.logits[1, -1, 3] = float("nan")
            return out

    with pytest.raises(NonFiniteLogits, match=r"not finite \(NaN or inf\) in 1 of 2 rows"):
        generate(NaNLM([tok("12"), tok("3")]), TOK, ["1=", "2="], 1, SamplingParams(3),
                 generator=torch.Generator().manual_seed(0))


def test_compile_keeps_a_bounded_number_of_static_caches(tiny_model):
    """Every batch shape compiled once would keep its own KV cache for ever (task=data: prompt widths vary)."""
    from gspo.rollout.decoding import generate as g

    g._STATIC.clear()
    for width in (10, 11, 12, 13):
        g._static_decoder(tiny_model, 2, width)
    assert len(g._STATIC) == g.MAX_STATIC == 2
    assert [k[2] for k in g._STATIC] == [12, 13]
    g._STATIC.clear()


def _scripted_rollout() -> "Rollout":
    """Rows of prompts 1-7 tokens and completions 1-4 tokens (EOS included), rows 0 and 1 the short ones."""
    script = [[EOS], tok("5") + [EOS], tok("12") + [EOS], tok("4567")]
    return generate(ScriptedLM(script), TOK, ["1=", "2+2=", "12+345=", "7="], 1, SamplingParams(4, greedy=True))


def test_trimmed_drops_the_columns_that_are_padding_in_every_row():
    from dataclasses import fields

    from gspo.rollout.decoding.generate import COMPLETION_COLUMNS, SEQUENCE_COLUMNS

    r = _scripted_rollout()
    assert r.prompt_len == 7 and r.completion_mask.shape == (4, 4)
    r.sampler_logp = torch.arange(16.0).view(4, 4) * r.completion_mask
    sub, window = r.select(torch.tensor([0, 1])).trimmed()  # prompts of 2 and 4 tokens, completions of 1 and 2
    assert window == slice(3, 9) and sub.prompt_len == 4 and sub.completion_mask.tolist() == [[1, 0], [1, 1]]
    assert sub.input_ids.tolist() == r.input_ids[:2, 3:9].tolist()
    assert sub.attention_mask.tolist() == [[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    assert sub.sampler_logp.tolist() == r.sampler_logp[:2, :2].tolist() and sub.texts == r.texts[:2]
    whole, window = r.trimmed()  # every column used by some row: the same rollout
    assert whole is r and window == slice(0, 11)
    # every (N, P+T) or (N, T) tensor field is cut: a new per-column field must join one of the lists
    n, p, t = 4, r.prompt_len, r.completion_mask.shape[1]
    full = Rollout(**{f.name: getattr(r, f.name) for f in fields(r)})
    full.routing, full.router_logp = torch.zeros(n, p + t, 2, 1), torch.zeros(n, p + t, 2, 3)
    full.kept_mass, full.topk_ids, full.topk_logp = torch.ones(n, t), torch.zeros(n, t, 2, dtype=torch.long), torch.zeros(n, t, 2)
    full.ill_formed, full.turns = torch.zeros(n, dtype=torch.bool), torch.ones(n)
    full.tool_calls = full.tool_errors = torch.zeros(n)
    sub, window = full.select(torch.tensor([0, 1])).trimmed()
    for f in fields(full):
        v = getattr(full, f.name)
        if isinstance(v, torch.Tensor) and v.dim() > 1:
            assert f.name in SEQUENCE_COLUMNS + COMPLETION_COLUMNS, f.name
            assert getattr(sub, f.name).shape[1] == (6 if f.name in SEQUENCE_COLUMNS else 2), f.name
        elif isinstance(v, torch.Tensor):
            assert f.name not in SEQUENCE_COLUMNS + COMPLETION_COLUMNS and getattr(sub, f.name).shape == (2,), f.name


def _qwen3(moe: bool, prefix: str = ""):
    """A tiny float64 Qwen3 (or Qwen3-MoE) and a sampled rollout of uneven prompts and completions (each prompt
    opening with `prefix`)."""
    kind = dict(arch="qwen3_moe", num_experts=4, top_k=2, moe_intermediate_size=16,
                experts_implementation="eager") if moe else dict(arch="qwen3")  # (grouped_mm has no float64)
    cfg = OmegaConf.structured(ModelConfig(name="t", hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16,
                                           intermediate_size=64, num_layers=2, **kind))
    model = build_model(cfg, len(TOK), TOK, seed=0).double().eval()
    return model, _sampled(model, moe, prefix)


def _sampled(model, moe: bool, prefix: str = ""):
    """`_qwen3`'s rollout of `model`: four uneven prompts (each opening with `prefix`), two completions each."""
    prompts = [prefix + p for p in ("1=", "1+1=", "12+345=", "99+1234=")]
    return generate(model, TOK, prompts, 2, SamplingParams(8, capture_routing=moe),
                    generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("moe", [False, True])
def test_a_trimmed_minibatch_has_the_same_logprobs_and_gradients(moe):
    """What `train.trim_padding` changes is the work, not the numbers: a minibatch's log-probs, entropies and the
    gradient of a loss on them are the untrimmed ones, float64 to 1e-12 (MoE: routing replayed from the sampler's,
    R3, cut to the same columns)."""
    from gspo.models import moe as moe_lib

    model, r = _qwen3(moe)
    rows = torch.tensor([0, 2, 3, 1])  # the two shortest prompts' rows: 4 prompt columns of 8 are padding in all
    sub = r.select(rows)
    short, window = sub.trimmed()
    assert window.start > 0 and short.input_ids.shape[1] < sub.input_ids.shape[1]
    width = short.completion_mask.shape[1]
    weights = torch.linspace(-1, 1, sub.completion_mask.numel(), dtype=torch.float64).view_as(sub.completion_mask)
    out = []
    for ro, cols in ((sub, slice(0, None)), (short, window)):
        model.zero_grad()
        replay = moe_lib.replay_routing(model, r.routing[rows][:, cols]) if moe else contextlib.nullcontext()
        with replay:
            logp, entropy, _ = token_logprobs(model, ro, temperature=0.8, with_entropy=True)
            ((logp * weights[:, : logp.shape[1]]).sum() + entropy.sum()).backward()
        out.append((logp[:, :width], entropy[:, :width], [p.grad.clone() for p in model.parameters()]))
    (logp, ent, grads), (logp_t, ent_t, grads_t) = out
    assert torch.equal(sub.completion_mask[:, width:], torch.zeros_like(sub.completion_mask[:, width:]))
    torch.testing.assert_close(logp_t, logp, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ent_t, ent, atol=1e-12, rtol=1e-12)
    for g, g_t in zip(grads, grads_t):
        torch.testing.assert_close(g_t, g, atol=1e-12, rtol=1e-12)
