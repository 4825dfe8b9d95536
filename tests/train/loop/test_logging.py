"""MetricsLogger: metrics.jsonl flushed per step, resume truncation, samples, W&B offline."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from gspo.train.loop.logging import MetricsLogger, truncate_jsonl


def cfg(wandb: bool = False, samples_every: int = 2, **wandb_cfg) -> dict:
    return {
        "algo": {"name": "gspo"},
        "seed": 3,
        "logger": {
            "name": "wandb" if wandb else "jsonl",
            "wandb": wandb,
            "wandb_cfg": {"mode": "offline", "samples_every": samples_every, **wandb_cfg},
        },
    }


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_written_and_flushed_every_step(tmp_path):
    log = MetricsLogger(tmp_path, OmegaConf.create(cfg()))  # a DictConfig, as the trainer passes
    log.log({"eval/accuracy": 0.25, "kl/ref": None}, step=0)
    # Readable before close(): a crash loses nothing already logged.
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 0, "eval/accuracy": 0.25}]
    log.log({"reward/mean": np.float32(0.5), "clip/frac": torch.tensor(0.125), "n": 3,
             "train/loss": float("nan"), "kl/ref": float("inf"), "flag": True}, step=1)
    lines = read_jsonl(tmp_path / "metrics.jsonl")
    assert lines[1]["step"] == 1 and lines[1]["reward/mean"] == 0.5 and lines[1]["clip/frac"] == 0.125
    assert lines[1]["n"] == 3 and lines[1]["flag"] == 1
    assert math.isnan(lines[1]["train/loss"]) and lines[1]["kl/ref"] == math.inf
    assert "NaN" in (tmp_path / "metrics.jsonl").read_text()
    log.close()
    log.close()  # idempotent
    assert not (tmp_path / "wandb").exists()


def test_resume_truncates_steps_after_the_checkpoint(tmp_path):
    with MetricsLogger(tmp_path, cfg()) as log:
        for step in range(6):
            log.log({"reward/mean": step / 10}, step=step)
            log.log_samples(step, [{"prompt": "1+1=", "completion": "2", "reward": 1.0}])
    with (tmp_path / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 6, "reward/me')  # half-written line from a crash
    with MetricsLogger(tmp_path, cfg(), resume_step=3) as log:
        assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]
        assert [r["step"] for r in read_jsonl(tmp_path / "samples.jsonl")] == [0, 2]
        log.log({"reward/mean": 0.9}, step=4)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3, 4]
    assert truncate_jsonl(tmp_path / "missing.jsonl", 3) == 0


def test_heldout_outcomes_go_to_their_own_file_and_a_resume_drops_later_lines(tmp_path):
    """An evaluation's outcome record (the evaluator's, under HELDOUT) is a line of heldout.jsonl with its step,
    not part of metrics.jsonl; read back as {step: [bool]}; a resume drops the lines after its checkpoint's step,
    as it drops metrics.jsonl's."""
    from gspo.tasks import Problem
    from gspo.train.evaluation.heldout import HELDOUT, outcome_record, problems_digest, read_outcomes

    problems = [Problem("1+1=", "2"), Problem("2+2=", "4"), Problem("3+3=", "6")]
    with MetricsLogger(tmp_path, cfg()) as log:
        for step in range(5):
            evaluated = {HELDOUT: outcome_record(problems, [True, step > 1, step > 3])} if step % 2 == 0 else {}
            log.log({"reward/mean": step / 10, **evaluated}, step=step)
    assert read_jsonl(tmp_path / "heldout.jsonl") == [
        {"step": s, "n": 3, "problems": problems_digest(problems), "correct": c} for s, c in ((0, "100"), (2, "110"),
                                                                                            (4, "111"))]
    assert all(HELDOUT not in row for row in read_jsonl(tmp_path / "metrics.jsonl"))
    assert read_outcomes(tmp_path) == {0: [True, False, False], 2: [True, True, False], 4: [True, True, True]}
    with (tmp_path / "heldout.jsonl").open("a") as fh:
        fh.write('{"step": 6, "n": 3, "corr')  # half-written line from a crash: skipped by the reader
    assert list(read_outcomes(tmp_path)) == [0, 2, 4]
    with MetricsLogger(tmp_path, cfg(), resume_step=3) as log:
        assert list(read_outcomes(tmp_path)) == [0, 2]
        log.log({HELDOUT: outcome_record(problems, [False] * 3)}, step=4)
    assert read_outcomes(tmp_path) == {0: [True, False, False], 2: [True, True, False], 4: [False] * 3}
    assert problems_digest(problems) != problems_digest(problems[::-1]) and len(problems_digest(problems)) == 16
    with pytest.raises(ValueError, match="2 outcomes for 3 problems"):
        outcome_record(problems, [True, False])


def test_samples_follow_samples_every(tmp_path):
    with MetricsLogger(tmp_path, cfg(samples_every=2)) as log:
        assert not log.should_log_samples(1) and log.should_log_samples(2)
        log.log_samples(1, [{"prompt": "a", "completion": "b"}])
        assert not (tmp_path / "samples.jsonl").exists()
        log.log_samples(2, [{"prompt": "a", "completion": "b", "reward": torch.tensor(1.0)},
                            {"prompt": "c", "completion": "d", "reward": 0.1}])
        rows = read_jsonl(tmp_path / "samples.jsonl")
    assert rows == [{"step": 2, "prompt": "a", "completion": "b", "reward": 1.0},
                    {"step": 2, "prompt": "c", "completion": "d", "reward": 0.1}]
    with MetricsLogger(tmp_path / "never", cfg(samples_every=0)) as log:
        log.log_samples(0, [{"prompt": "a"}])
    assert not (tmp_path / "never" / "samples.jsonl").exists()


def test_a_chat_prompt_is_stored_as_json_messages(tmp_path):
    """Not a Python repr: a list of message objects, whatever container the task held it in."""
    from omegaconf import OmegaConf

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]
    with MetricsLogger(tmp_path, cfg(samples_every=1)) as log:
        log.log_samples(1, [{"prompt": messages, "completion": "2", "reward": 1.0},
                            {"prompt": OmegaConf.create(messages), "completion": "3", "reward": torch.tensor(0.0)}])
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()
    assert [json.loads(x)["prompt"] for x in lines] == [messages, messages]
    assert "'role'" not in lines[0]


def wandb_records(path: Path) -> list:
    """Decode a .wandb file (LevelDB-style log of protobuf Records) without network."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, chunks, buf = 7, [], b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            chunks.append(chunk)
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            chunks.append(buf + chunk)
    records = []
    for raw in chunks:
        record = pb.Record()
        record.ParseFromString(raw)
        records.append(record)
    return records


def wandb_records_when_written(path: Path, timeout: float = 20.0) -> list:
    """wandb-core may still be flushing the file when finish() returns: wait for the exit record."""
    deadline = time.monotonic() + timeout
    while True:
        records = wandb_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def history(records) -> list[dict[str, str]]:
    return [{(i.key or "/".join(i.nested_key)): i.value_json for i in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for key, value in {
        "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
        "WANDB_CONFIG_DIR": str(tmp_path / "wbconfig"), "WANDB_CACHE_DIR": str(tmp_path / "wbcache"),
        "WANDB_DATA_DIR": str(tmp_path / "wbdata"), "WANDB_X_DISABLE_STATS": "true",
        "WANDB_X_DISABLE_MACHINE_INFO": "true", "WANDB_API_KEY": "",
    }.items():
        monkeypatch.setenv(key, value)


def test_wandb_offline_run_lives_in_run_dir_and_resumes_same_id(tmp_path, offline_wandb, capsys):
    run_dir = tmp_path / "run"
    log = MetricsLogger(run_dir, cfg(wandb=True, tags=["t1"]), group="sweep-1")
    try:
        log.log({"eval/accuracy": 0.25}, step=0)
        log.log({"reward/mean": 0.5, "clip/frac": 0.01}, step=1)
        log.log_samples(2, [{"prompt": "1+1=", "completion": "2", "reward": 1.0}])
        log.log({"reward/mean": 0.75}, step=2)
    finally:
        log.close()
    assert "wandb sync" in capsys.readouterr().err
    run_id = (run_dir / "wandb_id.txt").read_text().strip()
    files = list((run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 1
    records = wandb_records_when_written(files[0])
    run_record = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run_record.run_id == run_id and run_record.run_group == "sweep-1"
    assert run_record.display_name == "gspo-seed3" and list(run_record.tags) == ["t1"]
    rows = history(records)
    assert any(row.get("reward/mean") == "0.5" and row.get("_step") == "1" for row in rows)
    assert any("samples/_type" in row or any(k.startswith("samples") for k in row) for row in rows)
    assert read_jsonl(run_dir / "metrics.jsonl")[-1] == {"step": 2, "reward/mean": 0.75}

    with MetricsLogger(run_dir, cfg(wandb=True), resume_step=1) as log:
        log.log({"reward/mean": 0.6}, step=2)
    assert (run_dir / "wandb_id.txt").read_text().strip() == run_id
    assert len(list((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))) >= 1
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [0, 1, 2]


def test_wandb_disabled_mode_makes_no_run(tmp_path, offline_wandb):
    with MetricsLogger(tmp_path, cfg(wandb=True, mode="disabled")) as log:
        log.log({"reward/mean": 0.5}, step=1)
        assert log.wandb_run is None
    assert not (tmp_path / "wandb").exists() and not (tmp_path / "wandb_id.txt").exists()


@pytest.mark.parametrize("silent", ["true", "false"])
def test_wandb_sync_command_is_printed_once(tmp_path, offline_wandb, monkeypatch, capfd, silent):
    """W&B prints its own `wandb sync` line unless silenced; gspo adds one only when it is."""
    import wandb

    monkeypatch.setenv("WANDB_SILENT", silent)
    wandb.teardown()  # W&B reads its settings from the environment once per process
    try:
        with MetricsLogger(tmp_path, cfg(wandb=True)) as log:
            log.log({"reward/mean": 0.5}, step=1)
    finally:
        wandb.teardown()
    out = capfd.readouterr()
    assert (out.out + out.err).count("wandb sync ") == 1, out.out + out.err
