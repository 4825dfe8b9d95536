"""Multi-process training (gloo on the CPU): 2 ranks x P prompts compute what 1 process x 2P
prompts computes -- the same completions and rewards, loss and updated weights -- and the
ways to start such a run (`gspo train hardware=cpu-ddp`, torchrun by hand, resume) work.
Hydra's sweep launchers (joblib, submitit) run a tiny sweep."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from gspo.config.loading import compose
from gspo.core.errors import ConfigError
from gspo.tasks import build_task
from gspo.train.loop.trainer import train
from gspo.train.ranks import distributed, launcher
from gspo.train.run import checkpoint
from gspo.train.start.warm_start import base_model
from tests.conftest import child_env, tiny


def small(cache_dir, **extra) -> list[str]:
    """A dense tiny model, 4 prompts x 4 completions (2 prompts a rank), 2 minibatches, 1 step;
    GRPO with token-mean aggregation and a KL reference, so the loss scaling by token counts
    and the reference model are on the path."""
    opts = {"model": "qwen3-tiny", "algo": "grpo", "algo.agg": "token_mean", "train.steps": 1, "train.lr": 1e-3,
            "train.warmup_steps": 0, "logger.wandb_cfg.samples_every": 1, **extra}
    return tiny(cache_dir, **opts)


def cli(*args, cwd, torchrun: int = 0, timeout: int = 300) -> subprocess.CompletedProcess:
    env = child_env()
    runner = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={torchrun}"] if torchrun else []
    res = subprocess.run([sys.executable, *runner, "-m", "cli.main", *args], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[:3000] + "\n...\n" + res.stderr[-2000:]  # a rank's own error comes first
    return res


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(checkpoint.latest(run_dir) / "model.safetensors")


def run_dirs(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.rglob("config.yaml") if p.parent.name != ".hydra")


# --------------------------------------------------------------------------- the pieces


def test_a_group_samples_the_same_completions_in_any_batch():
    """Per-group generators: sampling 4 prompts at once = sampling them 2 and 2 (different padding, lengths)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from gspo.models.build import char_tokenizer
    from gspo.rollout.decoding.generate import generate
    from gspo.rollout.decoding.params import SamplingParams

    tok = char_tokenizer("0123456789+=")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, head_dim=16, intermediate_size=64,
                                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)).eval()
    prompts = ["1+2=", "12+345=", "7=", "98+1="]
    gens = lambda lo, hi: [distributed.group_generator(3, 1, 0, i, "cpu") for i in range(lo, hi)]  # noqa: E731
    whole = generate(model, tok, prompts, 4, SamplingParams(12), generator=gens(0, 4))
    halves = [generate(model, tok, prompts[:2], 4, SamplingParams(12), generator=gens(0, 2)),
              generate(model, tok, prompts[2:], 4, SamplingParams(12), generator=gens(2, 4))]
    assert whole.texts == halves[0].texts + halves[1].texts
    assert whole.lengths.tolist() == torch.cat([h.lengths for h in halves]).tolist()
    assert len(set(whole.texts)) > 4  # really sampled


def test_minibatches_of_one_process_are_the_union_of_the_ranks():
    P, G, M, W = 4, 4, 2, 2
    n = P * G // W  # rows per rank
    one = distributed.minibatches(torch.arange(P).repeat_interleave(G), G, M, seed=0, step=1)
    ranks = [distributed.minibatches(torch.arange(r * P // W, (r + 1) * P // W).repeat_interleave(G), G, M, 0, 1,
                                     offset=r * n) for r in range(W)]
    for m in range(M):
        assert torch.cat([ranks[r][m] + r * n for r in range(W)]).tolist() == one[m].tolist()
        assert all(len(ranks[r][m]) == n // M for r in range(W))
    assert sorted(torch.cat(one).tolist()) == list(range(P * G))  # every row once
    assert one[0].tolist() != list(range(0, P * G, M))  # shuffled within groups


def test_profiles_compose_and_bad_splits_are_config_errors():
    for name, strategy, backend in [("cpu-ddp", "ddp", "gloo"), ("gpu-ddp", "ddp", "nccl"), ("gpu-fsdp", "fsdp", "nccl")]:
        hw = compose([f"hardware={name}"]).hardware
        assert (hw.strategy, hw.backend) == (strategy, backend) and hw.nproc >= 1
    distributed.check(compose(["hardware=cpu-ddp", "rollout.prompts_per_step=4"]))
    with pytest.raises(ConfigError, match="multiple of 2"):
        distributed.check(compose(["hardware=cpu-ddp", "rollout.prompts_per_step=3"]))
    with pytest.raises(ConfigError, match="minibatches"):
        distributed.check(compose(["hardware=cpu-ddp", "rollout.prompts_per_step=2", "rollout.group_size=2",
                                   "train.minibatches=4"]))
    with pytest.raises(ConfigError, match="nccl"):
        distributed.check(compose(["hardware=gpu-ddp", "hardware.device=cpu"]))


def test_cli_rejects_a_prompt_count_that_does_not_split(tmp_path):
    env = child_env()
    res = subprocess.run([sys.executable, "-m", "cli.main", "train", "hardware=cpu-ddp", "hardware.nproc=3"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "multiple of 3" in res.stderr and "Traceback" not in res.stderr


# --------------------------------------------------------------------------- one update, 1 process vs 2 gloo ranks


def one_update(rank: int, world: int, cfg, truncated_prompts: int) -> dict:
    """One `_update` (advantages, minibatch steps) on a fixed batch: P prompts x G completions sampled from a
    fresh tiny model, fixed rewards that differ within groups; this rank holds its share of the prompts. The
    first `truncated_prompts` prompts' completions are marked truncated (the overlong filter drops them)."""
    import random

    from gspo.models.build import build_model, char_tokenizer
    from gspo.rollout.decoding.generate import generate
    from gspo.rollout.decoding.params import SamplingParams
    from gspo.train.loop.critic import Critic
    from gspo.train.loop.moe_step import MoEStep
    from gspo.train.loop.setup import Setup
    from gspo.train.loop.trainer import Batch, _update

    task = build_task(cfg.task)
    tok = char_tokenizer(task.alphabet)
    model = build_model(cfg.model, len(tok), tok, seed=0)
    dist = distributed.Dist(rank=rank, world=world, strategy="ddp" if world > 1 else "none")
    P, G = cfg.rollout.prompts_per_step, cfg.rollout.group_size
    lo, hi = dist.share(P)
    problems = task.sample_train(random.Random(0), P)[lo:hi]
    with torch.no_grad():
        ro = generate(model, tok, [p.prompt for p in problems], G, SamplingParams(cfg.rollout.max_new_tokens),
                      generator=[distributed.group_generator(0, 1, 0, i, "cpu") for i in range(lo, hi)])
    ro.prompt_index += lo
    ro.truncated = ro.prompt_index < truncated_prompts
    rewards = torch.tensor([(i * 7919 % 13) / 13 for i in range(P * G)])[lo * G : hi * G]
    policy = dist.wrap(model, torch.float32)
    # eps 1e-3, not 1e-8: Adam's first step lr * g / (|g| + eps) would turn the ranks' rounding of a
    # near-zero gradient into a move of up to lr; with a large eps it stays ~lr * rounding / eps
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2, eps=1e-3)
    s = Setup(dist, torch.float32, None, policy=policy, opt=opt, critic=Critic(cfg, dist),
              sched=torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0),
              moe_step=MoEStep.for_model(model, cfg, dist, old_pass=False))
    m = _update(cfg, s, Batch(ro, [None] * len(rewards), rewards, {}), 1)
    return {"loss": m["train/loss"], "grad_norm": m["train/grad_norm"],
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


UPDATE_CASES = {  # batch-level advantages, and a rank whose every row the overlong filter drops
    "reinforce_plus_plus": ["algo=reinforce_plus_plus"],
    "reinforce_plus_plus_baseline": ["algo=reinforce_plus_plus_baseline"],
    "batch_std": ["algo=grpo", "algo.advantage=batch_std"],
    "gpg": ["algo=gpg"],
    "overlong_token_mean": ["algo=dapo", "algo.overlong_filter=true"],
    "overlong_seq_mean": ["algo=grpo", "algo.beta=0", "algo.overlong_filter=true"],
    # objectives with a statistic of the minibatch's tokens (M2PO's second moment, Clip-Cov's covariance, token
    # count and random draw): over every rank's tokens, as one process computes it; thresholds that bite. (KL-Cov's
    # statistic is tested in test_losses.py: its |log pi - log pi_old| penalty has a gradient of +-coef wherever
    # the ratio is 1 up to rounding, as on a step's first minibatch, so its update follows the rounding there.)
    "m2po": ["algo=m2po", "algo.m2_threshold=1e-6"],
    "clip_cov": ["algo=clip_cov", "algo.clip_cov_ratio=0.2", "algo.clip_cov_lb=-10", "algo.clip_cov_ub=10"],
}


def update_configs() -> dict:
    """Each case's config, composed once here and handed to every process (composing is most of a case's time)."""
    base = ["model=qwen3-tiny", "model.hidden_size=32", "model.num_heads=2", "model.num_kv_heads=1",
            "model.intermediate_size=64", "rollout.prompts_per_step=4", "rollout.group_size=4",
            "rollout.max_new_tokens=4", "train.minibatches=2"]
    return {name: compose(base + extra) for name, extra in UPDATE_CASES.items()}


def all_update_cases(rank: int, world: int, configs: dict) -> dict:
    # a group whose rewards all differ, and the first rank's two prompts truncated in the overlong cases
    return {name: one_update(rank, world, cfg, 2 if "overlong" in name else 0) for name, cfg in configs.items()}


def test_one_update_on_two_ranks_is_the_one_process_update(tmp_path):
    """Batch-normalised advantages (REINFORCE++, batch std, GPG's alpha) use the whole batch's rewards, and a
    rank with no tokens adds nothing to the loss's denominator: 2 gloo ranks = 1 process, in loss, gradient
    norm and weights. (Before: REINFORCE++'s loss 0.0498 vs 0.0411, GPG's halved; the grad norm of the
    overlong case 2/3 of the one-process one.)"""
    from tests.helpers.gloo import run_ranks

    torch.set_num_threads(1)
    configs = update_configs()
    one = all_update_cases(0, 1, copy.deepcopy(configs))  # the ranks get them as composed
    two = run_ranks(all_update_cases, 2, tmp_path, configs)
    for name in UPDATE_CASES:
        a, (b0, b1) = one[name], (two[0][name], two[1][name])
        assert (b0["loss"] + b1["loss"]) / 2 == pytest.approx(a["loss"], rel=1e-5, abs=1e-7), name
        assert b0["grad_norm"] == b1["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), name
        for k in a["weights"]:
            torch.testing.assert_close(b0["weights"][k], a["weights"][k], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{name}: {k}: {m}")


INF = float("inf")


def reduce_counted(rank: int, world: int, cfg) -> dict:
    """`reduce_metrics` on each rank's own metrics, for the tests below (one spawn of gloo ranks for all)."""
    dist = distributed.Dist(rank=rank, world=world, strategy="ddp")
    C = distributed.COUNT
    counted = [{"reward/fn/a/mean": float("nan"), f"{C}reward/fn/a/mean": 0.0, "reward/fn/b/mean": 1.0,
                f"{C}reward/fn/b/mean": 1.0, "reward/mean": 0.2},
               {"reward/fn/a/mean": 0.5, f"{C}reward/fn/a/mean": 4.0, "reward/fn/b/mean": 0.0,
                f"{C}reward/fn/b/mean": 3.0, "reward/mean": 0.4}][rank]
    # rank 0 had no tokens (the loss's identities for min / max); DAPO's counts of this rank's groups
    totals = [{"policy/token_ratio_min": INF, "policy/token_ratio_max": -INF, "policy/ratio_min": INF,
               "policy/ratio_max": -INF, "sampling/batches": 2.0, "sampling/groups_drawn": 4.0,
               "sampling/groups_dropped": 3.0, "sampling/groups_kept": 1.0, "reward/mean": 0.0},
              {"policy/token_ratio_min": 0.8, "policy/token_ratio_max": 1.3, "policy/ratio_min": 0.9,
               "policy/ratio_max": 1.1, "sampling/batches": 2.0, "sampling/groups_drawn": 4.0,
               "sampling/groups_dropped": 2.0, "sampling/groups_kept": 2.0, "reward/mean": 0.5}][rank]
    nothing = {"policy/token_ratio_min": INF, "policy/token_ratio_max": -INF, "reward/mean": 0.0}  # no rank had tokens
    return {"counted": dist.reduce_metrics(counted, rows=4), "totals": dist.reduce_metrics(totals, rows=4),
            "nothing": dist.reduce_metrics(nothing, rows=4), "evaluated": evaluated(dist, cfg)}


EVAL_PROBLEMS = 7  # split 4 + 3 over 2 ranks: unequal shares


def evaluated(dist: distributed.Dist, cfg) -> dict:
    """The Evaluator's step-0 metrics on `dist`, scoring EVAL_PROBLEMS problems with a stand-in for the model's
    evaluation whose verdicts are known (answer divisible by 3 or 5): the recombination and the gather alone."""
    from gspo.tasks import Problem
    from gspo.train.evaluation import evaluator

    def scored(model, tokenizer, task, problems, *args, **kwargs) -> dict:
        correct = [int(p.answer) % 3 == 0 or int(p.answer) % 5 == 0 for p in problems]
        return {"eval/accuracy": sum(correct) / len(correct), "eval/n": len(correct), "correct": correct,
                "eval/len_mean": sum(int(p.answer) ** 2 for p in problems) / len(problems)}

    evaluator.evaluate = scored  # (in a spawned rank, or restored by the caller)
    problems = [Problem(f"{i}+0=", str(i)) for i in range(EVAL_PROBLEMS)]
    return evaluator.Evaluator(cfg, dist, None, None, None, problems).maybe_run(0)


@pytest.fixture(scope="module")
def reduced(tmp_path_factory) -> list[dict]:
    from tests.helpers.gloo import run_ranks

    # resolved here: a spawned rank has not registered the config's resolvers (eval.every's)
    return run_ranks(reduce_counted, 2, tmp_path_factory.mktemp("reduce"),
                     OmegaConf.create(OmegaConf.to_container(compose([]), resolve=True)))


def test_a_reward_functions_mean_over_ranks_weighs_the_rows_it_scored(reduced):
    """A function that returned None on every row of one rank: its mean is the other rank's, not NaN; and
    means over different numbers of scored rows are weighed by them (before: a mean of rank means)."""
    one = distributed.Dist().reduce_metrics({"reward/mean": 0.2, f"{distributed.COUNT}reward/mean": 4.0}, rows=4)
    assert one == {"reward/mean": 0.2}  # one process: the counts are not logged
    for got in (rank["counted"] for rank in reduced):
        assert got["reward/fn/a/mean"] == pytest.approx(0.5)
        assert got["reward/fn/b/mean"] == pytest.approx(0.25)
        assert got["reward/mean"] == pytest.approx(0.3) and not any(k.startswith(distributed.COUNT) for k in got)


def test_counts_are_summed_over_ranks_and_a_rank_without_tokens_has_no_extremes(reduced):
    """Counts are the run's totals (DAPO's groups: before, each rank's share averaged over ranks, 3.5 of 7 groups
    dropped); a rank without tokens is left out of the min and max (before: its 1.0 was the step's maximum
    ratio); with no tokens on any rank the extremes are not logged (in one process either), nor a made-up 1."""
    for got in (rank["totals"] for rank in reduced):
        assert (got["sampling/groups_drawn"], got["sampling/groups_dropped"], got["sampling/groups_kept"]) == (8, 5, 3)
        assert got["sampling/batches"] == 2  # every rank draws the same batches, each a batch of the whole run
        assert (got["policy/token_ratio_min"], got["policy/token_ratio_max"]) == pytest.approx((0.8, 1.3))
        assert (got["policy/ratio_min"], got["policy/ratio_max"]) == pytest.approx((0.9, 1.1))
        assert got["reward/mean"] == pytest.approx(0.25)  # a mean stays a mean
    for got in [rank["nothing"] for rank in reduced] + [distributed.Dist().reduce_metrics(
            {"policy/token_ratio_min": INF, "policy/token_ratio_max": -INF, "reward/mean": 0.0}, rows=4)]:
        assert got == {"reward/mean": 0.0}


def merged_under_fsdp(rank: int, world: int, lora: int) -> dict:
    """The weights a sampler is sent (`Dist.merged_parameters`) from a model sharded over `world` gloo ranks, against
    the same model's whole (`adapters.merged_parameters` before sharding); at each weight, how many elements the rank
    held whole."""
    from torch.distributed.tensor import DTensor

    from gspo.models import adapters
    from gspo.models.build import build_model, char_tokenizer

    tok = char_tokenizer("0123456789+=")
    cfg = compose(["model=qwen3-tiny", "model.num_layers=4", f"model.lora.r={lora}"])
    model = adapters.apply(build_model(cfg.model, len(tok), tok, seed=0), cfg.model.lora, ".", seed=0)
    with torch.no_grad():  # LoRA's B starts at zero: moved, so that the merge adds something
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    whole = {name: value.clone() for name, value, _ in adapters.merged_parameters(model)}
    dist = distributed.Dist(rank=rank, world=world, strategy="fsdp")
    dist.wrap(model, torch.float32)
    model(torch.tensor([[1, 2, 3]]))  # FSDP's root keeps its weights gathered after a forward
    names, sent, held = [], {}, []
    for name, value, _ in dist.merged_parameters(model):
        names.append(name)
        sent[name] = value.clone()
        held.append(sum(p.numel() for p in model.parameters() if not isinstance(p, DTensor)))
    return {"names": names, "whole": whole, "sent": sent, "held": held,
            "total": sum(v.numel() for v in whole.values())}


FSDP_LORA = (0, 4)


def merged_under_fsdp_each(rank: int, world: int) -> dict:
    return {lora: merged_under_fsdp(rank, world, lora) for lora in FSDP_LORA}


@pytest.fixture(scope="module")
def fsdp_sent(tmp_path_factory) -> list[dict]:
    """merged_under_fsdp for each LoRA rank, on one pair of gloo ranks (spawning them costs more than the work)."""
    from tests.helpers.gloo import run_ranks

    return run_ranks(merged_under_fsdp_each, 2, tmp_path_factory.mktemp("fsdp"))


@pytest.mark.parametrize("lora", FSDP_LORA)
def test_fsdp_sends_a_sampler_the_whole_weights_one_unit_at_a_time(lora, fsdp_sent):
    """What an engine is pushed under FSDP (rollout.engine=vllm, hardware.strategy=fsdp): every weight whole (LoRA:
    merged), bitwise what the unsharded model gives, on every rank; gathered one FSDP unit at a time, so a rank never
    holds the model whole: at most the largest unit (the root: embeddings, norm, head), less than half the model."""
    for got in (rank[lora] for rank in fsdp_sent):
        assert sorted(got["names"]) == sorted(got["whole"])  # every weight, once
        for name, value in got["whole"].items():
            assert torch.equal(got["sent"][name], value), name
        assert 0 < max(got["held"]) < got["total"] / 2, (max(got["held"]), got["total"])


# --------------------------------------------------------------------------- equivalence


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, cache_dir):
    run_dir = tmp_path_factory.mktemp("one-process")
    train(compose(small(cache_dir)), run_dir)
    return run_dir


def assert_adam_close(b: torch.Tensor, a: torch.Tensor, lr: float, name: str) -> None:
    """Weights after one AdamW step, 2 ranks (b) vs 1 process (a).

    Adam's first step is lr * g / (|g| + eps): an element whose gradient is near eps (1e-8) moves by an
    amount that the gradient's rounding decides (the ranks sum their halves in another order), up to
    ~lr. Such elements are rare (1 in 256 to 1 in 1,024 seen: 1.5e-6 to 7.5e-6 off at lr 1e-3 and 0.05), so:
    every element within 1% of lr, and all but 1% of them within 5e-6. A wrong loss scale or a missing
    gradient would move whole tensors (the loss and the gradient norm are compared exactly elsewhere).
    """
    diff = (b.float() - a.float()).abs()
    assert float(diff.max()) <= 0.01 * lr, f"{name}: max |diff| {float(diff.max()):.3g} > 1% of lr {lr}"
    off = float((diff > 5e-6 + 1e-5 * a.float().abs()).float().mean())
    assert off <= 0.01, f"{name}: {off:.2%} of the elements differ by more than 5e-6"


def assert_same_run(one: Path, two: Path) -> None:
    a, b = jsonl(one / "metrics.jsonl"), jsonl(two / "metrics.jsonl")
    assert [m["step"] for m in a] == [m["step"] for m in b] == [0, 1]
    assert a[0]["eval/accuracy"] == b[0]["eval/accuracy"]  # evaluation split over ranks and recombined
    # per-row metrics, the loss and the gradient are exact; per-token diagnostics (clip/*, kl/*, entropy)
    # are averaged over ranks with equal weight, so they differ by the ranks' token-count imbalance
    for key in ("reward/mean", "reward/std", "reward/frac_zero_std", "response/len_mean", "response/truncated_frac",
                "train/loss", "train/grad_norm"):
        assert b[1][key] == pytest.approx(a[1][key], rel=1e-5, abs=1e-7), key
    # the first rank's rows are the first rows of the one-process batch: same completions, same rewards
    sa, sb = jsonl(one / "samples.jsonl"), jsonl(two / "samples.jsonl")
    assert [(s["prompt"], s["completion"], s["reward"]) for s in sa] == [(s["prompt"], s["completion"], s["reward"])
                                                                         for s in sb]
    wa, wb = weights(one), weights(two)
    assert wa.keys() == wb.keys()
    cfg = OmegaConf.load(one / "config.yaml")
    for k in wa:
        assert_adam_close(wb[k], wa[k], lr=cfg.train.lr, name=k)
    base = load_file(base_model(cfg, build_task(cfg.task)) / "model.safetensors")
    assert max((wa[k] - base[k]).abs().max().item() for k in wa if k in base) > 1e-4  # the step moved the weights


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, cache_dir) -> tuple[Path, subprocess.CompletedProcess]:
    """`one_process`'s run under `gspo train hardware=cpu-ddp` (2 gloo processes, launched by gspo): its directory
    and the command's output."""
    root = tmp_path_factory.mktemp("two-processes")
    res = cli("train", "hardware=cpu-ddp", f"hydra.run.dir={root / 'ddp'}", *small(cache_dir), cwd=root)
    return root / "ddp", res


def test_an_evaluation_over_two_ranks_is_the_whole_splits_in_its_order(reduced, monkeypatch):
    """The Evaluator under 2 ranks of unequal shares: eval/n is the problems scored by both (before: 25/7, the
    share-weighted mean of the shares); rank 0 hands the logger the whole split's outcomes in the split's order,
    the record one process makes ("1001011": the strided shares put back in place); the means as one process's."""
    from gspo.train.evaluation import evaluator
    from gspo.train.evaluation.heldout import HELDOUT

    monkeypatch.setattr(evaluator, "evaluate", evaluator.evaluate)  # restored after `evaluated` replaces it
    one = evaluated(distributed.Dist(), compose([]))
    assert one[HELDOUT]["correct"] == "1001011" and one["eval/n"] == EVAL_PROBLEMS
    two = [rank["evaluated"] for rank in reduced]
    assert two[0][HELDOUT] == one[HELDOUT] and HELDOUT not in two[1]  # rank 0 alone writes heldout.jsonl
    for got in two:
        assert got["eval/n"] == EVAL_PROBLEMS and isinstance(got["eval/n"], int)
        # per-problem means, weighted by the shares: 13, where the mean of the ranks' means is 12.83
        assert (got["eval/accuracy"], got["eval/len_mean"]) == pytest.approx((one["eval/accuracy"], 13.0))


def test_two_ranks_compute_what_one_process_computes(one_process, two_processes):
    """`gspo train hardware=cpu-ddp` (2 gloo processes, launched by gspo) vs `hardware=cpu`."""
    run, res = two_processes
    assert "starting 2 processes" in res.stdout and "run directory" in res.stdout
    assert_same_run(one_process, run)


def test_an_evaluation_under_two_ranks_counts_and_records_the_whole_split(one_process, two_processes):
    """eval/n is the problems every rank scored together, as summary.json says and one process logs (before: one
    rank's share, 8 of 16, so `gspo compare`'s eval SE was sqrt(2) too large); heldout.jsonl holds, per evaluation,
    the whole split's outcomes in its order, the same string as one process writes, with eval/accuracy x n ones."""
    from gspo.train.evaluation.heldout import HELDOUT, read_outcomes, read_records

    records = {}
    for run in (one_process, two_processes[0]):
        n = json.loads((run / "summary.json").read_text())["eval_n"]
        rows = [m for m in jsonl(run / "metrics.jsonl") if "eval/accuracy" in m]
        assert [m["step"] for m in rows] == [0, 1] and all(m["eval/n"] == n == 16 for m in rows)
        assert not any(HELDOUT in m for m in jsonl(run / "metrics.jsonl"))
        records[run] = read_records(run)
        assert [r["step"] for r in records[run]] == [0, 1]
        for r, m in zip(records[run], rows):
            assert r["n"] == n == len(r["correct"]) and set(r["correct"]) <= {"0", "1"}
            assert r["correct"].count("1") == round(m["eval/accuracy"] * n)
        assert read_outcomes(run) == {r["step"]: [c == "1" for c in r["correct"]] for r in records[run]}
    assert records[one_process] == records[two_processes[0]]
    assert len({r["problems"] for r in records[one_process]}) == 1  # every evaluation scores the same problems


@pytest.mark.slow
def test_fsdp_computes_what_one_process_computes(one_process, tmp_path, cache_dir):
    """fully_shard over 2 gloo processes (parameters, gradients, AdamW state sharded), then resume it."""
    cli("train", "hardware=cpu-ddp", "hardware.strategy=fsdp", f"hydra.run.dir={tmp_path / 'fsdp'}",
        *small(cache_dir), cwd=tmp_path)
    assert_same_run(one_process, tmp_path / "fsdp")
    optim = checkpoint.load_state(checkpoint.latest(tmp_path / "fsdp"))["optimizer"]
    assert isinstance(optim["param_groups"][0]["params"][0], str)  # full state, keyed by parameter name
    cli("train", f"resume={tmp_path / 'fsdp'}", "train.steps=2", cwd=tmp_path)
    assert [m["step"] for m in jsonl(tmp_path / "fsdp" / "metrics.jsonl")] == [0, 1, 2]


MOE_CASES = {  # the load-balancing loss is on (and large, so a wrong cross-rank mean cannot hide)
    "moe": {"model": "qwen3-moe", "model.router_aux_loss_coef": 0.1},
    "moe-R2": {"model": "qwen3-moe", "model.router_aux_loss_coef": 0.1, "moe.routing_replay": "R2",
               "rollout.old_logprobs": "recompute"},
    "moe-R3": {"model": "qwen3-moe", "model.router_aux_loss_coef": 0.1, "moe.routing_replay": "R3",
               "rollout.old_logprobs": "recompute"},
}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_two_ranks_compute_what_one_process_computes(case, strategy, tmp_path, cache_dir):
    """Routing Replay on a stock Hugging Face MoE, with its load-balancing loss, under DDP and FSDP2:
    2 ranks compute the one-process loss, gradient and updated weights."""
    opts = small(cache_dir, **MOE_CASES[case])
    train(compose(opts), tmp_path / "one")
    cli("train", "hardware=cpu-ddp", f"hardware.strategy={strategy}", f"hydra.run.dir={tmp_path / 'two'}", *opts,
        cwd=tmp_path)
    assert_same_run(tmp_path / "one", tmp_path / "two")
    one = jsonl(tmp_path / "one" / "metrics.jsonl")[1]
    assert one["moe/aux_loss"] > 0 and "moe/routing_volatility" in one
    if "moe.routing_replay" in MOE_CASES[case]:
        assert one["moe/update_mismatch"] == 0.0  # the update passes routed as replayed


@pytest.mark.slow
def test_a_bf16_sampler_copy_per_rank_computes_what_one_process_computes(tmp_path, cache_dir):
    """rollout.dtype=bfloat16 under DDP: each rank syncs its own bf16 copy from its replica, samples its
    groups with it; with R3 the update replays that copy's routing. Same completions, loss and weights."""
    opts = small(cache_dir, **{"model": "qwen3-moe", "rollout.dtype": "bfloat16", "moe.routing_replay": "R3"})
    train(compose(opts), tmp_path / "one")
    cli("train", "hardware=cpu-ddp", f"hydra.run.dir={tmp_path / 'two'}", *opts, cwd=tmp_path)
    assert_same_run(tmp_path / "one", tmp_path / "two")
    one, two = jsonl(tmp_path / "one" / "metrics.jsonl")[1], jsonl(tmp_path / "two" / "metrics.jsonl")[1]
    assert one["rollout/mismatch_kl"] > 0 and two["time/weight_sync_s"] >= 0


def test_load_balancing_loss_summed_over_ranks_is_the_one_process_loss():
    """The aux loss is a product of batch means: each rank's share, summed, is the whole batch's value,
    and so are the gradients (what DDP's average of world x share computes)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from gspo.models.moe import load_balancing_loss

    g = torch.Generator().manual_seed(0)
    L, B, T, E, k = 2, 4, 5, 6, 2
    logits = [torch.randn(B * T, E, generator=g, requires_grad=True) for _ in range(L)]
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    whole = load_balancing_loss(logits, k, mask)
    hf = load_balancing_loss_func(tuple(logits), E, k, mask)
    torch.testing.assert_close(whole, hf)  # Hugging Face's own value, one process
    # two "ranks" with rows [0, 2) and [2, 4): all_sum adds the other rank's counts
    halves = [[x.view(B, T, E)[r * 2 : (r + 1) * 2].reshape(-1, E) for x in logits] for r in range(2)]
    masks = [mask[:2], mask[2:]]

    def counts(r):
        with torch.no_grad():
            m = masks[r].reshape(-1).float()
            c = torch.zeros(E)
            for x in halves[r]:
                c.scatter_add_(0, x.softmax(-1).topk(k).indices.reshape(-1), m.repeat_interleave(k))
            return torch.cat([c, (m.sum() * L)[None]])

    both = counts(0) + counts(1)
    shares = [load_balancing_loss(halves[r], k, masks[r], all_sum=lambda x: both) for r in range(2)]
    torch.testing.assert_close(shares[0] + shares[1], whole)
    g_whole = torch.autograd.grad(whole, logits)
    g_ranks = torch.autograd.grad(shares[0] + shares[1], logits)
    for a, b in zip(g_ranks, g_whole):
        torch.testing.assert_close(a, b)


# --------------------------------------------------------------------------- DAPO's refill, failures


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_dapo_refills_in_step_on_every_rank(strategy, tmp_path, cache_dir):
    """DAPO under 2 ranks: each refills its own share, and they agree after every draw, so they draw the same
    number of batches and FSDP's weight gathers pair up (before: rank means 3.0, 6.0, 4.5 under DDP; FSDP hung at
    step 3). A harder task (3 digits) so that groups are dropped and refilled."""
    opts = small(cache_dir, algo="dapo", **{"algo.agg": "null", "train.steps": 3, "algo.max_sample_batches": 4,
                                            "algo.filter_metric": "correct"})
    cli("train", "hardware=cpu-ddp", f"hardware.strategy={strategy}", f"hydra.run.dir={tmp_path / 'run'}", *opts,
        cwd=tmp_path, timeout=300)
    steps = jsonl(tmp_path / "run" / "metrics.jsonl")[1:]
    assert len(steps) == 3
    for m in steps:  # the mean over ranks of equal integers is an integer
        assert m["sampling/batches"] == int(m["sampling/batches"]) >= 1
        assert m["sampling/groups_drawn"] == 4 * m["sampling/batches"]  # every draw: the step's 4 prompts' groups


def test_dapo_counts_the_groups_of_every_rank(tmp_path, cache_dir):
    """DAPO's sampling/groups_* under 2 ranks are the run's totals, what one process logs for the same groups
    (before: each rank's share averaged over ranks, half the count, so `gspo compare`'s completions column was
    halved). One draw (algo.max_sample_batches=1), so that both sample the same groups with the same weights."""
    opts = small(cache_dir, algo="dapo", **{"algo.agg": "null", "algo.max_sample_batches": 1, "task.eval_size": 4,
                                            "logger.wandb_cfg.samples_every": 0})
    train(compose(opts), tmp_path / "one")
    cli("train", "hardware=cpu-ddp", f"hydra.run.dir={tmp_path / 'two'}", *opts, cwd=tmp_path)
    a, b = (jsonl(tmp_path / run / "metrics.jsonl")[1] for run in ("one", "two"))
    keys = ("sampling/batches", "sampling/groups_drawn", "sampling/groups_dropped", "sampling/groups_kept")
    assert [b[k] for k in keys] == [a[k] for k in keys]
    assert a["sampling/batches"] == 1 and a["sampling/groups_drawn"] == 4  # rollout.prompts_per_step groups
    assert a["sampling/groups_dropped"] + a["sampling/groups_kept"] == 4
    assert jsonl(tmp_path / "two" / "metrics.jsonl")[0]["eval/n"] == 4


FLAKY = """
import os, time
def flaky(completions, trainer_state, **kw):  # fine on rank 0; on rank 1 from step 2 on: MODE
    if os.environ.get("RANK") == "1" and trainer_state.global_step >= 1:
        if MODE == "raise":
            raise ValueError("boom on rank 1")
        if MODE == "hang":
            time.sleep(1000)
        if MODE == "kill":
            os.kill(os.getpid(), 9)
    return [float(len(c)) for c in completions]
"""


@pytest.mark.parametrize("mode, exit_code, line", [
    ("raise", 2, r"rank 1, step 2: RewardError: reward function .*flaky raised ValueError: boom on rank 1 on sample 0"),
    ("kill", 1, r"rank 1, step 2: killed by SIGKILL, with no error of its own; the other ranks were stopped"),
    pytest.param("hang", 1, r"rank 0, step 2: waited more than hardware.collective_timeout_s=8 s in a collective "
                            r"for rank 1, which hung", marks=pytest.mark.slow),
])
def test_a_failing_rank_ends_every_rank_in_one_line(mode, exit_code, line, tmp_path, cache_dir):
    """A reward function that raises, a process killed with -9, a process that hangs, each on rank 1 only: every
    rank ends, the output is one line naming the rank, the step and the cause (the user's exception), no
    traceback, no process left; the checkpoint of step 1 stays intact and summary.json says failed. (Before: 39
    lines of rank 0's gloo traceback, the reward's exception nowhere; a hang waited for ever.)"""
    import re

    (tmp_path / "fns.py").write_text(FLAKY.replace("MODE", repr(mode)))
    opts = small(cache_dir, reward="python", **{"reward.fn": f"{tmp_path}/fns.py:flaky", "train.steps": 4,
                                               "train.checkpoint_every": 1, "reward.timeout_s": 0,
                                               "hardware.collective_timeout_s": 8})
    env = child_env()
    res = subprocess.run([sys.executable, "-m", "cli.main", "train", "hardware=cpu-ddp", *opts,
                          f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == exit_code, res.stderr[-3000:]
    errors = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(errors) == 1 and re.search(line, errors[0]), res.stderr[-3000:]
    assert "Traceback" not in res.stdout + res.stderr
    assert checkpoint.load_state(checkpoint.latest(tmp_path / "run"))["step"] == 1
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"
    left = subprocess.run(["pgrep", "-f", f"gspo.train.loop.trainer {tmp_path / 'run'}"], capture_output=True, text=True)
    assert left.stdout == "", "a worker outlived its run"


@pytest.mark.slow
def test_killing_the_launcher_stops_its_workers_as_a_preemption(tmp_path, cache_dir):
    """kill -9 of `gspo train` (the launcher): its workers get SIGTERM from the kernel (PR_SET_PDEATHSIG),
    finish their step, checkpoint it and leave; the run resumes. (Before: both ranks ran on, orphaned.)"""
    import signal
    import time

    opts = small(cache_dir, **{"train.steps": 10_000, "train.checkpoint_every": 1000})
    env = child_env()
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "train", "hardware=cpu-ddp", *opts,
                             f"hydra.run.dir={run}"], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not ((run / "metrics.jsonl").is_file() and len(jsonl(run / "metrics.jsonl")) > 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 60
    while time.time() < deadline and subprocess.run(["pgrep", "-f", f"gspo.train.loop.trainer {run}"],
                                                    capture_output=True).returncode == 0:
        time.sleep(0.2)
    assert subprocess.run(["pgrep", "-f", f"gspo.train.loop.trainer {run}"], capture_output=True).returncode == 1
    assert json.loads((run / "summary.json").read_text())["status"] == "preempted"
    done = checkpoint.load_state(checkpoint.latest(run))["step"]
    assert done == jsonl(run / "metrics.jsonl")[-1]["step"]  # the last finished step was checkpointed


# --------------------------------------------------------------------------- launching


@pytest.mark.slow
def test_torchrun_by_hand_then_resume_with_two_ranks(tmp_path, cache_dir):
    """`torchrun --nproc-per-node 2 -m cli.main train hardware=cpu-ddp`: one run directory for both ranks;
    then `gspo train resume=DIR` continues it with 2 ranks (every rank loads the checkpoint)."""
    res = cli("train", "hardware=cpu-ddp", *small(cache_dir), cwd=tmp_path, torchrun=2)
    assert res.stdout.count("run directory") == 1  # rank 0 reports
    (run,) = run_dirs(tmp_path / "outputs")
    assert [d for d in (tmp_path / "outputs").glob("*/*") if d.is_dir()] == [run]  # none left by rank 1's Hydra
    assert [m["step"] for m in jsonl(run / "metrics.jsonl")] == [0, 1]
    cli("train", f"resume={run}", "train.steps=2", cwd=tmp_path)
    assert [m["step"] for m in jsonl(run / "metrics.jsonl")] == [0, 1, 2]
    assert checkpoint.load_state(checkpoint.latest(run))["step"] == 2
    assert json.loads((run / "summary.json").read_text())["status"] == "finished"


def test_a_checkpoint_resumes_under_another_world_size(one_process, tmp_path):
    """A one-process checkpoint continues under 2 ranks (and its optimizer state loads). The run is a copy of
    `one_process` (the same 1-step run this test trained itself before). heldout.jsonl, as metrics.jsonl, loses
    what was written after the checkpoint (here a line of step 2 planted as a run killed after it would leave)."""
    import shutil

    from gspo.train.evaluation.heldout import read_records

    run = shutil.copytree(one_process, tmp_path / "run")
    with (run / "heldout.jsonl").open("a") as fh:
        fh.write(json.dumps({"step": 2, "n": 16, "problems": "planted", "correct": "1" * 16}) + "\n")
    # (another world size changes the numbers: a resume refused unless forced, tests/train/run/test_resume.py)
    cli("train", f"resume={run}", "train.steps=2", "hardware.strategy=ddp", "hardware.nproc=2", "force_resume=true",
        cwd=tmp_path)
    assert [m["step"] for m in jsonl(run / "metrics.jsonl")] == [0, 1, 2]
    assert OmegaConf.load(run / "config.yaml").hardware.strategy == "ddp"
    records = read_records(run)
    assert [r["step"] for r in records] == [0, 1, 2] and len({r["problems"] for r in records}) == 1


# --------------------------------------------------------------------------- real checkpoints


def test_hf_checkpoint_with_chat_template_and_gradient_checkpointing(tmp_path, cache_dir):
    """`model=hf model.path=DIR` on a Qwen3 checkpoint saved here, with a chat template (what a real
    Qwen3 tokenizer has) and gradient checkpointing on."""
    from gspo.models.build import load_pretrained
    from gspo.rollout.decoding.generate import encode_prompts

    cfg = compose(small(cache_dir))
    model, tok = load_pretrained(base_model(cfg, build_task(cfg.task)))
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    ckpt = tmp_path / "qwen3"
    model.save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    _, tok = load_pretrained(ckpt)
    assert tok.chat_template and encode_prompts(tok, ["1+2="], chat_template=True) == [tok("1+2=")["input_ids"]]
    summary = train(compose(small(cache_dir, model="hf", **{"model.path": str(ckpt),
                                                             "model.gradient_checkpointing": True})), tmp_path / "run")
    assert summary["status"] == "finished"
    assert summary["final_accuracy"] is not None


# --------------------------------------------------------------------------- sweep launchers


@pytest.mark.slow
def test_joblib_launcher_runs_a_two_job_sweep_in_parallel(tmp_path, cache_dir):
    """Through the CLI's own process. (By default: test_sweep runs a three-job sweep under the same launcher.)"""
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    cli("train", "-m", "hydra/launcher=parallel", "seed=0,1", *small(cache_dir, algo="gspo", **{"algo.agg": "null"}),
        cwd=tmp_path)
    jobs = run_dirs(tmp_path / "outputs" / "multirun")
    assert [json.loads((j / "summary.json").read_text())["status"] for j in jobs] == ["finished", "finished"]


@pytest.mark.slow
def test_submitit_launcher_with_its_local_executor(tmp_path, cache_dir):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    cli("train", "-m", "hydra/launcher=local-submitit", "seed=0", *small(cache_dir), cwd=tmp_path)
    (job,) = run_dirs(tmp_path / "outputs" / "multirun")
    assert json.loads((job / "summary.json").read_text())["status"] == "finished"


# --------------------------------------------------------------------------- several nodes


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_two_torchrun_agents_as_two_nodes_compute_the_two_process_run(one_process, tmp_path, cache_dir):
    """Two torchrun agents (`--nnodes 2 --node-rank 0|1`, one process each) on this machine: one process group
    over both "nodes", bitwise the run of `hardware=cpu-ddp hardware.nproc=2`. One thread per process in both
    (torchrun by hand leaves the thread count to torch, all cores; another count rounds the backward otherwise)."""
    opts = small(cache_dir, **{"hardware.threads": 1})
    cli("train", "hardware=cpu-ddp", f"hydra.run.dir={tmp_path / 'ddp'}", *opts, cwd=tmp_path)
    env = child_env()
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={r}",
                               "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "cli.main",
                               "train", "hardware=cpu-ddp", f"hydra.run.dir={tmp_path / 'nodes'}", *opts],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for r in (0, 1)]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
    assert steady_rows(tmp_path / "ddp") == steady_rows(tmp_path / "nodes")
    wa, wb = weights(tmp_path / "ddp"), weights(tmp_path / "nodes")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_one_gspo_task_per_slurm_node_forms_one_run(tmp_path, cache_dir):
    """What `srun` (or the submitit launcher with hydra.launcher.nodes=2) starts: one `gspo train` task per
    node, SLURM's environment saying which; each starts its node's ranks with torchrun, and the ranks of both
    nodes form one run: the 2-process run, bitwise."""
    opts = small(cache_dir)
    cli("train", "hardware=cpu-ddp", f"hydra.run.dir={tmp_path / 'ddp'}", *opts, cwd=tmp_path)
    job = str(10_000 + _free_port() % 10_000)
    procs = []
    for node in (0, 1):
        env = child_env(SLURM_JOB_ID=job, SLURM_JOB_NUM_NODES="2", SLURM_NTASKS="2", SLURM_NODEID=str(node),
                        SLURM_JOB_NODELIST="localhost")
        procs.append(subprocess.Popen([sys.executable, "-m", "cli.main", "train", "hardware=cpu-ddp",
                                       "hardware.nproc=1", f"hydra.run.dir={tmp_path / 'nodes'}", *opts],
                                      cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    assert "on each of 2 nodes" in outs[0] and "run directory" in outs[0] and "run directory" not in outs[1]
    assert steady_rows(tmp_path / "ddp") == steady_rows(tmp_path / "nodes")


def test_a_run_directory_the_nodes_do_not_share_is_refused(tmp_path):
    nodes = launcher.Nodes(count=2, index=1, master="localhost", port=29999)
    with pytest.raises(ConfigError, match="is not shared between the nodes: node 1 does not see node 0's files"):
        launcher.shared_between_nodes(tmp_path / "run", tmp_path / "cache", nodes, wait_s=0.5)
    assert launcher.first_host("gpu[03-05,09],cpu1") == "gpu03" and launcher.first_host("a,b") == "a"
    with pytest.raises(ConfigError, match="run one gspo task per node"):
        os.environ.update({"SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "0", "SLURM_NTASKS": "16"})
        try:
            launcher.slurm_nodes()
        finally:
            for k in ("SLURM_JOB_NUM_NODES", "SLURM_NODEID", "SLURM_NTASKS"):
                os.environ.pop(k)


def steady_rows(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith(("time/", "throughput/"))}
            for m in jsonl(run_dir / "metrics.jsonl")]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ppo_and_trls_knobs_on_two_ranks_compute_what_one_process_computes(strategy, tmp_path, cache_dir):
    """PPO's critic (its own DDP / FSDP2 module and optimizer; GAE whitened over every rank's tokens) with TRL's
    high-entropy mask (the quantile over every rank's tokens) and entropy bonus (a token mean over every rank's):
    2 ranks compute the one-process loss, gradient norms, explained variance and updated policy and critic."""
    from gspo.train.loop.critic import CRITIC_FILE

    opts = small(cache_dir, algo="ppo", **{"algo.top_entropy_quantile": 0.5, "algo.entropy_coef": 0.05,
                                           "algo.critic.lr": 1e-3})
    train(compose(opts), tmp_path / "one")
    cli("train", "hardware=cpu-ddp", f"hardware.strategy={strategy}", f"hydra.run.dir={tmp_path / 'two'}", *opts,
        cwd=tmp_path)
    assert_same_run(tmp_path / "one", tmp_path / "two")
    a, b = jsonl(tmp_path / "one" / "metrics.jsonl")[1], jsonl(tmp_path / "two" / "metrics.jsonl")[1]
    for key in ("critic/explained_variance", "critic/value_mean", "critic/grad_norm"):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    ca, cb = (load_file(checkpoint.latest(tmp_path / d) / CRITIC_FILE) for d in ("one", "two"))
    assert ca.keys() == cb.keys()
    for k in ca:
        assert_adam_close(cb[k], ca[k], lr=1e-3, name=f"critic {k}")
