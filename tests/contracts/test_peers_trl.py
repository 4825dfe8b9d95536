"""Side by side with TRL's own code (trl 1.16, `pip install trl`; skipped where trl is not installed, as in CI):
GRPOTrainer's loss with its knobs (`delta`, `top_entropy_quantile`, `entropy_coef`), RLOOTrainer's loss, the
reference resets of `SyncRefModelCallback` and the rewards of a reward model named in `reward_funcs`.

TRL's methods are called on a trainer object built without its __init__ (no model, no dataset, no accelerate
launch): the attributes a method reads are set by hand, and the model's forward pass is replaced by the
log-probs and entropies under test, so the comparison is of TRL's arithmetic with gspo's on the same tensors.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from gspo.algos.entropy import entropy_bonus, high_entropy_mask
from gspo.algos.losses import policy_loss
from gspo.train.loop.reference import RefSync

trl = pytest.importorskip("trl")


class _Accelerator:
    """One process: gathers and reductions are the identity."""

    num_processes = 1
    process_index = 0
    is_main_process = True
    sync_gradients = True
    device = torch.device("cpu")

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x

    def gather(self, x):
        return x

    def gather_for_metrics(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x


def _trainer(cls, **attrs):
    t = object.__new__(cls)
    base = dict(accelerator=_Accelerator(), aux_loss_enabled=False, top_entropy_quantile=1.0,
                off_policy_mask_threshold=None, importance_sampling_level="token", beta=0.0, loss_type="grpo",
                epsilon_low=0.2, epsilon_high=0.2, use_vllm=False, vllm_importance_sampling_correction=False,
                model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
                _entropy_bonus_enabled=False, entropy_coef=0.0, use_adaptive_entropy=False,
                _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, max_completion_length=None,
                args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1))
    for k, v in {**base, **attrs}.items():
        object.__setattr__(t, k, v)
    return t


def _batch(seed: int, B: int = 6, T: int = 5):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 3, 4, 5, 2, 5])[:B]
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    old = -torch.rand(B, T, generator=g) * 3
    logp = (old + 0.5 * torch.randn(B, T, generator=g)).requires_grad_()
    entropy = (torch.rand(B, T, generator=g) * 2).requires_grad_()
    ref = old + 0.3 * torch.randn(B, T, generator=g)
    return logp, entropy, old, ref, mask, torch.randn(B, generator=g)


def _inputs(mask, **more):
    B, T = mask.shape
    return dict(prompt_ids=torch.zeros(B, 2, dtype=torch.long), prompt_mask=torch.ones(B, 2),
                completion_ids=torch.zeros(B, T, dtype=torch.long), completion_mask=mask, **more)


# TRL loss_type -> gspo's aggregation of the same loss
AGG = {"grpo": "seq_mean_token_mean", "bnpo": "token_mean", "dr_grpo": "seq_mean_token_sum_norm"}


@pytest.mark.parametrize("loss_type", sorted(AGG))
@pytest.mark.parametrize("knobs", [
    dict(delta=1.3), dict(top_entropy_quantile=0.4), dict(entropy_coef=0.05),
    dict(delta=1.25, top_entropy_quantile=0.2, entropy_coef=0.02, beta=0.04),
], ids=["delta", "top_entropy", "entropy_coef", "all+kl"])
def test_grpo_loss_and_its_knobs_equal_trls_compute_loss(loss_type, knobs):
    """Value and gradient (through the log-probs and the entropies) of TRL's GRPOTrainer._compute_loss and of
    gspo's policy loss composed as the trainer composes it (gspo/train/loop/trainer.py `_minibatch_loss`): the
    high-entropy mask on the policy term, the KL after it, the bonus over the kept tokens. TRL's KL is
    taken without its bias correction (`use_bias_correction_kl=False`: gspo has none, docs/algorithms.md)."""
    delta, rho = knobs.get("delta"), knobs.get("top_entropy_quantile", 1.0)
    coef, beta = knobs.get("entropy_coef", 0.0), knobs.get("beta", 0.0)
    for seed in range(3):
        logp, entropy, old, ref, mask, adv = _batch(seed)
        T = mask.shape[1]
        t = _trainer(trl.GRPOTrainer, loss_type=loss_type, top_entropy_quantile=rho, beta=beta,
                     _entropy_bonus_enabled=coef != 0, entropy_coef=coef, max_completion_length=T,
                     args=SimpleNamespace(delta=delta, use_bias_correction_kl=False, steps_per_generation=1))
        t._get_per_token_logps_and_entropies = lambda *a, **k: (logp, entropy, None)
        theirs = trl.GRPOTrainer._compute_loss(t, None, _inputs(mask, advantages=adv, old_per_token_logps=old,
                                                                  ref_per_token_logps=ref))

        keep = high_entropy_mask(entropy, mask, rho) if rho < 1 else None
        ours, _ = policy_loss("grpo", logp, old, adv, mask, agg=AGG[loss_type], max_tokens=T, delta=delta,
                              is_weight=None if keep is None else keep.float(), beta=beta, ref_logp=ref)
        if coef:
            total, n = entropy_bonus(entropy, mask if keep is None else mask * keep)
            ours = ours - coef * total / n
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
        for a, b in zip(torch.autograd.grad(ours, (logp, entropy), allow_unused=True),
                        torch.autograd.grad(theirs, (logp, entropy), allow_unused=True)):
            if a is None or b is None:
                assert a is None and b is None or float((a if a is not None else b).abs().max()) == 0.0
            else:
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_high_entropy_mask_equals_trls():
    for seed, rho in ((0, 0.2), (1, 0.5), (2, 0.0), (3, 1.0)):
        _, entropy, _, _, mask, _ = _batch(seed)
        t = _trainer(trl.GRPOTrainer)
        theirs = trl.GRPOTrainer.get_high_entropy_mask(t, entropy.detach(), mask, 1 - rho)
        assert torch.equal(high_entropy_mask(entropy, mask, rho), theirs)


def test_rloo_loss_equals_trls_rloo_trainer():
    """RLOOTrainer._compute_loss: PPO's clip on exp(sum of the completion's log-ratio), mean over completions."""
    for seed in range(3):
        logp, entropy, old, _, mask, adv = _batch(seed)
        t = _trainer(trl.RLOOTrainer, epsilon_low=0.2, epsilon_high=0.28)
        t._get_per_token_logps_and_entropies = lambda *a, **k: (logp, entropy, None)
        theirs = trl.RLOOTrainer._compute_loss(t, None, _inputs(mask, advantages=adv, old_logps=(old * mask).sum(1)))
        ours, stats = policy_loss("rloo", logp, old, adv, mask, eps_low=0.2, eps_high=0.28)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
        torch.testing.assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(theirs, logp)[0],
                                   rtol=0, atol=1e-6)
        # TRL counts clipped completions, gspo every token of a clipped completion (docs/algorithms.md)
        frac = sum(t._metrics["train"]["clip_ratio/region_mean"]) / len(t._metrics["train"]["clip_ratio/region_mean"])
        per_seq = torch.tensor(stats["clip/seq_frac"])
        assert float(per_seq) == pytest.approx(frac)


def test_reference_reset_equals_trls_sync_ref_model_callback():
    torch.manual_seed(0)
    policy, ref = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    theirs = torch.nn.Linear(4, 3)
    theirs.load_state_dict(ref.state_dict())
    from trl.trainer.callbacks import SyncRefModelCallback

    sync = RefSync(ref, alpha=0.6, every=3, dist=None)
    for update in range(1, 7):
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(0.1 * torch.randn_like(p))
        sync.after_update(policy, update)
        if update % 3 == 0:  # TRL's on_step_end: state.global_step % ref_model_sync_steps == 0
            SyncRefModelCallback._sync_target_model(policy, theirs, 0.6)
        for a, b in zip(ref.parameters(), theirs.parameters()):
            assert torch.equal(a, b)
    assert not torch.equal(ref.weight, policy.weight)


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    from tests.conftest import tiny_reward_model

    return tiny_reward_model(tmp_path_factory.mktemp("rm"))


@pytest.mark.parametrize("chat", [False, True])
def test_reward_model_scores_equal_trls_calculate_rewards(reward_dir, chat, monkeypatch):
    """A reward model named in TRL's reward_funcs (GRPOTrainer._calculate_rewards: prompt + completion, the chat
    template for messages, right padding, no special tokens, logits[:, 0]) and gspo's reward=model, on one batch."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from gspo.tasks.reward_model import RewardModel
    import trl.trainer.grpo_trainer as grpo_module

    monkeypatch.setattr(grpo_module, "gather", lambda x: x)
    tok = AutoTokenizer.from_pretrained(reward_dir)
    model = AutoModelForSequenceClassification.from_pretrained(reward_dir, num_labels=1)
    model.config.get_text_config().pad_token_id = tok.pad_token_id  # what GRPOTrainer.__init__ sets
    texts = ["1+2=", "33+4=", "5+66=", "7+8="]
    outs = ["3", "37", "80", "15+15"]
    if chat:
        prompts = [[{"role": "user", "content": p}] for p in texts]
        completions = [[{"role": "assistant", "content": c}] for c in outs]
    else:
        prompts, completions = texts, outs
    t = _trainer(trl.GRPOTrainer, reward_funcs=[model], reward_processing_classes=[tok], reward_func_names=["rm"],
                 _log_completion_extra=None, _log_metric=None, environments=None, chat_template_kwargs={},
                 is_deepspeed_enabled=False, state=SimpleNamespace(global_step=0),
                 args=SimpleNamespace(device=torch.device("cpu"), report_to=[]))
    theirs = trl.GRPOTrainer._calculate_rewards(t, [{"prompt": p} for p in prompts], prompts, completions, None)
    ours = RewardModel.load(str(reward_dir), "cpu", batch_size=3)(prompts, completions)  # 2 passes: 3 + 1 rows
    torch.testing.assert_close(torch.tensor(ours), theirs[:, 0], rtol=0, atol=1e-5)


def test_luspo_loss_equals_trls():
    """TRL's loss_type="luspo" with importance_sampling_level="sequence" (as TRL requires it) and the LUSPO paper's
    clip range, the KL term on: gspo's luspo (GSPO's objective, each sequence's tokens summed, mean over sequences)."""
    for seed in range(3):
        logp, entropy, old, ref, mask, adv = _batch(seed)
        logp = (old + 0.004 * torch.randn(old.shape, generator=torch.Generator().manual_seed(seed))).requires_grad_()
        t = _trainer(trl.GRPOTrainer, loss_type="luspo", importance_sampling_level="sequence", epsilon_low=2e-3,
                     epsilon_high=2.5e-3, beta=0.04)
        t._get_per_token_logps_and_entropies = lambda *a, **k: (logp, entropy, None)
        theirs = trl.GRPOTrainer._compute_loss(t, None, _inputs(mask, advantages=adv, old_per_token_logps=old,
                                                                  ref_per_token_logps=ref))
        ours, stats = policy_loss("luspo", logp, old, adv, mask, eps_low=2e-3, eps_high=2.5e-3, beta=0.04, ref_logp=ref)
        assert 0 < stats["clip/seq_frac"] < 1  # some sequences clipped, some not
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
        torch.testing.assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(theirs, logp)[0],
                                   rtol=0, atol=1e-6)


@pytest.mark.parametrize("correction", [None, "token_truncate", "token_mask"])
def test_vespo_loss_equals_trls(correction):
    """TRL's loss_type="vespo" (its `get_gamma_weights` and `_compute_loss`, default k / lambda), without a vLLM
    correction and with its token-level ones: TRL folds the corrected ratio pi_old / mu into the sequence weight W;
    gspo's vespo reads the correction's weight (`is_weight`) the same way instead of multiplying the loss by it."""
    for seed in range(3):
        logp, entropy, old, _, mask, adv = _batch(seed)
        g = torch.Generator().manual_seed(seed + 10)
        logp = (old + 0.1 * torch.randn(old.shape, generator=g)).requires_grad_()
        rho = None
        if correction:  # TRL's ratio pi_old / mu with C_max 3 (its default): truncated, or zero outside [0, 3]
            rho = torch.exp(torch.randn(old.shape, generator=g) * 0.7) * mask + (1 - mask)
            rho = rho.clamp(max=3.0) if correction == "token_truncate" else rho.masked_fill(rho > 3.0, 0.0)
        t = _trainer(trl.GRPOTrainer, loss_type="vespo", use_vllm=correction is not None,
                     vllm_importance_sampling_correction=correction is not None,
                     args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1,
                                          vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
                                          vespo_lambda_neg=2.0))
        t._get_per_token_logps_and_entropies = lambda *a, **k: (logp, entropy, None)
        more = {} if rho is None else {"importance_sampling_ratio": rho}
        theirs = trl.GRPOTrainer._compute_loss(t, None, _inputs(mask, advantages=adv, old_per_token_logps=old,
                                                                  num_items_in_batch=mask.sum(), **more))
        ours, _ = policy_loss("vespo", logp, old, adv, mask, is_weight=rho)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
        torch.testing.assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(theirs, logp)[0],
                                   rtol=0, atol=1e-6)
