"""A rollout worker: `python -m gspo.rollout.worker FD`, started by gspo/rollout/workers.py, never by hand.

It receives its spec over the socket FD (the run's config, the base checkpoint, its threads, its rank's
share of the prompts), builds the task, the reward functions and its own sampling model, says "ready",
then samples and scores one step's batch per job, with the weights of the slot the job names (its
parameters become views of that slot: no copy), until told to stop. Its own exception goes back as one
line; it ignores SIGINT / SIGTERM (the trainer stops it) and dies with the trainer (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import pickle
import resource
import signal
import sys
import time
from multiprocessing.connection import Connection

from gspo.config.processes import die_with_parent


def main(fd: int) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C or SIGTERM reaches the trainer, which stops us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent()
    conn = Connection(fd)
    send = lambda message: conn.send_bytes(pickle.dumps(message))  # noqa: E731
    step = None
    try:
        import torch
        from omegaconf import OmegaConf

        from gspo.config.errors import tidy_warnings
        from gspo.models.build import load_pretrained
        from gspo.rollout.batch import Share, collect
        from gspo.rollout.workers import map_slot
        from gspo.tasks import build_task

        tidy_warnings()
        _, spec = pickle.loads(conn.recv_bytes())
        torch.set_num_threads(spec["threads"])
        cfg = OmegaConf.create(spec["config"])
        dtype = getattr(torch, spec["dtype"])
        device = torch.device(spec["device"])
        task = build_task(cfg.task)
        model, tokenizer = load_pretrained(spec["base_dir"], dtype, cfg.model.attn_implementation, device=device)
        model.to(device).eval()
        # left requiring grad, as the trainer's own model: under no_grad that changes nothing but the kernel some
        # matmuls take (frozen weights gave other last bits on the CPU), and in-process sampling uses those
        params = dict(model.named_parameters())
        share = Share(spec["lo"], spec["hi"], spec["world"], device)
        slots: dict[str, dict] = {}
        send(("ready",))
        idle_from = time.time()
        while True:
            message = pickle.loads(conn.recv_bytes())
            if message[0] == "stop":
                return 0
            _, step, version, path = message
            t0 = time.time()
            if path not in slots:
                slots[path] = map_slot(path, spec["layout"], dtype)
            for name, view in slots[path].items():  # the slot's weights, in place of ours: no copy
                params[name].data = view
            with torch.no_grad():
                batch, metrics = collect(cfg, step, lambda: contextlib.nullcontext(model), tokenizer, task, share,
                                         spec["sample_kwargs"])
            timing = {"time/rollout_s": time.time() - t0, "time/worker_idle_s": t0 - idle_from,
                      "memory/worker_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
            idle_from = time.time()  # from here: a large batch's send waits until the trainer reads it
            send(("batch", step, version, batch.state(), metrics, timing))
            step = None
    except (EOFError, OSError, KeyboardInterrupt):  # the trainer is gone: so are we
        return 1
    except Exception as e:
        try:
            from gspo.config.errors import ConfigError

            users = isinstance(e, ConfigError)
            send(("error", step, type(e).__name__, " ".join(str(e).split()), users))
        except Exception:
            pass
        return 1


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
