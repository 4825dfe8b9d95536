"""reward=python runs reward functions written for TRL's GRPOTrainer unchanged and gives the rewards TRL would.

`trl_rewards` below is TRL's calling convention written out by hand (trl is not a test dependency): every
function is called by keyword with `prompts`, `completions`, `completion_ids`, each dataset column and
`trainer_state`; an async function is awaited; None becomes NaN; the reward is the weighted nansum.
"""

import asyncio
import inspect
import json
import math
import re

import pytest
import torch
from omegaconf import OmegaConf
from typer.testing import CliRunner

from cli.main import app
from gspo.algos.advantages import compute_advantages
from gspo.config.loading import compose
from gspo.config.schema import RewardConfig
from gspo.tasks import Problem, Verdict, build_task
from gspo.tasks.rewards import RewardError, probe, score, trainer_state
from gspo.train.loop.trainer import train
from tests.conftest import tiny

# In the spirit of TRL's documentation ("Using a custom reward function"): each takes what it needs by keyword.
FNS = '''
import asyncio, re

def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]

def swapped(completions, prompts, **kwargs):
    return [float(len(c) > len(p)) for p, c in zip(prompts, completions)]

def exact(completions, answer, **kwargs):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

def format_reward(completions, **kwargs):
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if re.match(pattern, c) else 0.0 for c in contents]

def math_only(completions, task, answer, **kwargs):
    return [None if t != "math" else float(c.strip() == a) for c, t, a in zip(completions, task, answer)]

def text_only(completions, task, **kwargs):
    return [None if t != "text" else 0.5 for t in task]

def tokens(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]

def schedule(completions, trainer_state, **kwargs):
    return [trainer_state.global_step / trainer_state.max_steps for _ in completions]

async def judge(prompts, completions, **kwargs):
    await asyncio.sleep(0)
    return [0.25 * len(c) for c in completions]

def needs_solution(completions, solution, **kwargs):
    return [0.0 for _ in completions]

LIMIT = asyncio.Semaphore(1)  # a rate limiter made once at import: bound to the first loop it makes wait

async def limited(completions, **kwargs):
    async def one(c):
        async with LIMIT:
            await asyncio.sleep(0)
        return 1.0
    return list(await asyncio.gather(*(one(c) for c in completions)))

def accuracy_reward(completions, solution, **kwargs):
    """open-r1's / TRL's documented math accuracy reward: math-verify with its own time limits (SIGALRM)."""
    from math_verify import LatexExtractionConfig, parse, verify
    rewards = []
    for content, sol in zip(completions, solution):
        gold = parse(sol, extraction_mode="first_match")
        if not gold:
            rewards.append(None)
            continue
        pred = parse(content, extraction_config=[LatexExtractionConfig(boxed_match_priority=0,
                     try_extract_without_anchor=False)], extraction_mode="first_match")
        rewards.append(float(verify(gold, pred)))
    return rewards
'''


@pytest.fixture
def fns(tmp_path):
    path = tmp_path / "trl_rewards.py"
    path.write_text(FNS)
    return path


class Unjudged:
    name = "unjudged"

    def verify(self, completion, problem):
        return Verdict(False, False)


def trl_rewards(funcs, weights, prompts, completions, completion_ids, columns, state):
    """TRL GRPOTrainer's convention, by hand: keyword call, await, None -> NaN, weighted nansum across functions."""
    per_func = []
    for f in funcs:
        out = f(prompts=prompts, completions=completions, completion_ids=completion_ids, trainer_state=state, **columns)
        if inspect.iscoroutine(out):
            out = asyncio.run(out)
        per_func.append([math.nan if r is None else r for r in out])
    table = torch.tensor(per_func, dtype=torch.float64).T  # (N, functions)
    return (table * torch.tensor(weights, dtype=torch.float64)).nansum(dim=1).tolist()


def module_of(path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("trl_rewards_reference", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_both(path, names, weights, problems, texts, ids, state):
    cfg = OmegaConf.structured(RewardConfig(name="python", fn=[f"{path}:{n}" for n in names], weights=weights))
    got, parts = score(Unjudged(), cfg, texts, problems, completion_ids=ids, state=state)
    mod = module_of(path)
    prompts = [p.prompt for p in problems]
    conversational = isinstance(prompts[0], list)
    completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
    rows = [p.meta["row"] for p in problems]
    columns = {k: [r[k] for r in rows] for k in rows[0]}
    want = trl_rewards([getattr(mod, n) for n in names], weights, prompts, completions, ids, columns, state)
    return got.tolist(), want, parts


TEXT = [Problem("12+7=", "19", {"row": {"answer": "19", "task": "math"}}),
        Problem("Say hi:", "hi", {"row": {"answer": "hi", "task": "text"}}),
        Problem("3+4=", "7", {"row": {"answer": "7", "task": "math"}})]


@pytest.mark.parametrize("names, weights", [
    (["reward_len"], [1.0]),
    (["swapped"], [1.0]),
    (["exact"], [1.0]),
    (["tokens", "schedule"], [1.0, 2.0]),
    (["judge", "exact"], [0.5, 1.0]),
    (["math_only", "text_only"], [1.0, 3.0]),
])
def test_trl_functions_on_plain_text_give_trls_rewards(fns, names, weights):
    texts = ["19", "a longer completion than its prompt", "8"]
    ids = [[5, 6, 0], [7, 0], [1, 2, 3, 0]]
    got, want, _ = run_both(fns, names, weights, TEXT, texts, ids, trainer_state(3, 12))
    assert got == pytest.approx(want) and len(got) == 3


def test_the_reference_numbers_by_hand(fns):
    """Guards the comparison itself: the values TRL's convention gives, worked out by hand."""
    texts = ["19", "a longer completion than its prompt", "8"]
    ids = [[5, 6, 0], [7, 0], [1, 2, 3, 0]]
    got, _, parts = run_both(fns, ["reward_len"], [1.0], TEXT, texts, ids, trainer_state(3, 12))
    assert got == [-18.0, -15.0, -19.0]
    got, _, _ = run_both(fns, ["swapped"], [1.0], TEXT, texts, ids, trainer_state(3, 12))
    assert got == [0.0, 1.0, 0.0]  # by keyword: completions are the completions, whatever the parameter order
    got, _, _ = run_both(fns, ["tokens", "schedule"], [1.0, 2.0], TEXT, texts, ids, trainer_state(3, 12))
    assert got == pytest.approx([3 + 0.5, 2 + 0.5, 4 + 0.5])
    got, _, parts = run_both(fns, ["math_only", "text_only"], [1.0, 3.0], TEXT, texts, ids, trainer_state(3, 12))
    assert got == [1.0, 1.5, 0.0]  # row 0 math right, row 1 text 3*0.5, row 2 math wrong
    assert parts["fn/math_only"][1].isnan() and parts["fn/math_only"].nanmean().item() == 0.5  # mean over the rows it scored
    assert parts["unscored"].tolist() == [0.0, 0.0, 0.0]


def test_conversational_completions_are_messages(fns):
    chat = [Problem([{"role": "user", "content": q}], a, {"row": {"answer": a, "task": "math"}})
            for q, a in (("12+7?", "19"), ("3+4?", "7"))]
    texts = ["<think>12+7</think><answer>19</answer>", "7"]
    got, want, _ = run_both(fns, ["format_reward", "reward_len"], [1.0, 0.1], chat, texts, [[1], [2]], trainer_state(0, 5))
    assert got == pytest.approx(want)
    # a completion is one assistant message: format_reward reads its content; reward_len sees a list of length 1
    assert got == pytest.approx([1.0 + 0.1 * -19, 0.0 + 0.1 * -19])


def test_a_row_no_function_scores_gets_zero_and_is_counted(fns):
    cfg = OmegaConf.structured(RewardConfig(name="python", fn=[f"{fns}:math_only"]))
    r, parts = score(Unjudged(), cfg, ["19", "hi"], TEXT[:2], completion_ids=[[1], [2]], state=trainer_state(0, 1))
    assert r.tolist() == [1.0, 0.0] and parts["unscored"].tolist() == [0.0, 1.0]


def test_the_probe_calls_each_function_on_a_real_sample(fns, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}", "task": "math"}}\n' for i in range(40)))
    cfg = compose(["task=data", f"task.path={data}", "reward=python",
                   f"reward.fn=[{fns}:exact,{fns}:tokens,{fns}:judge,{fns}:needs_solution]"])
    with pytest.raises(RewardError, match=r"reward function .*:needs_solution raised TypeError: .*solution.* on sample 0: "
                                          r"prompt '(\d+)\+1=', completion '(\d+)'") as e:
        probe(build_task(cfg.task), cfg, lambda text: [1] * len(text))
    assert "\n" not in str(e.value)
    a, b = re.search(r"prompt '(\d+)\+1=', completion '(\d+)'", str(e.value)).groups()  # a training row, its reference answer standing in for the completion
    assert int(b) == int(a) + 1


def test_cli_refuses_a_function_that_fails_on_a_sample_before_any_work(fns, cache_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["train", "reward=python", f"reward.fn={fns}:needs_solution", *tiny(cache_dir)])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "needs_solution raised TypeError" in res.output and len(res.output.strip().splitlines()) == 1
    assert not list(tmp_path.rglob("metrics.jsonl"))  # refused before the base evaluation


def test_an_async_function_keeps_one_event_loop_across_batches(fns):
    """TRL keeps one loop; a module-level asyncio.Semaphore failed at batch 2 when each batch had a new one."""
    cfg = OmegaConf.structured(RewardConfig(name="python", fn=f"{fns}:limited"))
    for _ in range(3):
        r, _ = score(Unjudged(), cfg, ["a", "b"], TEXT[:2])
        assert r.tolist() == [1.0, 1.0]


def test_the_open_r1_math_verify_accuracy_reward_runs_as_the_trainer_calls_it(fns):
    """math-verify's own time limits need the main thread: the trainer scores there (under reward.timeout_s),
    so the usual open-r1 / TRL-docs accuracy reward runs unchanged (before: "doesn't support threaded
    environment" at step 1; the start-up probe passed because it ran on the main thread)."""
    from gspo.tasks import timeouts

    cfg = OmegaConf.structured(RewardConfig(name="python", fn=f"{fns}:accuracy_reward"))
    problems = [Problem("q", "x", {"row": {"solution": "$\\frac{1}{2}$"}}),
                Problem("q", "x", {"row": {"solution": "$3$"}})]
    texts = ["so the answer is $\\boxed{0.5}$", "$\\boxed{4}$"]
    r, parts = timeouts.call(lambda: score(Unjudged(), cfg, texts, problems), 60, "scoring")
    assert r.tolist() == [1.0, 0.0]


# --------------------------------------------------------------------------- several functions: GDPO


def trl_normalize_then_sum(per_func: torch.Tensor, weights: list[float], G: int) -> torch.Tensor:
    """TRL GRPOTrainer's multi_objective_aggregation="normalize_then_sum" (trl 1.16 `_generate_and_score_completions`,
    restated): per function (r - nanmean_group) / (nanstd_group + 1e-4), weighted nansum, a row no function scored
    NaN, then (s - nanmean) / (nanstd + 1e-4) over the batch; NaN advantages become 0."""
    def nanstd(x, dim=None, keepdim=False):  # TRL's trainer.utils.nanstd: nanmean of squares, Bessel's correction
        var = torch.nanmean((x - torch.nanmean(x, dim=dim, keepdim=True)) ** 2, dim=dim, keepdim=keepdim)
        count = torch.sum(~torch.isnan(x), dim=dim, keepdim=keepdim)
        return torch.sqrt(var * count / (count - 1))

    unscorable = torch.isnan(per_func).all(dim=1)
    grouped = per_func.view(-1, G, per_func.shape[1])
    z = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (nanstd(grouped, dim=1, keepdim=True) + 1e-4)
    s = (z.view(-1, per_func.shape[1]) * torch.tensor(weights, dtype=per_func.dtype)).nansum(dim=1)
    s[unscorable] = torch.nan
    return torch.nan_to_num((s - torch.nanmean(s)) / (nanstd(s) + 1e-4), nan=0.0)


def test_several_functions_normalised_apart_as_trls_normalize_then_sum():
    """algo.advantage=gdpo on reward=python's parts (reward/fn/<name>, NaN for a None) with reward.weights: the
    advantages of TRL's normalize_then_sum on the same rewards (groups with spread in every function: TRL leaves
    float noise in a flat group, gspo exactly 0)."""
    from types import SimpleNamespace

    from gspo.train.loop.critic import Critic
    from gspo.train.ranks import distributed

    cfg = compose(["algo=gdpo", "reward=python", "reward.fn=[a.py:length,a.py:exact]", "reward.weights=[0.5,2.0]",
                   "rollout.group_size=4"])
    length = torch.tensor([3.0, 7.0, 1.0, 2.0, 5.0, 5.0, 9.0, 0.0])
    exact = torch.tensor([1.0, 0.0, math.nan, 1.0, 0.0, 1.0, 1.0, math.nan])
    parts = {"correct": exact.nan_to_num(), "fn/length": length, "fn/exact": exact, "unscored": torch.zeros(8)}
    rewards = (0.5 * length + 2.0 * exact.nan_to_num())
    batch = SimpleNamespace(rollout=SimpleNamespace(lengths=torch.full((8,), 3)), rewards=rewards, parts=parts)
    adv, _ = Critic(cfg, distributed.Dist()).advantages(batch, torch.ones(8, 3), torch.zeros(8, 3), None)
    want = trl_normalize_then_sum(torch.stack([length, exact], 1).double(), [0.5, 2.0], 4)
    torch.testing.assert_close(adv.double(), want, rtol=0, atol=1e-6)
    # summed first, then normalised (TRL's default, sum_then_normalize; gspo's grpo) gives other advantages
    assert not torch.allclose(compute_advantages("grpo", rewards, 4), adv, atol=1e-2)


def test_a_run_with_two_functions_and_gdpo_logs_each(tmp_path, cache_dir):
    fns = tmp_path / "r.py"
    fns.write_text("def short(completions, **kw):\n    return [-len(c) / 4 for c in completions]\n\n"
                   "def right(completions, answer, **kw):\n    return [float(c.strip() == a) for c, a in "
                   "zip(completions, answer)]\n")
    train(compose(tiny(cache_dir, algo="gdpo", reward="python", **{"reward.fn": f"[{fns}:short,{fns}:right]",
                                                                     "reward.weights": "[0.2,1.0]"})), tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    assert last["step"] == 2 and math.isfinite(last["train/loss"])
    assert {"reward/fn/short/mean", "reward/fn/right/mean"} <= set(last)
