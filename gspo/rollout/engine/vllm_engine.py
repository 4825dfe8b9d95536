"""vLLM as gspo's sampler (`rollout.engine=vllm`): the engine itself, in a process gspo started for it.

This module imports vllm, and runs only in a process that hosts the engine: a rollout worker
(`rollout.workers >= 1`) or the engine process the trainer starts (`python -m gspo.rollout.engine.vllm_engine FD`,
gspo/rollout/engine/client.py). Never in the trainer's: an in-process vLLM engine reseeds torch's global generator,
advances it at every `generate()` and makes `torch.set_num_threads` a no-op for its whole process. The
engine runs in-process there (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the process gspo watches is the one
that computes: it dies with the trainer, its threads are gspo's to set, and it starts in seconds.

What gspo asks of the engine, and how (vLLM 0.32; docs/scaling.md, "Sampling with vLLM"):
- samples: one request per prompt with n = G and the prompt group's keyed seed (vLLM seeds completion j of a
  request seeded s with s + j: one seed for every prompt would correlate the prompts' samples);
- behaviour log-probs in gspo's convention (log-probs of the temperature-scaled distribution, before any
  top-p cut): `logprobs_mode="processed_logprobs"` at top_p = 1; at top_p < 1 those are renormalised over the
  nucleus, so `raw_logprobs` is used where the temperature is 1 (they ignore the temperature); with both
  top_p < 1 and temperature != 1 the engine records none (`behaviour_logprobs`);
- weights after every update, without a restart: `reload_weights` (vLLM's in-place RL weight update) from the
  trainer's weights in checkpoint format, then the prefix cache reset (a cached prompt would otherwise be
  served from the old policy's keys and values). On the CPU build one more step (`_first_load_processing`).
  The weights come from the slot file in /dev/shm or, streamed, from the trainer over a process group
  (gspo/rollout/engine/transport.py), or as deltas over that group into a copy of the weights each worker keeps, loaded
  once checked (gspo/rollout/engine/delta.py). Every weight operation runs in each of vLLM's workers (`collective_rpc`,
  `_Loader`): in this process at `tensor_parallel_size=1`, in vLLM's worker processes above it, each loading
  every weight and keeping its shard. Or, for a LoRA run with `rollout.vllm.lora_push=adapter`, the adapter alone
  on the base loaded at the start: vLLM's LoRA support (`enable_lora`), a directory as peft saves it, under a new
  adapter id per push (vLLM keeps an adapter by its id: an id it has seen would serve the adapter it loaded then);
- routing: on a MoE, the top-k experts every router chose for every token the engine computed, and the
  router's logits, by hooks on the routers (`_Routing`): vLLM's own `enable_return_routed_experts` needs its
  Model Runner V2, which has no CPU backend.
"""

from __future__ import annotations

import logging
import os
import resource
import socket
import sys
import time
from typing import Optional

import torch

from gspo.core.errors import ConfigError, tidy_warnings
from gspo.rollout.engine.delta import Mirror
from gspo.rollout.engine.slots import map_slot
from gspo.rollout.engine.transport import HOST, Group, device_identity, receive, receive_entries
from gspo.rollout.processes.serve import serve

# log-prob modes: which vLLM mode gives gspo's convention at (top_p < 1, temperature == 1)
PROCESSED, RAW = "processed_logprobs", "raw_logprobs"


def behaviour_logprobs(top_p: float, temperature: float) -> Optional[str]:
    """The vLLM log-prob mode whose values are gspo's behaviour log-probs, or None where none is."""
    if top_p >= 1.0:
        return PROCESSED
    return RAW if temperature == 1.0 else None


def environment(threads: int, tensor_parallel_size: int = 1) -> dict[str, str]:
    """The environment of a process that will host the engine, set when it starts (vLLM, tqdm and torch read it
    when they are imported): the engine core in that process (see above), `threads` threads (vLLM then leaves
    torch's as they are; per worker above tensor_parallel_size=1), and only its errors on the console (its INFO
    lines and progress bars, its warnings about a CPU build without Triton or tcmalloc, would bury gspo's progress
    line; VLLM_LOGGING_LEVEL=INFO brings them back). Above tensor_parallel_size=1 the CPU build pins each worker's
    threads to a NUMA node of its own and refuses more workers than nodes: unless VLLM_CPU_OMP_THREADS_BIND says
    otherwise, they are left unpinned ("nobind")."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(threads),
           "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"), "TQDM_DISABLE": "1",
           "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR")}
    if tensor_parallel_size > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    return env


def configure(threads: int, tensor_parallel_size: int = 1) -> None:
    """This process's settings for an in-process engine with `threads` threads, before vllm is imported."""
    os.environ.update(environment(threads, tensor_parallel_size))
    tidy_warnings()  # the libraries' FutureWarnings about their own calls are nothing a user can act on
    if os.environ["VLLM_LOGGING_LEVEL"] == "ERROR":  # what vLLM logs while importing, before it reads that variable
        logging.getLogger("vllm").setLevel(logging.ERROR)
    torch.set_num_threads(threads)


class VllmEngine:
    """A vLLM engine in this process, serving the checkpoint in `base_dir` in `dtype`; with `max_lora_rank`, with
    the adapters it is sent on top (LoRA up to that rank, one adapter at a time)."""

    def __init__(self, base_dir: str, dtype: str, seed: int, threads: int, stop_ids: list[int], max_num_seqs: int,
                 logprobs_mode: Optional[str], max_logprobs: int = 0, kv_cache_bytes: Optional[int] = None,
                 gpu_memory_utilization: float = 0.3, enforce_eager: Optional[bool] = None, routing: bool = False,
                 max_model_len: Optional[int] = None, max_lora_rank: Optional[int] = None,
                 tensor_parallel_size: int = 1):
        configure(threads, tensor_parallel_size)
        from transformers import AutoConfig
        from vllm import LLM
        from vllm.platforms import current_platform

        self.cpu = current_platform.is_cpu()
        config = AutoConfig.from_pretrained(base_dir)
        # vLLM refuses a stop id outside the vocabulary (a model whose EOS it can never sample: it runs to its budget)
        self.stop_ids = [t for t in stop_ids if t < config.get_text_config().vocab_size]
        self.logprobs_mode = logprobs_mode
        memory = {"kv_cache_memory_bytes": kv_cache_bytes} if kv_cache_bytes else {}
        self.adapter, self.lora = max_lora_rank is not None, None  # adapter pushes; the adapter it serves
        lora = dict(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1) if self.adapter else {}
        self.llm = LLM(model=base_dir, dtype=dtype, seed=seed, skip_tokenizer_init=True, enable_prefix_caching=True,
                       max_num_seqs=max_num_seqs, logprobs_mode=logprobs_mode or PROCESSED,
                       max_logprobs=max(max_logprobs, 1), gpu_memory_utilization=gpu_memory_utilization,
                       enforce_eager=self.cpu if enforce_eager is None else enforce_eager, disable_log_stats=True,
                       max_model_len=max_model_len, use_tqdm_on_load=False,
                       tensor_parallel_size=tensor_parallel_size, **memory, **lora)
        self.llm.collective_rpc(_prepare, args=(base_dir,))
        # (the routing's hooks need the model in this process: tensor_parallel_size=1, gspo/rollout/engine/client.py)
        self.routing = _Routing(self.llm.collective_rpc(_itself)[0].model_runner) if routing else None

    # -- weights ------------------------------------------------------------------
    def load_slot(self, path: str, layout: list, dtype: torch.dtype) -> float:
        """Serve what the trainer wrote at `path` from now on: the adapter directory (adapter pushes), or the slot
        file of every weight (gspo/rollout/engine/slots.py); the prefix cache is reset. The engine's peak RSS (MiB: this
        process and its workers)."""
        if self.adapter:
            return self._load_adapter(path)
        return self._load(("file", path, layout, str(dtype).removeprefix("torch.")))

    def devices(self) -> list[str]:
        """Each worker's device (`transport.device_identity`), in worker order."""
        return self.llm.collective_rpc(_device)

    def join(self, backend: str, port: int, secret: bytes, world: int, timeout_s: float, host: str) -> None:
        """Every worker joins the trainer's weight group (rank 1 + its own), whose store is at host:port and admits
        those holding `secret`: returns once the group is complete."""
        self.llm.collective_rpc(_join, args=(backend, port, secret, world, timeout_s, host))

    def load_pushed(self) -> float:
        """Serve the weights the trainer is pushing over the group (`join`), as `load_slot`."""
        return self._load(("group",))

    def load_delta(self, names: list[str]) -> tuple[float, str]:
        """Read the push the trainer is sending over the group (a delta, or a full push: gspo/rollout/engine/delta.py)
        into each worker's copy of the weights, and serve them, as `load_slot`, where every worker holds the version the
        push names, checked; else load nothing. (The engine's peak RSS in MiB, "ok" or why not: "stale: ...",
        "corrupt: ...": the trainer then sends a full push.) `names`: the weights a full push must cover."""
        got = self.llm.collective_rpc(_load_delta, args=(self.cpu, names))
        peaks = {pid: peak for pid, peak, _ in got}
        status = next((s for _, _, s in got if s != "ok"), "ok")
        if status != "ok":
            return sum(peaks.values()) + _peak_rss_mib() * (os.getpid() not in peaks), status
        return self._after_load(peaks), status

    def _load(self, source: tuple) -> float:
        peaks = dict(self.llm.collective_rpc(_load, args=(source, self.cpu)))
        return self._after_load(peaks)

    def _load_adapter(self, directory: str) -> float:
        """The base with the adapter in `directory` (as peft saves it), under a new adapter id (vLLM would serve
        the adapter it holds under an id it has seen), loaded now (it replaces the one before: the engine holds
        one). The prefix cache's blocks are keyed by the adapter's name: the reset frees them, it serves no other."""
        from vllm.lora.request import LoRARequest

        n = self.lora.lora_int_id + 1 if self.lora is not None else 1
        self.lora = LoRARequest(f"gspo-policy-{n}", n, directory)
        self.llm.llm_engine.add_lora(self.lora)
        return self._after_load(dict(self.llm.collective_rpc(_peak)))

    def _after_load(self, peaks: dict[int, float]) -> float:
        """After a weight update: the prefix cache reset; the engine's peak RSS (MiB), the sum of its workers'
        `peaks` (by pid) and this process's (counted once where a worker runs in it)."""
        peaks[os.getpid()] = _peak_rss_mib()
        if not self.llm.reset_prefix_cache():  # vLLM leaves the cache as it is while any of its blocks is in use
            raise RuntimeError("the engine could not reset its prefix cache after a weight update (vLLM: KV blocks "
                               "still in use): cached prompts would be served from the old policy's keys and values")
        return sum(peaks.values())

    # -- sampling -----------------------------------------------------------------
    def sample_ids(self, prompts: list[list[int]], n: int, max_new_tokens: int | list[int], temperature: float = 1.0,
                   top_p: float = 1.0, greedy: bool = False, seeds: Optional[list[int]] = None, keep_topk: int = 0,
                   routing: bool = False) -> dict:
        """n completions of each prompt (token ids), rows prompt-major, at most `max_new_tokens` tokens each (or
        per prompt): each row's completion tokens (the stop token included when it stopped), their log-probs, the
        top-k (ids, log-probs) per token when asked, and with `routing` the experts chosen at every position of
        the row's prompt + completion that the engine computed."""
        from vllm import SamplingParams

        budget = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
        params = [SamplingParams(n=n, max_tokens=budget[i], temperature=0.0 if greedy else temperature,
                                 top_p=1.0 if greedy else top_p, seed=None if greedy or seeds is None else seeds[i],
                                 stop_token_ids=self.stop_ids, detokenize=False, skip_special_tokens=False,
                                 logprobs=None if greedy or not self.logprobs_mode else max(keep_topk, 0))
                  for i in range(len(prompts))]
        if routing:
            self.routing.begin()
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                                    lora_request=self.lora)
        rows, logps, tops, parents = [], [], [], {}
        for i, out in enumerate(outputs):
            parents[out.request_id] = i
            for c in sorted(out.outputs, key=lambda c: c.index):
                rows.append(list(c.token_ids))
                lp = [_chosen(d, t) for d, t in zip(c.logprobs or [], c.token_ids)]
                logps.append(lp if c.logprobs else None)
                tops.append(_topk(c.logprobs, c.token_ids, keep_topk) if keep_topk and c.logprobs else None)
        result = {"tokens": rows, "logprobs": logps, "topk": tops}
        if routing:
            result["routing"] = self.routing.collect(parents, n, prompts, rows)
        return result


def _itself(worker):
    return worker


# --------------------------------------------------------------------------- in each of vLLM's workers


class _Loader:
    """What a worker of the engine keeps to load weights: a model on the meta device (the names transformers saves
    a checkpoint under, which the engine loads), the slot files it has mapped, its member of the weight group."""

    def __init__(self, base_dir: str):
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            self.meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base_dir))
        self.slots: dict[str, dict] = {}
        self.group = None
        self.mirror: Optional[Mirror] = None  # delta pushes: the weights it serves, in checkpoint form (host memory)

    def parts(self, source: tuple):
        """The weights, in parts of (trainer name, tensor): the slot file's, or each bucket the trainer pushes."""
        if source[0] == "file":
            _, path, layout, dtype = source
            if path not in self.slots:
                self.slots[path] = map_slot(path, layout, getattr(torch, dtype))
            return [list(self.slots[path].items())]
        return receive(self.group)


def _prepare(worker, base_dir: str) -> None:
    worker.gspo_loader = _Loader(base_dir)


def _device(worker) -> str:
    return device_identity(worker.device)


def _join(worker, backend: str, port: int, secret: bytes, world: int, timeout_s: float, host: str) -> None:
    worker.gspo_loader.group = Group(backend, 1 + worker.rank, world, timeout_s, worker.device, port=port,
                                     secret=secret, host=host)


@torch.no_grad()
def _load(worker, source: tuple, cpu: bool) -> tuple[int, float]:
    """The weights from `source` (`_Loader.parts`) into this worker's model, streamed: each part in checkpoint
    format as it arrives. (this process's pid, its peak RSS in MiB)."""
    loader = worker.gspo_loader
    if cpu:
        _first_load_processing(worker.model_runner.model)
    state = (item for part in loader.parts(source) for item in checkpoint_format(loader.meta, dict(part)).items())
    worker.reload_weights(weights_iterator=state, is_checkpoint_format=True)
    return _peak(worker)


@torch.no_grad()
def _load_delta(worker, cpu: bool, names: list[str]) -> tuple[int, float, str]:
    """One push of `rollout.vllm.weight_transport=delta` into this worker's mirror (gspo/rollout/engine/delta.py
    `Mirror`): read to its end; where the result is the version it names, checked, loaded into the model from the mirror
    (every weight, in checkpoint format, each a copy: vLLM keeps nothing of the mirror). (pid, peak RSS MiB, status)."""
    loader = worker.gspo_loader
    if loader.mirror is None:
        loader.mirror = Mirror(names)
    status = loader.mirror.receive(receive_entries(loader.group))
    if status == "ok":
        if cpu:
            _first_load_processing(worker.model_runner.model)
        state = checkpoint_format(loader.meta, loader.mirror.tensors)
        worker.reload_weights(weights_iterator=((k, v.clone()) for k, v in state.items()), is_checkpoint_format=True)
    return (*_peak(worker), status)


def _peak(worker) -> tuple[int, float]:
    """(this worker's process id, its peak RSS in MiB)."""
    return os.getpid(), _peak_rss_mib()


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _chosen(logprobs: dict, token: int) -> float:
    return float(logprobs[token].logprob)


def _topk(per_token: list[dict], tokens: list[int], k: int) -> tuple[list[list[int]], list[list[float]]]:
    """gspo's top-k (rollout.keep_topk): each position's k most likely tokens, the sampled one replacing the k-th
    when it is not among them (vLLM returns the k most likely, by rank, and the sampled token)."""
    ids, lps = [], []
    for d, t in zip(per_token, tokens):
        top = [tok for tok, _ in sorted(d.items(), key=lambda kv: kv[1].rank)][:k]
        if t not in top:
            top[-1] = t
        ids.append(top)
        lps.append([float(d[tok].logprob) for tok in top])
    return ids, lps


# --------------------------------------------------------------------------- weights


def checkpoint_format(meta: torch.nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The trainer's weights (its parameter names) under the names and layout transformers saves a checkpoint
    in, which is what vLLM loads: tied weights listed under every name (a tied LM head), and transformers 5's
    in-memory conversions undone (fused MoE experts back to one tensor per expert)."""
    from transformers.core_model_loading import revert_weight_conversion

    names = {id(p): n for n, p in meta.named_parameters()}
    state = {}
    for name, tensor in meta.state_dict(keep_vars=True).items():
        source = names.get(id(tensor), name)
        if source in weights:
            state[name] = weights[source]
    return revert_weight_conversion(meta, state)


def _first_load_processing(model: torch.nn.Module) -> None:
    """vLLM 0.32's CPU build: make the fused MoE layers process reloaded weights as on their first load.

    On a weight update vLLM skips the experts' `process_weights_after_loading` (it keeps the GPU's CUDA-graph
    addresses); on the CPU that step is the experts' prepack (and the expert width's padding to a multiple of
    32), so reloaded experts would be read unpacked (~10 nats off). With the layer's kernel cleared, the reload
    prepacks them into the existing storage, as the first load did. Measured: the reloaded engine's float32
    log-probs equal the trainer's to ~5e-7 (tests/rollout/engine/test_vllm.py)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if getattr(method, "moe_kernel", None) is not None:
            method.moe_kernel = None


# --------------------------------------------------------------------------- routing


class _Routing:
    """The experts each MoE router of the engine chose (and its logits) for every token the engine computed.

    Hooks: a pre-hook on the model reads which request and position each row of the forward is (the model runner's
    `req_indices` and the forward's `positions`), each router's capture function gets its top-k ids, a hook on each
    MoE layer's gate (the layer's, or its block's: Mixtral) its logits. Prompt positions served from the prefix
    cache are not computed and so not recorded (-1); R3 needs the positions from the prompt's last token on, which
    the engine always computes (it needs their logits). The CPU router returns its top-k unsorted: they are sorted
    by logit, as transformers' routers return them."""

    def __init__(self, runner):
        from vllm.model_executor.layers.fused_moe.layer import MoERunner

        self.runner, self.enabled = runner, False
        layers = [m for m in runner.model.modules() if isinstance(m, MoERunner)]
        # the router: the MoE layer's own `gate` (Qwen3-MoE hands it in), else its block's (Mixtral's block computes
        # the logits and passes them to the layer)
        parent = {id(child): module for module in runner.model.modules() for child in module.children()}
        gates = [m.gate if getattr(m, "gate", None) is not None else getattr(parent.get(id(m)), "gate", None)
                 for m in layers]
        if not layers or any(g is None for g in gates):
            raise ConfigError("this model's MoE layers take router logits from no `gate` module the vLLM engine can "
                              "find: it cannot record its routing (use moe.routing_replay=none or R2 with "
                              "rollout.old_logprobs=recompute)")
        self.index = {m.layer_id: i for i, m in enumerate(sorted(layers, key=lambda m: m.layer_id))}
        self.top_k = layers[0].router.top_k
        self.num_experts = layers[0].router.global_num_experts
        runner.model.register_forward_pre_hook(self._forward, with_kwargs=True)
        for m, gate in zip(layers, gates):
            layer = self.index[m.layer_id]
            m.router.set_capture_fn(lambda ids, layer=layer: self._record("topk", layer, ids))
            gate.register_forward_hook(lambda mod, args, out, layer=layer: self._record(
                "logits", layer, out[0] if isinstance(out, tuple) else out))
        self.calls: list[dict] = []

    def begin(self) -> None:
        self.calls, self.enabled = [], True

    def _forward(self, module, args, kwargs) -> None:
        if not self.enabled:
            return
        r = self.runner
        n = int(r.query_start_loc.np[r.input_batch.num_reqs])  # the scheduled tokens (a graph may pad the batch)
        positions = kwargs["positions"] if "positions" in kwargs else args[1]
        ids = r.input_batch.req_ids
        self.calls.append({"req": [ids[i] for i in r.req_indices.np[:n]], "pos": positions[:n].cpu().clone(),
                           "topk": {}, "logits": {}})

    def _record(self, kind: str, layer: int, value: torch.Tensor) -> None:
        if self.enabled and self.calls:
            n = len(self.calls[-1]["req"])
            self.calls[-1][kind][layer] = value[:n].detach().float().cpu() if kind == "logits" else \
                value[:n].detach().long().cpu()

    def collect(self, parents: dict[str, int], n: int, prompts: list[list[int]], rows: list[list[int]]) -> dict:
        """(N, W, L, k) expert ids (-1: not computed) and (N, W, L, E) router log-probs (0: not computed), W the
        longest prompt + completion, each row's positions from its own first token (the caller aligns them)."""
        self.enabled = False
        L, k, E, N = len(self.index), self.top_k, self.num_experts, len(rows)
        W = max(len(prompts[i // n]) + len(rows[i]) for i in range(N))
        idx = torch.full((N, W, L, k), -1, dtype=torch.long)
        lp = torch.zeros((N, W, L, E), dtype=torch.float32)
        for call in self.calls:
            row = torch.tensor([_row(rid, parents, n) for rid in call["req"]])
            pos, keep = call["pos"].long(), row >= 0
            for layer in range(L):
                if layer not in call["topk"]:
                    continue
                logits = call["logits"][layer]
                top = call["topk"][layer]
                order = logits.gather(-1, top).argsort(-1, descending=True)  # by logit, as transformers' routers
                idx[row[keep], pos[keep], layer] = top.gather(-1, order)[keep]
                lp[row[keep], pos[keep], layer] = torch.log_softmax(logits, -1)[keep]
        self.calls = []
        return {"indices": idx, "logprobs": lp}


def _row(request_id: str, parents: dict[str, int], n: int) -> int:
    """The row of an engine request: vLLM names the j-th of a request's n samples "j_<request>-<suffix>" (a lone
    sample "<request>-<suffix>"). -1: not one of this call's requests."""
    head = request_id.rsplit("-", 1)[0]
    if head in parents:
        return parents[head] * n
    j, _, parent = head.partition("_")
    if parent in parents and j.isdigit():
        return parents[parent] * n + int(j)
    return -1


# --------------------------------------------------------------------------- the engine process


def start(spec: dict, trainer_host: str = HOST):
    """The engine process's start: the engine, and the handler of the trainer's messages
    (gspo/rollout/processes/serve.py): ("load", step, path) the slot's weights (a file, or an adapter directory),
    ("push", step) the weights the trainer is pushing over the group, ("delta", step) a delta push over it (answered
    ("loaded", s, rss, status): a status other than "ok" loaded nothing), which ("devices",) and ("join", None, backend,
    port, secret, world, timeout_s) set up (the group's store on `trainer_host`, admitting those holding `secret`);
    ("sample", step, kwargs)."""
    engine = VllmEngine(**spec["engine"])
    dtype = getattr(torch, spec["dtype"])

    def handle(message: tuple) -> tuple:
        kind = message[0]
        if kind == "delta":
            t0 = time.time()
            rss, status = engine.load_delta([name for name, _ in spec["layout"]])
            return ("loaded", time.time() - t0, rss, status)
        if kind in ("load", "push"):
            t0 = time.time()
            rss = engine.load_slot(message[2], spec["layout"], dtype) if kind == "load" else engine.load_pushed()
            return ("loaded", time.time() - t0, rss)
        if kind == "devices":
            return ("devices", engine.devices())
        if kind == "join":
            engine.join(*message[2:], trainer_host)
            return ("joined",)
        _, step, kwargs = message
        return ("samples", engine.sample_ids(**kwargs))

    return handle


def trainer_host(fd: int) -> str:
    """The trainer's address as this process sees it on socket `fd`: its IP over TCP (an engine `gspo vllm-serve`
    started), this host's loopback over the socket pair of an engine the trainer started itself."""
    sock = socket.socket(fileno=os.dup(fd))
    try:
        return sock.getpeername()[0] if sock.family in (socket.AF_INET, socket.AF_INET6) else HOST
    finally:
        sock.close()


def main(fd: int) -> int:
    host = trainer_host(fd)
    return serve(fd, lambda spec: start(spec, host), syncs=("load", "push", "delta"))


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
