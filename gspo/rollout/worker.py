"""A rollout worker: `python -m gspo.rollout.worker FD`, started by gspo/rollout/workers.py, never by hand.

It receives its spec over the socket FD (the run's config, the base checkpoint, its threads, its rank's
share of the prompts), builds the task, the reward functions and its own sampler, says "ready", then
samples and scores one step's batch per job with the weights of the slot the job names, until told to
stop. The sampler is the base checkpoint's model, whose parameters become views of the slot (no copy), or
with `rollout.engine=vllm` an inference engine in this process that loads the slot's weights (or, with
`rollout.vllm.lora_push=adapter`, its adapter) when the job's policy version is not the one it holds. The
process plumbing (signals, errors as one line, dying with the trainer) is gspo/rollout/processes/serve.py's.
"""

from __future__ import annotations

import sys


def start(spec: dict):
    """Build the worker from its spec; the handler that answers each job with its scored batch."""
    import contextlib
    import resource
    import time

    import torch
    from omegaconf import OmegaConf

    from gspo.core.errors import tidy_warnings
    from gspo.rollout.batch import Share, collect
    from gspo.rollout.decoding.params import SamplingParams
    from gspo.rollout.engine.slots import map_slot
    from gspo.tasks import build_task

    tidy_warnings()
    torch.set_num_threads(spec["threads"])
    cfg = OmegaConf.create(spec["config"])
    dtype = getattr(torch, spec["dtype"])
    device = torch.device(spec["device"])
    if device.type == "cuda" and device.index is not None:  # its rank's GPU is current: a bare "cuda" (a reward
        torch.cuda.set_device(device)  # model on reward.device=cuda|auto) is that GPU, as in the rank itself
    task = build_task(cfg.task)
    share = Share(spec["lo"], spec["hi"], spec["world"], device)
    if cfg.rollout.engine == "vllm":  # the engine in this process: it loads a slot's weights when they are new
        from gspo.models.build import load_tokenizer
        from gspo.rollout.engine.client import Engine
        from gspo.rollout.engine.vllm_engine import VllmEngine

        engine = VllmEngine(**spec["engine"])
        sampler, tokenizer = Engine(engine, spec["engine"]["stop_ids"]), load_tokenizer(spec["base_dir"])
        held = [None]  # the (slot, policy version) the engine holds

        def use(path: str, version: int) -> None:
            if held[0] != (path, version):
                engine.load_slot(path, spec["layout"], dtype)
                held[0] = (path, version)
    else:
        from gspo.models.build import load_pretrained

        model, tokenizer = load_pretrained(spec["base_dir"], dtype, cfg.model.attn_implementation, device=device)
        sampler = model.to(device).eval()
        # left requiring grad, as the trainer's own model: under no_grad that changes nothing but the kernel some
        # matmuls take (frozen weights gave other last bits on the CPU), and in-process sampling uses those
        params = dict(model.named_parameters())
        slots: dict[str, dict] = {}

        def use(path: str, version: int) -> None:
            if path not in slots:
                slots[path] = map_slot(path, spec["layout"], dtype)
            for name, view in slots[path].items():  # the slot's weights, in place of ours: no copy
                params[name].data = view

    idle_from = [time.time()]

    def handle(message: tuple) -> tuple:
        _, step, version, path = message
        t0 = time.time()
        use(path, version)
        with torch.no_grad():
            batch, metrics = collect(cfg, step, lambda: contextlib.nullcontext(sampler), tokenizer, task, share,
                                     SamplingParams.of(cfg, **spec["sample_kwargs"]))
        timing = {"time/rollout_s": time.time() - t0, "time/worker_idle_s": t0 - idle_from[0],
                  "memory/worker_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        idle_from[0] = time.time()  # from here: a large batch's send waits until the trainer reads it
        return ("batch", step, version, batch.state(), metrics, timing)

    return handle


if __name__ == "__main__":
    from gspo.rollout.processes.serve import serve

    sys.exit(serve(int(sys.argv[1]), start))
