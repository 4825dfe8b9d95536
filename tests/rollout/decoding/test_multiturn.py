"""Multi-turn rollouts with tools, from the losses up: the tools' tokens are absent from every loss, the log-probs,
routing and mismatch statistics; trajectories are keyed per turn and do not depend on the batch; every engine
samples the same; a run with tools trains and shows whole conversations (that it samples in a worker and resumes
exactly: tests/contracts/test_resume_equals_uninterrupted.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gspo.algos.losses import LOSSES, policy_loss
from gspo.algos.mismatch import mismatch_metrics, routing_mismatch
from gspo.config.loading import compose
from gspo.models.build import load_pretrained
from gspo.rollout.decoding.decoder import ModelDecoder
from gspo.rollout.decoding.generate import token_logprobs
from gspo.rollout.decoding.multiturn import ToolUse
from gspo.rollout.decoding.params import SamplingParams
from gspo.rollout.decoding.rollouts import rollout
from gspo.tasks import build_task
from gspo.train.loop.trainer import train
from gspo.train.start.warm_start import base_model
from tests.conftest import tiny

F64 = torch.float64


# --------------------------------------------------------------------------- the losses


def _insert(x: torch.Tensor, where: list[list[int]], fill: torch.Tensor) -> torch.Tensor:
    """x (B, T, ...) with, in row i, fill's values inserted before each column of where[i] (same count each row)."""
    rows = []
    for i, cols in enumerate(where):
        parts, last = [], 0
        for j, c in enumerate(cols):
            parts += [x[i, last:c], fill[i, j : j + 1]]
            last = c
        rows.append(torch.cat(parts + [x[i, last:]]))
    return torch.stack(rows)


@pytest.mark.parametrize("per_token", [False, True], ids=["seq-adv", "token-adv"])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_environment_tokens_change_no_loss_value_and_no_gradient(name, per_token):
    """Every registered loss, with every extra term on (KL to a reference, TIS weights, dual clip, router shift,
    top-k, Clip-Cov's pick): a batch with tool tokens inserted between the model's (mask 0, garbage log-probs,
    advantages and weights) gives the loss, the stats and the model tokens' gradients of the batch without
    them, and no gradient at all to the inserted positions."""
    g = torch.Generator().manual_seed(0)
    B, T, E, k = 4, 7, 3, 3
    lengths = torch.tensor([7, 5, 3, 6])
    mask = (torch.arange(T) < lengths[:, None]).to(F64)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
    old = -rnd(B, T).abs() - 0.1
    logp = old + 0.3 * rnd(B, T)  # off-policy: both sides of every clip are hit
    adv = rnd(B, T) if per_token else rnd(B)
    extra = {"ref_logp": old + 0.2 * rnd(B, T), "is_weight": 0.5 + rnd(B, T).abs(), "router_shift": rnd(B, T).sigmoid(),
             "topk_old_logp": -rnd(B, T, k).abs(), "topk_logp": -rnd(B, T, k).abs()}
    hyper = dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0, beta=0.04, max_tokens=12, clip_cov_ratio=0.3,
                 clip_cov_lb=-1e9, clip_cov_ub=1e9, kl_cov_ratio=0.3)
    # tool tokens: in each row, E of them at increasing places inside the row (between two model tokens)
    where = [sorted(torch.randint(1, int(n), (E,), generator=g).tolist()) for n in lengths]

    def loss_of(lp, o, a, m, ex):
        gen = torch.Generator().manual_seed(1)  # Clip-Cov's pick, keyed as the trainer keys it
        return policy_loss(name, lp, o, a, m, generator=gen, **ex, **hyper)

    lp0 = logp.clone().requires_grad_(True)
    loss0, st0 = loss_of(lp0, old, adv, mask, extra)
    loss0.backward()

    garbage = lambda *s: 5 * rnd(*s)  # noqa: E731  (anything: a tool's tokens have no meaningful log-prob)
    lp1 = _insert(logp, where, garbage(B, E)).requires_grad_(True)
    ins = lambda x: _insert(x, where, garbage(B, E, *x.shape[2:]))  # noqa: E731
    ex1 = {key: ins(v) for key, v in extra.items()}
    mask1 = _insert(mask, where, torch.zeros(B, E, dtype=F64))
    loss1, st1 = loss_of(lp1, ins(old), ins(adv) if per_token else adv, mask1, ex1)
    loss1.backward()

    torch.testing.assert_close(loss1, loss0, rtol=1e-12, atol=1e-12)
    assert st1.keys() == st0.keys() and all(st1[s] == pytest.approx(st0[s], rel=1e-12, abs=1e-12) for s in st0)
    env = _insert(torch.zeros(B, T, dtype=torch.bool), where, torch.ones(B, E, dtype=torch.bool))
    assert torch.count_nonzero(lp1.grad[env]) == 0
    torch.testing.assert_close(lp1.grad[~env].view(B, T), lp0.grad, rtol=1e-12, atol=1e-12)
    assert lp0.grad.abs().sum() > 0  # the comparison is not between two zeros


def test_mismatch_and_routing_statistics_skip_environment_tokens():
    """`rollout/*` mismatch metrics and the routing mismatch read the completion mask: whatever sits at a tool
    token (it is 0 there in a rollout) changes nothing."""
    trainer = torch.tensor([[-1.0, -2.0, 7.0, -0.5], [-1.5, 9.0, -0.2, 0.0]])
    sampler = torch.tensor([[-1.1, -1.8, -3.0, -0.5], [-1.0, -4.0, -0.2, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 0.0, 1.0, 0.0]])
    plain = mismatch_metrics(trainer[mask.bool()].view(1, -1), sampler[mask.bool()].view(1, -1), torch.ones(1, 5))
    with_tools = mismatch_metrics(trainer, sampler, mask)
    for key in ("rollout/logprob_abs_diff_mean", "rollout/logprob_abs_diff_max", "rollout/mismatch_kl",
                "rollout/ratio_min", "rollout/ratio_max"):
        assert with_tools[key] == pytest.approx(plain[key], rel=1e-6), key
    a = torch.tensor([[[[0, 1]], [[2, 3]], [[4, 5]]]])
    b = torch.tensor([[[[0, 1]], [[6, 7]], [[4, 5]]]])  # differs only where the tool's token is
    assert routing_mismatch(a, b, torch.tensor([[1.0, 0.0, 1.0]])) == 0.0


# --------------------------------------------------------------------------- a real tiny model


def opts(cache_dir, **extra) -> list[str]:
    """The tool task at test size: a warm start short enough to leave the model calling (and miscalling) tools."""
    return ["+experiment=tools", *tiny(cache_dir, **{"rollout.max_new_tokens": 80, "model.warm_start.steps": 60,
                                                     "hardware.threads": 1, **extra})]


@pytest.fixture(scope="module")
def base(cache_dir):
    cfg = compose(opts(cache_dir))
    task = build_task(cfg.task)
    model, tok = load_pretrained(base_model(cfg, task))
    return cfg, task, model.eval(), tok


def sample(base, n_prompts=8, G=4, first=0, model=None, **kw):
    cfg, task, policy, tok = base
    import random

    problems = task.sample_train(random.Random(0), first + n_prompts)[first:]
    return rollout(model or policy, tok, [p.prompt for p in problems], G, SamplingParams(80, **kw),
                   [(0, 1, 0, first + i) for i in range(n_prompts)], tools=ToolUse.of(cfg))


def env_mask(r) -> torch.Tensor:
    return r.attention_mask[:, r.prompt_len:].bool() & ~r.completion_mask.bool()


def test_the_trainers_log_probs_and_routing_on_a_trajectory_are_the_samplers(base):
    """On trajectories with tool replies in them: the trainer's log-probs of the model's tokens equal the ones
    recorded while sampling, are 0 on the tools' tokens, and the routing recorded while sampling (what R3
    replays) is what a plain forward of the whole trajectory routes, position by position, tools' tokens
    included; replaying it gives the same log-probs."""
    from gspo.models import moe

    r = sample(base, capture_routing=True)
    env = env_mask(r)
    assert env.any() and r.tool_calls.sum() > 0  # there are tool replies to skip
    model = base[2]
    with moe.capture_routing(model) as trace:
        logp = token_logprobs(model, r)[0]
    torch.testing.assert_close(logp[r.completion_mask.bool()], r.sampler_logp[r.completion_mask.bool()],
                               rtol=0, atol=1e-5)
    assert torch.count_nonzero(logp[env]) == 0 and torch.count_nonzero(r.sampler_logp[env]) == 0
    recorded = (r.routing >= 0).all(-1).all(-1)
    fed = r.attention_mask.bool().clone()  # every position of the trajectory but its last token, never fed
    fed[torch.arange(len(fed)), r.prompt_len + r.attention_mask[:, r.prompt_len:].sum(1) - 1] = False
    assert torch.equal(recorded, fed)
    live = trace.indices(len(r.texts))
    assert routing_mismatch(r.routing, live, recorded.float()) == 0.0
    with moe.replay_routing(model, r.routing):
        replayed = token_logprobs(model, r)[0]
    torch.testing.assert_close(replayed, logp, rtol=0, atol=1e-5)


def test_a_trajectory_is_keyed_per_turn_and_not_by_its_batch(base):
    """The trajectories of prompts 4..7 are the same sampled with prompts 0..3 or alone (per (prompt, sample,
    turn) generators): how a prompt sampled on rank r of W matches one process, and a worker the trainer."""
    both, alone = sample(base, n_prompts=8), sample(base, n_prompts=4, first=4)
    assert both.conversations[16:] == alone.conversations
    assert torch.equal(both.completion_mask[16:, : alone.completion_mask.shape[1]].sum(1), alone.completion_mask.sum(1))
    assert both.conversations[:4] != both.conversations[4:8]  # the G samples of a prompt differ


def test_top_p_and_the_kept_top_k_cover_the_models_tokens_only(base):
    """rollout.top_p's kept mass and rollout.keep_topk's tokens (dppo_topk) exist at the model's tokens, the
    sampled token among the kept ones; at the tools' tokens they are neutral (mass 1, log-probs 0)."""
    r = sample(base, top_p=0.9, keep_topk=3)
    env, mine = env_mask(r), r.completion_mask.bool()
    assert env.any() and r.topk_ids.shape == (*r.completion_mask.shape, 3)
    assert (r.kept_mass[env] == 1).all() and (r.kept_mass[mine] <= 1).all() and (r.kept_mass[mine] < 1).any()
    assert torch.count_nonzero(r.topk_logp[env]) == 0
    assert (r.topk_ids[mine] == r.completion_ids[mine][:, None]).any(-1).all()


class EngineWithoutLogprobs:
    """A stand-in for the vLLM engine where it records no log-probs (top_p < 1 with a temperature other than 1):
    what `VllmEngine.sample_ids` returns then, the tokens drawn here by gspo's own sampler."""

    def __init__(self, model, tok):
        self.model, self.tok = model, tok

    def sample_ids(self, prompts, n, max_new_tokens, temperature, top_p, greedy, seeds, keep_topk, routing):
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        out = ModelDecoder(self.model).continue_sequences(self.tok, prompts, max_new_tokens, gens,
                                                          SamplingParams(max(max_new_tokens), temperature, top_p))
        return {"tokens": [c.tokens for c in out], "logprobs": [None] * len(out), "topk": [None] * len(out)}


@pytest.mark.parametrize("keep_topk", [0, 3])
def test_trajectories_from_an_engine_without_log_probs_have_none(base, keep_topk):
    """Every turn sampled by an engine that recorded no log-probs: the rollout has no behaviour log-probs, kept
    mass or top-k (None, as a single-turn rollout's), not zeros and ones that the mismatch metrics, OPSM and
    rollout/top_p_kept_mass would read as real."""
    from gspo.rollout.decoding.generate import stop_ids
    from gspo.rollout.engine.client import Engine

    model, tok = base[2], base[3]
    engine = Engine(EngineWithoutLogprobs(model, tok), stop_ids(model, tok).tolist())
    r = sample(base, model=engine, temperature=0.7, top_p=0.9, keep_topk=keep_topk)
    assert env_mask(r).any() and r.tool_calls.sum() > 0  # trajectories with tool replies in them
    assert r.sampler_logp is None and r.kept_mass is None and r.topk_ids is None and r.topk_logp is None


def test_the_fast_engine_samples_the_trajectories_hf_samples(base):
    hf, fast = sample(base, engine="hf"), sample(base, engine="fast")
    assert hf.conversations == fast.conversations and torch.equal(hf.input_ids, fast.input_ids)
    torch.testing.assert_close(hf.sampler_logp, fast.sampler_logp, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- training with tools


def metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("algo, extra", [
    ("gspo", {}),
    ("grpo", {"moe.routing_replay": "R3", "rollout.old_logprobs": "recompute"}),
    pytest.param("grpo", {"moe.routing_replay": "R2", "rollout.old_logprobs": "recompute"}, marks=pytest.mark.slow),
    pytest.param("dapo", {"model.lora.r": 4}, marks=pytest.mark.slow),
], ids=["gspo", "grpo-R3", "grpo-R2", "dapo-lora"])
def test_a_run_with_tools_trains_and_logs_its_trajectories(algo, extra, tmp_path, cache_dir):
    train(compose(opts(cache_dir, algo=algo, **{"logger.wandb_cfg.samples_every": 1, **extra})), tmp_path)
    m = metrics(tmp_path)
    for key in ("rollout/turns_mean", "rollout/tool_calls_mean", "rollout/tool_errors_frac", "rollout/env_token_frac",
                "reward/correct_call/mean"):
        assert all(key in row for row in m[1:]), key
    assert m[1]["rollout/turns_mean"] >= 1 and 0 <= m[1]["rollout/env_token_frac"] < 1
    assert "eval/correct_call" in m[0] and "eval/tool_calls_mean" in m[-1]
    if "moe.routing_replay" in extra:  # replay covers the tools' positions too: the update routes as recorded
        assert all(row["moe/update_mismatch"] == 0.0 for row in m[1:])
    sample_row = json.loads((tmp_path / "samples.jsonl").read_text().splitlines()[0])
    assert sample_row["completion"][0]["role"] == "assistant"  # the whole conversation, not a string


REWARD = '''
def conversation(prompts, completions, **kwargs):
    """TRL's reward-function signature; with tools `completions` holds each whole conversation."""
    out = []
    for c in completions:
        assert isinstance(c, list) and c[0]["role"] == "assistant" and c[-1]["role"] == "assistant", c
        assert all(m["role"] in ("assistant", "tool") for m in c)
        out.append(float(len(c)))
    return out
'''


def test_a_reward_function_sees_the_whole_conversation(tmp_path, cache_dir):
    fn = tmp_path / "reward.py"
    fn.write_text(REWARD)
    train(compose(opts(cache_dir, reward="python", **{"reward.fn": f"{fn}:conversation", "train.steps": 1})),
          tmp_path / "run")
    assert metrics(tmp_path / "run")[1]["reward/fn/conversation/mean"] >= 1  # it ran, and its checks held


def test_tool_keys_are_checked_before_any_work(cache_dir):
    from gspo.config.checks import ignored_override
    from gspo.core.errors import ConfigError
    from gspo.train.preflight import check

    assert "there are no tools" in ignored_override([compose(["rollout.max_turns=2"])], "rollout.max_turns=2")
    # with tools every prompt is rendered with the chat template: a user's `false` is refused, not dropped in silence
    off = "model.use_chat_template=false"
    assert "rendered with the chat template" in ignored_override([compose(opts(cache_dir) + [off])], off)
    assert ignored_override([compose(opts(cache_dir) + [off[:-5] + "true"])], off[:-5] + "true") is None
    assert ignored_override([compose([off])], off) is None  # without tools it is read
    with pytest.raises(ConfigError, match="rollout.max_turns=0: must be >= 1"):
        compose(opts(cache_dir, **{"rollout.max_turns": 0}))
    with pytest.raises(ConfigError, match="rollout.tools=nowhere.py:f: no such file nowhere.py"):
        check(compose(opts(cache_dir, **{"rollout.tools": "nowhere.py:f"})))
    # TRL-style FILE.py:fn1,fn2 is one spec (Hydra alone would read the comma as a sweep); a list works too
    assert compose(["rollout.tools=examples/tools.py:multiply,add"]).rollout.tools == "examples/tools.py:multiply,add"
    assert list(compose(["rollout.tools=[a.py:f,b.py:g]"]).rollout.tools) == ["a.py:f", "b.py:g"]
    from typer.testing import CliRunner

    from cli.main import app

    res = CliRunner().invoke(app, ["train", "rollout.tools=examples/tools.py:multiply,nothing"])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert "has no function 'nothing'. Functions there: add, multiply" in res.output


def test_the_tool_experiments_references_fit_its_budget():
    """+experiment=tools: every warm-start reference (call, reply, answer) fits rollout.max_new_tokens, prompt and
    budget fit the tiny models' positions, and the task cannot be solved by a model that never calls the tool
    (its warm start teaches direct answers that are right only by chance)."""
    import random

    from gspo.config.schema import TINY_MAX_POSITIONS
    from gspo.models.build import char_tokenizer
    from gspo.train.start.warm_start import _reference

    cfg = compose(["+experiment=tools"])
    task, tools = build_task(cfg.task), ToolUse.of(cfg)
    tok = char_tokenizer(task.alphabet, chat=True)
    problems = task.sample_train(random.Random(0), 200)
    refs = [_reference(tok, task, p, tools) for p in problems]
    tails = [len(ids) - learn.index(1) for ids, learn in refs]
    assert max(tails) <= cfg.rollout.max_new_tokens and max(len(ids) for ids, _ in refs) < TINY_MAX_POSITIONS
    assert 0.6 < sum(p.meta["direct"] for p in problems) / len(problems) < 0.95  # most references answer directly
    assert task.verify(problems[0].answer, problems[0]).correct


@pytest.mark.slow
def test_two_ranks_sample_the_trajectories_one_process_samples(tmp_path, cache_dir):
    """hardware=cpu-ddp (2 gloo ranks, each its share of the prompts, its own tool process) computes the
    one-process step: the same trajectories, rewards, tool counts and loss."""
    from tests.rollout.test_async import gspo

    o = opts(cache_dir, **{"train.steps": 1, "logger.wandb_cfg.samples_every": 1})
    train(compose(o), tmp_path / "one")
    res = gspo("train", "hardware=cpu-ddp", *o, f"hydra.run.dir={tmp_path / 'two'}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    one, two = metrics(tmp_path / "one")[1], metrics(tmp_path / "two")[1]
    for key in ("reward/mean", "response/len_mean", "rollout/turns_mean", "rollout/tool_calls_mean",
                "rollout/tool_errors_frac", "rollout/env_token_frac", "train/loss"):
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key
    rows = lambda run: [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]  # noqa: E731
    assert rows(tmp_path / "one") == rows(tmp_path / "two")


def test_a_trl_tool_file_trains_on_a_built_in_task(tmp_path, cache_dir):
    """examples/tools.py (TRL's documented form) on the default task: the tiny model's template renders its tools,
    a run of a step trains and logs the tool metrics (the model was never taught to call them)."""
    from tests.conftest import REPO

    o = tiny(cache_dir, **{"rollout.tools": f"{REPO / 'examples/tools.py'}:multiply,add", "train.steps": 1,
                           "hardware.threads": 1})
    train(compose(o), tmp_path)
    assert "rollout/tool_calls_mean" in metrics(tmp_path)[1]
