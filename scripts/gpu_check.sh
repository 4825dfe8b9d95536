#!/usr/bin/env bash
# The GPU checks of docs/benchmarks.md ("On one GPU"), for a CUDA machine whose python3 already holds a CUDA torch,
# transformers, peft and accelerate (the device machine's image); gspo's other dependencies come as wheels in
# WHEELS (default .whl; none needed where they are installed). Each part writes its log (and small files) to OUT.
#
#   scripts/gpu_check.sh setup suite            # install gspo (no deps), then the README's test command on 16 workers
#   scripts/gpu_check.sh setup job real bench   # the default job, the real model in bf16 and float32, bench_gpu.py
#
# Parts:
#   setup  pip-install WHEELS (--no-deps, into /tmp/site) and gspo itself (editable, no deps); GPU and versions
#   suite  the default suite (`pytest`, the README's test command) with CUDA torch, on SUITE_WORKERS xdist workers
#   gputest  tests/test_gpu.py: short `gspo train hardware=gpu` runs (skipped without CUDA)
#   job    `gspo train hardware=gpu`: the README's default job on the GPU (time, peak memory, accuracy)
#   real   `gspo train +experiment=smollm2_math hardware=gpu` in bf16 and in float32 (REAL_STEPS steps each,
#          the sampler/trainer mismatch logged every step); needs the GGUF at GGUF
#   bench  scripts/bench_gpu.py BENCH_ARGS: gspo's sampler against generate(), its step against TRL's, the mismatch
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/gpu}
WHEELS=${WHEELS:-.whl}
GGUF=${GGUF:-/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf}
REAL_STEPS=${REAL_STEPS:-10}
SUITE_S=${SUITE_S:-200}
JOB_S=${JOB_S:-150}
BENCH_S=${BENCH_S:-240}
GPUTEST_S=${GPUTEST_S:-120}
SUITE_WORKERS=${SUITE_WORKERS:-16}
BENCH_ARGS=${BENCH_ARGS:---models dense --steps 3 --repeats 2 --fast}
mkdir -p "$OUT" /tmp/gpu
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} WANDB_MODE=offline HF_HUB_OFFLINE=1

TIME=$( [ -x /usr/bin/time ] && echo "/usr/bin/time -v" )  # peak RSS where GNU time is installed
stamp() { echo "== $(date -u +%H:%M:%S) $*"; }
keep() {  # a run directory's small files (no checkpoints) into OUT/NAME.tar.gz
  tar -czf "$OUT/$1.tar.gz" -C "$(dirname "$2")" --exclude='checkpoint*' --exclude='*.safetensors' --exclude='*.pt' \
    "$(basename "$2")"
}

for part in "$@"; do
  start=$(date +%s)
  case $part in
  setup)
    {
      stamp setup
      if compgen -G "$WHEELS/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
          "$WHEELS"/*.whl
      fi
      python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
      python3 - <<'EOF'
import importlib.metadata as m, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "cuda", torch.version.cuda,
      "|", torch.cuda.get_device_name(0), "| cpus", __import__("os").cpu_count())
for d in ("transformers", "peft", "accelerate", "hydra-core", "trl", "datasets", "gguf", "math-verify"):
    try:
        print(d, m.version(d))
    except m.PackageNotFoundError:
        print(d, "absent")
EOF
    } 2>&1 | tee -a "$OUT/setup.log"
    ;;
  suite)
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
    stamp "gputest: pytest tests/test_gpu.py (at most $GPUTEST_S s)"
    timeout "$GPUTEST_S" python3 -m pytest tests/test_gpu.py -p no:cacheprovider -rfE >"$OUT/gputest.log" 2>&1
    echo "gputest rc=$?"; tail -3 "$OUT/gputest.log"
    ;;
  job)
    stamp "job: gspo train hardware=gpu (at most $JOB_S s)"
    timeout "$JOB_S" $TIME gspo train hardware=gpu logger.progress=false hydra.run.dir=/tmp/gpu/job \
      >"$OUT/job.log" 2>&1
    echo "job rc=$?"; grep -E "accuracy|Elapsed|Maximum resident" "$OUT/job.log" | tail -6
    python3 - <<'EOF'
import json
rows = [json.loads(l) for l in open("/tmp/gpu/job/metrics.jsonl")]
peak = max((r.get("memory/peak_gib", 0) for r in rows), default=0)
print("steps", len([r for r in rows if "reward/mean" in r]), "| peak allocated GiB", round(peak, 3))
print(json.load(open("/tmp/gpu/job/summary.json")))
print("evals", [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r])
EOF
    keep job /tmp/gpu/job
    ;;
  real)
    if [ ! -f "$GGUF" ]; then echo "real: no GGUF at $GGUF: skipped"; continue; fi
    for dtype in bfloat16 float32; do
      stamp "real: smollm2_math $dtype, $REAL_STEPS steps"
      $TIME gspo train +experiment=smollm2_math hardware=gpu hardware.dtype=$dtype \
        model.path="$GGUF" train.steps="$REAL_STEPS" rollout.mismatch_every=1 logger.progress=false \
        cache_dir=/tmp/gpu/cache hydra.run.dir=/tmp/gpu/real_$dtype >"$OUT/real_$dtype.log" 2>&1
      echo "real $dtype rc=$?"; grep -E "accuracy|Elapsed|Maximum resident" "$OUT/real_$dtype.log" | tail -5
      keep "real_$dtype" "/tmp/gpu/real_$dtype"
    done
    ;;
  bench)
    stamp "bench: scripts/bench_gpu.py $BENCH_ARGS (at most $BENCH_S s)"
    timeout "$BENCH_S" python3 scripts/bench_gpu.py $BENCH_ARGS --out "$OUT/bench_gpu.json" >"$OUT/bench.log" 2>&1
    echo "bench rc=$?"; tail -40 "$OUT/bench.log"
    ;;
  *) echo "unknown part: $part (setup suite gputest job real bench)"; exit 2 ;;
  esac
  echo "== $part: $(( $(date +%s) - start )) s"
done
