"""Warm-start the default base into an empty cache and print its held-out greedy accuracy
(docs/results/calibrations.md, the warm start's spread).

    python scripts/base_acc.py THREADS [KEY=VALUE ...]     # e.g. python scripts/base_acc.py 1 model.warm_start.seed=3

Prints one JSON line: the warm start's steps and training accuracy at its last check, and the base's
held-out accuracy (the same number `gspo eval cache_dir=EMPTY_DIR` reports, without pass@k).
"""

import json
import sys
import tempfile

import torch

from gspo.config.loading import compose
from gspo.models.build import load_pretrained
from gspo.tasks import build_task
from gspo.rollout.decoding.params import SamplingParams
from gspo.train.evaluation.heldout import evaluate, heldout_problems
from gspo.train.start.warm_start import base_model


def main(threads: int, overrides: list[str]) -> dict:
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as cache:
        cfg = compose([*overrides, f"hardware.threads={threads}", f"cache_dir={cache}"])
        task = build_task(cfg.task)
        path = base_model(cfg, task, log=lambda *a: None)
        model, tokenizer = load_pretrained(path)
        acc = evaluate(model, tokenizer, task, heldout_problems(task, cfg.task),
                       SamplingParams(cfg.rollout.max_new_tokens))["eval/accuracy"]
        record = json.loads((path / "warm_start.json").read_text())
    return {"threads": threads, "overrides": overrides, "steps": record["steps"],
            "train_accuracy": record["train_accuracy"], "heldout_accuracy": acc}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), sys.argv[2:])))
