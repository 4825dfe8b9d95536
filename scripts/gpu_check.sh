#!/usr/bin/env bash
# The GPU checks of docs/benchmarks.md ("On one GPU"), for a CUDA machine whose python3 already holds a CUDA torch,
# transformers, peft and accelerate (the device machine's image); gspo's other dependencies come as wheels in
# WHEELS (default .whl; none needed where they are installed). Each part writes its log (and small files) to OUT.
#
#   scripts/gpu_check.sh setup suite            # install gspo (no deps), then the README's test command on 16 workers
#   scripts/gpu_check.sh setup job real bench   # the default job, the real model in bf16 and float32, bench_gpu.py
#   scripts/gpu_check.sh decode                 # eager vs CUDA-graph decode ms/step (needs only torch, transformers)
#   scripts/gpu_check.sh --tiny setup suite gputest job real bench decode   # the dry run, on a CPU, in minutes
#
# --tiny (anywhere among the parts): a dry run that checks this script still fits the code, on a CPU: nothing
# installed, the suite collected (not run), tiny models, 1 RL step, the benchmarks' --tiny sizes; what needs CUDA
# (the real model, the graphs) is skipped with a line. Its files go to OUT=outputs/gpu-tiny, WORK=/tmp/gpu-tiny.
#
# Parts:
#   setup  pip-install WHEELS (--no-deps, into /tmp/site) and gspo itself (editable, no deps); GPU and versions
#   suite  the default suite (`pytest`, the README's test command) with CUDA torch, on SUITE_WORKERS xdist workers
#   gputest  tests/e2e/test_gpu.py: short `gspo train hardware=gpu` runs (skipped without CUDA)
#   job    `gspo train hardware=gpu`: the README's default job on the GPU (time, peak memory, accuracy)
#   real   `gspo train +experiment=smollm2_math hardware=gpu` in bf16 and in float32 (REAL_STEPS steps each,
#          the sampler/trainer mismatch logged every step); needs the GGUF at GGUF
#   bench  scripts/bench_gpu.py BENCH_ARGS: gspo's sampler against generate(), its step against TRL's, the mismatch
#   decode scripts/bench_gpu.py --parts decode DECODE_ARGS: the fast engine's decode ms per step, rollout.decode eager
#          against static against graph (a static KV cache, each step a CUDA graph replayed), on the dense and moe
#          models, graph checked bit for bit against static (and on tiny Llama, Qwen2, Mistral); decode.json, decode.log
set -uo pipefail
cd "$(dirname "$0")/.."
TINY=0
parts=()
for arg in "$@"; do
  if [ "$arg" = --tiny ]; then TINY=1; else parts+=("$arg"); fi
done
if [ "$TINY" = 1 ]; then OUT=${OUT:-outputs/gpu-tiny}; WORK=${WORK:-/tmp/gpu-tiny}; fi
OUT=${OUT:-outputs/gpu}
WORK=${WORK:-/tmp/gpu}
WHEELS=${WHEELS:-.whl}
GGUF=${GGUF:-/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf}
REAL_STEPS=${REAL_STEPS:-10}
SUITE_S=${SUITE_S:-200}
JOB_S=${JOB_S:-150}
BENCH_S=${BENCH_S:-240}
GPUTEST_S=${GPUTEST_S:-120}
DECODE_S=${DECODE_S:-360}
SUITE_WORKERS=${SUITE_WORKERS:-16}
BENCH_ARGS=${BENCH_ARGS:---models dense --steps 3 --repeats 2 --fast}
DECODE_ARGS=${DECODE_ARGS:---models dense,moe --repeats 2}
TINY_ARGS=$( [ "$TINY" = 1 ] && echo "--tiny --steps 2 --repeats 1" )  # appended: the last of a flag wins
mkdir -p "$OUT" "$WORK"
# the checkout on the path too: the decode part runs where gspo is not installed (no `setup`)
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} WANDB_MODE=offline HF_HUB_OFFLINE=1

TIME=$( [ -x /usr/bin/time ] && echo "/usr/bin/time -v" )  # peak RSS where GNU time is installed
stamp() { echo "== $(date -u +%H:%M:%S) $*"; }
keep() {  # a run directory's small files (no checkpoints) into OUT/NAME.tar.gz
  tar -czf "$OUT/$1.tar.gz" -C "$(dirname "$2")" --exclude='checkpoint*' --exclude='*.safetensors' --exclude='*.pt' \
    "$(basename "$2")"
}

for part in ${parts[@]+"${parts[@]}"}; do
  start=$(date +%s)
  case $part in
  setup)
    {
      stamp setup
      if [ "$TINY" = 1 ]; then
        echo "setup: --tiny: nothing installed (this environment's gspo and packages)"
      else
        if compgen -G "$WHEELS/*.whl" >/dev/null; then
          python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$WHEELS"/*.whl
        fi
        python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
      fi
      if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
      else
        echo "setup: no nvidia-smi (no GPU): skipped"
      fi
      python3 - <<'EOF'
import importlib.metadata as m, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "cuda", torch.version.cuda,
      "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device",
      "| cpus", __import__("os").cpu_count())
for d in ("transformers", "peft", "accelerate", "hydra-core", "trl", "datasets", "gguf", "math-verify"):
    try:
        print(d, m.version(d))
    except m.PackageNotFoundError:
        print(d, "absent")
EOF
    } 2>&1 | tee -a "$OUT/setup.log"
    ;;
  suite)
    if [ "$TINY" = 1 ]; then  # the suite is not run on a dry run: collected, so a test that cannot import shows
      stamp "suite: --tiny: collected, not run (at most $SUITE_S s)"
      OMP_NUM_THREADS=1 timeout "$SUITE_S" python3 -m pytest --collect-only -q -p no:xdist -p no:cacheprovider \
        >"$OUT/suite.log" 2>&1
      echo "suite rc=$?"; grep -iE "error" "$OUT/suite.log" | tail -5
      awk -F': ' '/^tests\/.*: [0-9]+$/ {n += $2; f++} END {print "suite: " n " tests collected in " f " files"}' \
        "$OUT/suite.log"
      continue
    fi
    stamp "suite (pytest -n $SUITE_WORKERS, at most $SUITE_S s)"
    # -vv (addopts holds -q) names each test as it ends, so a log cut by the timeout still says which failed;
    # pytest-timeout, where installed, stops a test that hangs (with its traceback) instead of the whole suite
    per_test=$(python3 -c 'import pytest_timeout' 2>/dev/null && echo --timeout=150)
    OMP_NUM_THREADS=1 timeout "$SUITE_S" python3 -m pytest -n "$SUITE_WORKERS" -vv $per_test -p no:cacheprovider \
      --durations=25 -rfE >"$OUT/suite.log" 2>&1
    echo "suite rc=$?"; grep -E "^\[gw[0-9]+\].* (FAILED|ERROR) " "$OUT/suite.log" | sed 's/^\[gw[0-9]*\] *\[ *[0-9]*%\] *//'
    tail -3 "$OUT/suite.log"
    ;;
  gputest)
    # tests/e2e/test_gpu.py, and the CUDA-graph decode's tests (graph == static bit for bit); all skipped without CUDA
    stamp "gputest: pytest tests/e2e/test_gpu.py, tests/rollout/decoding/test_fast_decode.py -k cuda (at most $GPUTEST_S s)"
    timeout "$GPUTEST_S" python3 -m pytest tests/e2e/test_gpu.py tests/rollout/decoding/test_fast_decode.py -k "cuda or gpu" -p no:xdist \
      -p no:cacheprovider -rfEs >"$OUT/gputest.log" 2>&1
    echo "gputest rc=$?"; tail -3 "$OUT/gputest.log"
    ;;
  job)
    if [ "$TINY" = 1 ]; then  # the same command on the CPU, 1 step of a tiny run without the warm start
      hardware=(hardware=cpu model.warm_start.steps=0 train.steps=1 rollout.prompts_per_step=4 rollout.group_size=4
                rollout.max_new_tokens=4 train.minibatches=2 task.eval_size=8 eval.every=0 cache_dir="$WORK/cache")
    else
      hardware=(hardware=gpu)
    fi
    stamp "job: gspo train ${hardware[*]} (at most $JOB_S s)"
    rm -rf "$WORK/job"  # this script's own run directory: a rerun on a warm machine starts afresh
    timeout "$JOB_S" $TIME gspo train "${hardware[@]}" logger.progress=false hydra.run.dir="$WORK/job" \
      >"$OUT/job.log" 2>&1
    echo "job rc=$?"; grep -E "accuracy|Elapsed|Maximum resident" "$OUT/job.log" | tail -6
    WORK=$WORK python3 - <<'EOF'
import json, os
job = os.environ["WORK"] + "/job"
rows = [json.loads(l) for l in open(f"{job}/metrics.jsonl")]
peak = max((r.get("memory/peak_gib", 0) for r in rows), default=0)
print("steps", len([r for r in rows if "reward/mean" in r]), "| peak allocated GiB", round(peak, 3))
print(json.load(open(f"{job}/summary.json")))
print("evals", [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r])
EOF
    keep job "$WORK/job"
    ;;
  real)
    if [ "$TINY" = 1 ]; then echo "real: --tiny: skipped (the real model on the GPU)"; continue; fi
    if [ ! -f "$GGUF" ]; then echo "real: no GGUF at $GGUF: skipped"; continue; fi
    for dtype in bfloat16 float32; do
      stamp "real: smollm2_math $dtype, $REAL_STEPS steps"
      rm -rf "$WORK/real_$dtype"
      $TIME gspo train +experiment=smollm2_math hardware=gpu hardware.dtype=$dtype \
        model.path="$GGUF" train.steps="$REAL_STEPS" rollout.mismatch_every=1 logger.progress=false \
        cache_dir="$WORK/cache" hydra.run.dir="$WORK/real_$dtype" >"$OUT/real_$dtype.log" 2>&1
      echo "real $dtype rc=$?"; grep -E "accuracy|Elapsed|Maximum resident" "$OUT/real_$dtype.log" | tail -5
      keep "real_$dtype" "$WORK/real_$dtype"
    done
    ;;
  bench)
    stamp "bench: scripts/bench_gpu.py $BENCH_ARGS $TINY_ARGS (at most $BENCH_S s)"
    timeout "$BENCH_S" python3 scripts/bench_gpu.py $BENCH_ARGS $TINY_ARGS --out "$OUT/bench_gpu.json" \
      >"$OUT/bench.log" 2>&1
    echo "bench rc=$?"; tail -40 "$OUT/bench.log"
    ;;
  decode)
    stamp "decode: scripts/bench_gpu.py --parts decode $DECODE_ARGS $TINY_ARGS (at most $DECODE_S s)"
    timeout "$DECODE_S" python3 scripts/bench_gpu.py --parts decode $DECODE_ARGS $TINY_ARGS --out "$OUT/decode.json" \
      >"$OUT/decode.log" 2>&1
    echo "decode rc=$?"; sed -n '/^Decode/,$p' "$OUT/decode.log"; grep -E "FAILED|Error|Warning" "$OUT/decode.log" | tail -5
    ;;
  *) echo "unknown part: $part (setup suite gputest job real bench decode; --tiny: the dry run)"; exit 2 ;;
  esac
  echo "== $part: $(( $(date +%s) - start )) s"
done
