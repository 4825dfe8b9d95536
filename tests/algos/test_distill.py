"""On-policy distillation (teacher.path): the reverse-KL component by hand and as the gradient of the KL, the teacher
beside the reference model, its tokenizer check, and runs with and without the RL term."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cli.main import app
from gspo.algos.distill import distill_metrics, reverse_kl_term
from gspo.config.loading import compose
from gspo.core.errors import ConfigError
from gspo.train.loop.teacher import tokenizer_difference
from gspo.train.loop.trainer import train
from gspo.train.run import checkpoint
from tests.cli.test_cli import one_line_exit_2
from tests.conftest import tiny
from tests.helpers.gguf_files import write_tiny_gguf

F64 = torch.float64


def test_reverse_kl_term_by_hand():
    """-J_t = -sg(log pi_T - log pi) w_t summed over the tokens, w_t = exp(log pi - log pi_old): at the old
    weights (w = 1) its gradient on log pi(y_t) is log pi(y_t) - log pi_T(y_t), the token's reverse-KL estimate;
    later (w != 1) it is weighted by w."""
    old = torch.tensor([[-1.0, -2.0, -0.5]], dtype=F64)
    teacher = torch.tensor([[-0.5, -2.5, 7.0]], dtype=F64)  # 7.0 sits on padding
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=F64)
    logp = old.clone().requires_grad_()
    total, n = reverse_kl_term(logp, old, teacher, mask)
    assert n.item() == 2 and total.item() == pytest.approx(-((-0.5 + 1.0) + (-2.5 + 2.0)), abs=1e-12)
    (g,) = torch.autograd.grad(total, logp)
    torch.testing.assert_close(g, torch.tensor([[-1.0 + 0.5, -2.0 + 2.5, 0.0]], dtype=F64), rtol=0, atol=1e-12)
    logp = (old + torch.tensor([[0.2, -0.1, 0.0]], dtype=F64)).requires_grad_()
    total, _ = reverse_kl_term(logp, old, teacher, mask)
    (g,) = torch.autograd.grad(total, logp)
    w = [math.exp(0.2), math.exp(-0.1)]
    want = [-(-0.5 - (-0.8)) * w[0], -(-2.5 - (-2.1)) * w[1], 0.0]
    torch.testing.assert_close(g, torch.tensor([want], dtype=F64), rtol=0, atol=1e-12)
    k3 = [math.exp(x) - 1 - x for x in (0.5, -0.5)]  # x = log pi_T - log pi_old
    assert distill_metrics(old, teacher, mask) == {"distill/reverse_kl": pytest.approx(sum(k3) / 2)}


def test_its_expected_gradient_is_the_gradient_of_the_reverse_kl():
    """One position, a softmax policy over 5 tokens: averaging the term's gradient over the tokens the policy draws
    (each weighted by its probability) is grad KL(pi || pi_T) exactly (the score function of sum_y pi log pi/pi_T;
    E_pi[grad log pi] = 0 takes the other part away)."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(5, generator=g, dtype=F64).requires_grad_()
    teacher = torch.log_softmax(torch.randn(5, generator=g, dtype=F64), 0)
    logpi = torch.log_softmax(z, 0)
    expected = torch.zeros(5, dtype=F64)
    for y in range(5):  # the token-level term on a one-token completion y, on-policy (old = pi)
        total, _ = reverse_kl_term(logpi[y].view(1, 1), logpi[y].detach().view(1, 1), teacher[y].view(1, 1),
                                   torch.ones(1, 1, dtype=F64))
        expected = expected + logpi[y].exp().detach() * torch.autograd.grad(total, z, retain_graph=True)[0]
    kl = (logpi.exp() * (logpi - teacher)).sum()
    torch.testing.assert_close(expected, torch.autograd.grad(kl, z)[0], rtol=0, atol=1e-12)


def test_a_tokenizer_that_is_not_the_students_is_named():
    from gspo.models.build import char_tokenizer

    a, b = char_tokenizer("0123456789+="), char_tokenizer("0123456789+=abc")
    assert tokenizer_difference(a, char_tokenizer("0123456789+=")) is None
    assert "15 and 18 tokens" in tokenizer_difference(a, b)


def _base_dir(cfg) -> Path:
    """The warm-started base the run of `cfg` starts from (the cache may hold other tests' bases beside it)."""
    from gspo.tasks import build_task
    from gspo.train.start.warm_start import base_model

    return base_model(cfg, build_task(cfg.task))


def _metrics(run):
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def test_a_teacher_that_is_the_student_gives_zero_kl(tmp_path, cache_dir):
    first = compose(tiny(cache_dir, **{"train.steps": 1}))
    train(first, tmp_path / "first")  # builds the base
    base = _base_dir(first)
    # the old log-probs recomputed by the trainer's forward, which the teacher's (the same weights) equals
    train(compose(tiny(cache_dir, **{"train.steps": 1, "teacher.path": str(base), "teacher.rl_coef": 0.0,
                                     "train.minibatches": 1, "rollout.old_logprobs": "recompute"})), tmp_path / "self")
    last = _metrics(tmp_path / "self")[-1]
    assert last["distill/reverse_kl"] == 0.0 and last["distill/loss"] == 0.0  # (train/loss: the MoE's aux loss)


def test_distillation_from_a_trained_checkpoint_runs_beside_and_instead_of_the_rl_term(tmp_path, cache_dir):
    train(compose(tiny(cache_dir, **{"train.steps": 3, "train.lr": 3e-3})), tmp_path / "teacher")
    teacher = checkpoint.latest(tmp_path / "teacher")
    for name, extra in (("beside", {}), ("alone", {"teacher.rl_coef": 0.0})):
        train(compose(tiny(cache_dir, **{"train.steps": 2, "teacher.path": str(teacher), **extra})), tmp_path / name)
        rows = _metrics(tmp_path / name)[1:]
        assert all(r["distill/reverse_kl"] > 0 and math.isfinite(r["distill/loss"]) for r in rows)
    # the student moves towards the teacher: its reverse KL falls over a few steps of distillation alone
    train(compose(tiny(cache_dir, **{"train.steps": 6, "train.lr": 3e-3, "teacher.path": str(teacher),
                                     "teacher.rl_coef": 0.0})), tmp_path / "longer")
    kl = [r["distill/reverse_kl"] for r in _metrics(tmp_path / "longer")[1:]]
    assert kl[-1] < kl[0]


def test_the_teacher_keys_are_checked(tmp_path, cache_dir):
    with pytest.raises(ConfigError, match="teacher.path="):
        compose(tiny(cache_dir, **{"teacher.path": str(tmp_path / "nowhere")}))
    with pytest.raises(ConfigError, match="teacher.coef"):
        compose(tiny(cache_dir, **{"teacher.coef": -1.0}))


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line(tmp_path, cache_dir):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from gspo.models.build import char_tokenizer

    tok = char_tokenizer("0123456789+=abc")
    config = Qwen3Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, intermediate_size=64, max_position_embeddings=256,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path / "other")
    tok.save_pretrained(tmp_path / "other")
    with pytest.raises(ConfigError, match=r"teacher.path=.*its tokenizer is not the student's"):
        train(compose(tiny(cache_dir, **{"teacher.path": str(tmp_path / "other")})), tmp_path / "run")


def test_a_gguf_teacher_loads_as_a_gguf_student_does(tmp_path, cache_dir, capsys):
    """`teacher.path=FILE.gguf` is dequantized into cache_dir as `model.path=FILE.gguf` is: the same file as student
    and teacher is one cached copy (the teacher's line says it reuses it) and the reverse KL is 0."""
    write_tiny_gguf(tmp_path / "tiny.gguf")
    path = str(tmp_path / "tiny.gguf")
    cfg = compose(tiny(cache_dir, model="hf", **{"model.path": path, "teacher.path": path, "teacher.rl_coef": 0.0,
                                                 "train.minibatches": 1, "rollout.old_logprobs": "recompute",
                                                 "task": "word_problems", "task.system_prompt": "null",
                                                 "task.max_steps": 1, "rollout.max_new_tokens": 8, "task.eval_size": 4,
                                                 "train.steps": 1, "hardware.threads": 1}))
    train(cfg, tmp_path / "run")
    out = capsys.readouterr().out
    assert f"gspo: teacher.path={path}: a GGUF file (F32)" in out and "reusing" in out
    assert _metrics(tmp_path / "run")[-1]["distill/reverse_kl"] == 0.0


def test_a_teacher_path_that_cannot_load_is_refused_naming_teacher_path(tmp_path, cache_dir):
    """Before any work, in one line naming `teacher.path` (never `model.path`): a package that is not installed,
    and a run directory, which is pointed at the checkpoint to give (its last), as `gspo eval RUN_DIR` scores:
    the config records the path, and a run directory's last checkpoint moves while that run trains on."""
    with pytest.raises(ConfigError, match=r"^teacher\.path=pkg:nosuchdist/x\.gguf: the Python package nosuchdist"):
        compose(tiny(cache_dir, **{"teacher.path": "pkg:nosuchdist/x.gguf"}))
    run = tmp_path / "teacher_run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("seed: 0\n")
    with pytest.raises(ConfigError, match=r"a gspo run directory with no checkpoint yet"):
        compose(tiny(cache_dir, **{"teacher.path": str(run)}))
    for step in ("step_000002", "step_000004"):
        (run / "checkpoints" / step).mkdir()
        (run / "checkpoints" / step / "trainer_state.pt").write_bytes(b"")
    last = run / "checkpoints" / "step_000004"
    with pytest.raises(ConfigError, match=rf"a gspo run directory: give one of its checkpoints, e\.g\. its last: "
                                          rf"teacher\.path={last}$"):
        compose(tiny(cache_dir, **{"teacher.path": str(run)}))
    one_line_exit_2(CliRunner().invoke(app, ["train", f"teacher.path={run}"]), f"teacher.path={last}")
