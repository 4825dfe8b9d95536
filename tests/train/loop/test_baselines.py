"""The baselines in the loop (issue 41): PPO's critic (its warm-up; its metrics, checkpoint and exact resume in
tests/contracts/test_resume_equals_uninterrupted.py), the KL in the reward, TRL's knobs (refused where they cannot
apply; reference resets counted, and resumed exactly in the contract) and reward models
(reward=model beside functions, refusals). The math itself: tests/algos/test_value.py, tests/algos/test_losses.py and,
against TRL's own code, tests/contracts/test_peers_trl.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tests.conftest import tiny, tiny_reward_model
from safetensors.torch import load_file

from gspo.algos.advantages import compute_advantages
from gspo.core.errors import ConfigError
from gspo.config.loading import compose
from gspo.train.ranks import distributed
from gspo.train.preflight import check
from gspo.train.loop.critic import CRITIC_FILE, Critic
from gspo.train.loop.trainer import train


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# --------------------------------------------------------------------------- PPO's critic

# (its metrics, its checkpoint and its exact resume: tests/contracts/test_resume_equals_uninterrupted.py, ppo_critic)


def test_a_critic_warmup_trains_the_critic_alone_first(tmp_path, cache_dir):
    """verl's critic_warmup: during the first algo.critic.warmup steps the policy does not move, the critic does."""
    from gspo.tasks import build_task
    from gspo.train.start.warm_start import base_model

    opts = tiny(cache_dir, algo="ppo", **{"algo.critic.warmup": 2, "train.steps": 3, "hardware.threads": 1,
                                          "train.checkpoint_every": 1, "train.keep_checkpoints": 3})
    train(compose(opts), tmp_path)
    rows = metrics(tmp_path)[1:]
    assert ["train/loss" in r for r in rows] == ["train/lr" in r for r in rows] == [False, False, True]
    assert all("critic/value_loss" in r for r in rows)
    cfg = compose(opts)
    base = load_file(base_model(cfg, build_task(cfg.task)) / "model.safetensors")  # HF files: the same key layout
    step = {n: load_file(tmp_path / "checkpoints" / f"step_00000{n}" / "model.safetensors") for n in (2, 3)}
    assert all(torch.equal(step[2][k], base[k]) for k in step[2])
    assert any(not torch.equal(step[3][k], base[k]) for k in step[3])
    critic = {n: load_file(tmp_path / "checkpoints" / f"step_00000{n}" / CRITIC_FILE) for n in (1, 2)}
    assert any(not torch.equal(critic[1][k], critic[2][k]) for k in critic[1])
    with pytest.raises(ConfigError, match=r"algo.critic.warmup=3: must be below train.steps=3"):
        compose(tiny(cache_dir, algo="ppo", **{"algo.critic.warmup": 3, "train.steps": 3}))


def test_ppo_with_the_kl_in_the_reward(tmp_path, cache_dir):
    """Classic RLHF PPO: beta x KL per token in the reward, none in the loss (kl/ref is the old policy's k3)."""
    train(compose(tiny(cache_dir, algo="ppo", **{"algo.beta": 0.1, "algo.kl_in_reward": True, "algo.kl_estimator": "k1",
                                                 "train.steps": 2})), tmp_path)
    rows = metrics(tmp_path)[1:]
    assert all("reward/kl_penalty/mean" in r and "kl/ref" in r for r in rows)


def _fake_batch(rewards: list[float], G: int, T: int = 3):
    n = len(rewards)
    ro = SimpleNamespace(lengths=torch.full((n,), T), completion_mask=torch.ones(n, T))
    return SimpleNamespace(rollout=ro, rewards=torch.tensor(rewards))


def test_the_kl_in_the_reward_of_trls_rloo():
    """TRL's RLOOTrainer (trl 1.16 `_generate_and_score_completions`, restated): rewards - beta x the completion's
    summed k1 KL (old - ref), then r_i - the mean of the other G - 1."""
    cfg = compose(["algo=rloo", "rollout.group_size=2"])
    batch = _fake_batch([1.0, 0.0, 0.5, 0.5], G=2)
    old = torch.tensor([[-1.0, -2.0, -0.5]] * 4)
    ref = old - torch.tensor([[0.1], [0.3], [0.0], [-0.2]])  # summed k1 per row: 0.3, 0.9, 0, -0.6
    adv, stats = Critic(cfg, distributed.Dist()).advantages(batch, torch.ones(4, 3), old, ref)
    r = torch.tensor([1.0 - 0.05 * 0.3, 0.0 - 0.05 * 0.9, 0.5, 0.5 + 0.05 * 0.6])
    torch.testing.assert_close(adv, torch.tensor([r[0] - r[1], r[1] - r[0], r[2] - r[3], r[3] - r[2]]))
    torch.testing.assert_close(adv, compute_advantages("rloo", r, 2))
    assert stats["reward/kl_penalty/mean"] == pytest.approx(0.05 * (0.3 + 0.9 + 0 - 0.6) / 4)


# --------------------------------------------------------------------------- TRL's knobs


def test_trls_knobs_compose_with_a_loss_and_log_what_they_keep(tmp_path, cache_dir):
    train(compose(tiny(cache_dir, algo="gspo", **{"algo.top_entropy_quantile": 0.25, "algo.entropy_coef": 0.01,
                                                  "train.steps": 2})), tmp_path / "a")
    kept = [r["policy/entropy_kept_frac"] for r in metrics(tmp_path / "a")[1:]]
    assert all(0.2 <= k <= 0.4 for k in kept), kept  # about a quarter (ties and small batches round it)
    train(compose(tiny(cache_dir, algo="grpo", **{"algo.delta": 1.5, "train.steps": 1})), tmp_path / "b")


def test_the_knobs_are_refused_in_one_line_where_they_cannot_apply(cache_dir):
    with pytest.raises(ConfigError, match=r"algo.delta=2.0 caps the unclipped ratio .* algo.loss=cispo does not have"):
        check(compose(["algo=cispo", "algo.delta=2.0"]))
    with pytest.raises(ConfigError, match=r"algo.sync_ref_model=true resets the KL reference, and there is none"):
        compose(["algo=gspo", "algo.sync_ref_model=true"])
    with pytest.raises(ConfigError, match=r"under LoRA"):
        compose(["algo=grpo", "algo.sync_ref_model=true", "model.lora.r=4"])
    with pytest.raises(ConfigError, match=r"algo.delta=1.0: must be > 1"):
        compose(["algo=grpo", "algo.delta=1.0"])
    with pytest.raises(ConfigError, match=r"algo.top_entropy_quantile=1.5: must be in \[0, 1\]"):
        compose(["algo.top_entropy_quantile=1.5"])
    from gspo.config.checks import ignored_override

    assert "only the gae advantage" in ignored_override([compose(["algo=grpo"])], "algo.critic.lr=1e-4")
    assert "reference resets are off" in ignored_override([compose(["algo=grpo"])], "algo.ref_model_sync_steps=8")
    assert ignored_override([compose(["algo=ppo"])], "algo.critic.lr=1e-4") is None


def test_reference_resets_count_the_policys_updates_not_a_critics_warm_up(tmp_path, cache_dir, monkeypatch):
    """PPO with a critic warm-up of 1 step, 2 minibatches a step, steps 2 and 3 update the policy: those are its
    optimizer updates 1 to 4 (TRL's global_step), which algo.ref_model_sync_steps counts; the warm-up step moved
    no policy weight and counts none."""
    from gspo.train.loop.reference import RefSync

    seen = []
    monkeypatch.setattr(RefSync, "after_update", lambda self, policy, update: seen.append(update))
    train(compose(tiny(cache_dir, algo="ppo", **{"algo.critic.warmup": 1, "train.steps": 3, "algo.beta": 0.04,
                                                 "algo.sync_ref_model": True, "algo.ref_model_sync_steps": 3})),
          tmp_path)
    assert seen == [1, 2, 3, 4]


# --------------------------------------------------------------------------- reward models


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    return tiny_reward_model(tmp_path_factory.mktemp("rm") / "tiny_rm")


def test_a_reward_model_trains_beside_a_function_with_weights(tmp_path, cache_dir, reward_dir):
    fn = tmp_path / "fns.py"
    fn.write_text("def short(completions, **kw):\n    return [1.0 if len(c) < 3 else 0.0 for c in completions]\n")
    train(compose(tiny(cache_dir, reward="model", **{"reward.path": str(reward_dir), "reward.fn": f"{fn}:short",
                                                     "reward.weights": "[0.5,2.0]", "reward.batch_size": 5,
                                                     "train.steps": 1})), tmp_path / "run")
    (row,) = metrics(tmp_path / "run")[1:]
    rm, short = row["reward/fn/tiny_rm/mean"], row["reward/fn/short/mean"]
    assert row["reward/mean"] == pytest.approx(0.5 * rm + 2.0 * short, abs=1e-5)
    assert 0.0 <= short <= 1.0 and rm != 0.0


def test_a_reward_model_scores_a_tool_conversation_after_a_string_prompt(cache_dir, reward_dir):
    """reward=model with rollout.tools on a task of string prompts: each completion is the conversation after the
    prompt (tool calls, the tools' replies, the answer), scored as TRL scores a conversational sample: the prompt,
    as the one user message the policy was shown, and the conversation through the reward model's chat template.
    The start-up probe makes that call on a real sample, as training does."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from gspo.models.build import tokenizer_encode
    from gspo.tasks import build_task
    from gspo.tasks.reward_model import RewardModel
    from gspo.tasks.rewards import probe

    conversation = [{"role": "assistant", "content": "", "tool_calls": [
                        {"type": "function", "function": {"name": "calc", "arguments": {"expression": "1+2"}}}]},
                    {"role": "tool", "name": "calc", "content": "3"}, {"role": "assistant", "content": "3"}]
    ours = RewardModel.load(str(reward_dir), "cpu", batch_size=2)(["1+2=", "1+2="], [conversation, conversation[-1:]])
    tok = AutoTokenizer.from_pretrained(reward_dir)
    model = AutoModelForSequenceClassification.from_pretrained(reward_dir, num_labels=1).eval()
    text = tok.apply_chat_template([{"role": "user", "content": "1+2="}, *conversation], tokenize=False)
    with torch.no_grad():
        theirs = model(**tok([text], return_tensors="pt", add_special_tokens=False)).logits[0, 0]
    assert ours[0] == pytest.approx(float(theirs), abs=1e-5) and ours[0] != ours[1]
    cfg = compose(["+experiment=tools", *tiny(cache_dir, reward="model", **{"reward.path": str(reward_dir)})])
    task = build_task(cfg.task)
    probe(task, cfg, tokenizer_encode(cfg, task))


def test_a_reward_model_on_cuda_runs_on_this_processs_gpu(monkeypatch):
    """reward.device=cuda or auto (the default follows hardware.device): the GPU of the process that scores, by
    index (a DDP rank's, its rollout worker's), never a bare "cuda" that names GPU 0 in a worker."""
    from gspo.tasks.reward_model import device_of

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert [device_of(d) for d in ("auto", None, "cuda", "cuda:1", "cpu")] == [
        torch.device("cuda", 3), torch.device("cuda", 3), torch.device("cuda", 3), torch.device("cuda", 1),
        torch.device("cpu")]
    # a rollout worker makes its rank's GPU current before it builds anything (a torchrun rank is made so by gspo's
    # process-group set-up): its reward model's "cuda" is that GPU
    from gspo.rollout import worker

    class Current(Exception):
        pass

    def set_device(device):
        raise Current(str(device))

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    threads = torch.get_num_threads()
    try:
        with pytest.raises(Current, match="cuda:1"):
            worker.start({"threads": threads, "config": {}, "dtype": "float32", "device": "cuda:1"})
    finally:
        torch.set_num_threads(threads)


def test_reward_models_are_checked_before_any_work(tmp_path, cache_dir, reward_dir):
    with pytest.raises(ConfigError, match="reward=model needs reward.path=DIR"):
        check(compose(["reward=model"]))
    with pytest.raises(ConfigError, match="no config.json"):
        check(compose(["reward=model", f"reward.path={tmp_path}"]))
    two = tiny_reward_model(tmp_path / "two_labels", num_labels=2)
    with pytest.raises(ConfigError, match=r"one output \(num_labels = 1\); this one has 2"):
        check(compose(["reward=model", f"reward.path={two}"]))
    with pytest.raises(ConfigError, match=r"reward.weights has 1 values for 1 reward model\(s\) and 1 reward.fn"):
        fn = tmp_path / "f.py"
        fn.write_text("def f(completions, **kw):\n    return [0.0] * len(completions)\n")
        check(compose(["reward=model", f"reward.path={reward_dir}", f"reward.fn={fn}:f", "reward.weights=[1.0]"]))
    from gspo.config.checks import ignored_override

    assert "only reward=model" in ignored_override([compose(["reward=python"])], f"reward.path={reward_dir}")
