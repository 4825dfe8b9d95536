"""The checkpointer decides its own timing: when the loop's `maybe_save` acts; the run's record says where a run
starts. (The evaluator's `maybe_run`: tests/train/evaluation/test_evaluator.py.)"""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from gspo.config.loading import compose
from gspo.train.loop.checkpointer import Checkpointer, RunRecord, next_step
from gspo.train.ranks.distributed import Dist
from gspo.train.run import checkpoint


def test_checkpoints_every_checkpoint_every_steps_and_the_last(tmp_path, monkeypatch):
    cfg = compose(["train.steps=7", "train.checkpoint_every=3"])
    run = RunRecord(cfg, tmp_path, Dist(), torch.float32)
    assert (run.start, run.resume_from, run.finished) == (0, None, False)
    policy = torch.nn.Linear(1, 1)
    opt = torch.optim.AdamW(policy.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ckpt = Checkpointer(run, run.restore(policy, None, opt, sched), source=None)  # (`save` replaced: none is read)
    saved = []
    monkeypatch.setattr(ckpt, "save", lambda step: saved.append(step) or setattr(ckpt, "saved", step))
    for step in range(1, 8):
        ckpt.maybe_save(step, {"eval/accuracy": 0.5})
    assert saved == [3, 6, 7]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 7 and summary["final_accuracy"] == 0.5
    ckpt.save_stopped(7)  # already saved: nothing written again
    ckpt.save_stopped(8)
    assert saved == [3, 6, 7, 8]


def test_a_new_run_summary_says_running_with_the_base_accuracy_and_a_resumed_one_drops_its_final(tmp_path):
    run = RunRecord(compose([]), tmp_path, Dist(), torch.float32)
    run.running({"eval/accuracy": 0.25})
    assert json.loads((tmp_path / "summary.json").read_text())["base_accuracy"] == 0.25
    run.summary.write(status="finished", final_accuracy=0.5)
    run.running(None)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "running" and "final_accuracy" not in summary and summary["base_accuracy"] == 0.25


def test_the_resume_point_is_the_newest_readable_checkpoint(tmp_path):
    assert next_step(tmp_path) == 1
    for step in (2, 4):
        d = tmp_path / "checkpoints" / f"step_{step:06d}"
        d.mkdir(parents=True)
        torch.save({"step": step}, d / "trainer_state.pt")
        save_file({"w": torch.zeros(1)}, str(d / "model.safetensors"))
    (tmp_path / "checkpoints" / "step_000004" / "model.safetensors").write_bytes(b"cut short")
    assert next_step(tmp_path) == 3 and checkpoint.latest(tmp_path).name == "step_000004"
    (tmp_path / "config.yaml").write_text("{}")  # (what compose asks of a resumed run's directory)
    run = RunRecord(compose(["train.steps=2", f"resume={tmp_path}"]), tmp_path, Dist(), torch.float32)
    assert run.start == 2 and run.resume_from.name == "step_000002" and run.finished
