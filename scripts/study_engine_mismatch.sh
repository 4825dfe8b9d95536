#!/usr/bin/env bash
# The engine's mismatch (issue 40; docs/results.md, "The engine study"): GRPO, Routing Replay on the engine's routing,
# the mismatch corrections and GSPO, when the vLLM inference engine samples in bf16 and the trainer keeps float32
# (+experiment=engine_mismatch: the wide MoE on `chain`). Runs in the engine's environment (the README's engine line).
#
#   cells (name: overrides on top of +experiment=engine_mismatch, algo.beta=0 for all):
#     grpo           GRPO, the old policy's log-probs recomputed by the trainer (auto)
#     grpo_R2        + Routing Replay R2 (replays the trainer's recomputed routing)
#     grpo_R3        + Routing Replay R3 (replays the engine's routing)
#     grpo_tis       + token TIS, C = 2
#     grpo_icepop    + token masking (IcePop / masked IS), rho outside [0.5, 5]
#     gspo           GSPO at the paper's clip range (3e-4, 4e-4), recomputed log-probs
#     gspo_sampler   GSPO on the engine's log-probs as the old policy's (no recomputation: the GSPO paper's claim)
#     grpo_fp32      GRPO, the engine in float32 (no precision mismatch: the control)
#     grpo_copy      GRPO sampled by gspo's bf16 copy of the model instead of the engine (the earlier studies' regime)
#   x SEEDS seeds each (default 5); then `gspo compare --by name --baseline grpo` (Welch 95% intervals).
#   Before the runs, scripts/probe_mismatch.py measures the mismatch of the starting policy for the bf16 engine,
#   the float32 engine and the bf16 copy (OUT/probe_<sampler>.json; PROBE_BATCHES=0 skips them).
#
# JOBS single-thread runs at a time (default 2; each is a trainer and its engine's process, taking turns on one
# core). Each run has a fixed directory OUT/<cell>/seed<k>; a rerun skips finished runs and resumes the others, so
# the study can be done in several sittings. CELLS picks a subset; EXTRA adds overrides to every run.
#
#   CELLS="grpo grpo_fp32" SEEDS=2 OUT=outputs/em_lr5e-4 EXTRA="train.lr=5e-4 ..." bash scripts/study_engine_mismatch.sh
set -euo pipefail
OUT=${OUT:-outputs/study_engine_mismatch}
SEEDS=${SEEDS:-5}
JOBS=${JOBS:-2}
EXTRA=${EXTRA:-}  # more overrides for every run (e.g. train.steps=3)
GSPO=${GSPO:-gspo}  # the command (e.g. "python -m cli.main" in a source checkout)
PROBE_BATCHES=${PROBE_BATCHES:-4}

declare -A OVERRIDES=(
  [grpo]="algo=grpo"
  [grpo_R2]="algo=grpo moe.routing_replay=R2"
  [grpo_R3]="algo=grpo moe.routing_replay=R3"
  [grpo_tis]="algo=grpo rollout.tis=token rollout.tis_cap=2.0"
  [grpo_icepop]="algo=grpo rollout.mask=token rollout.mask_low=0.5 rollout.mask_high=5.0"
  [gspo]="algo=gspo"
  [gspo_sampler]="algo=gspo rollout.old_logprobs=sampler"
  [grpo_fp32]="algo=grpo rollout.dtype=float32"
  [grpo_copy]="algo=grpo rollout.engine=auto"
)
CELLS=${CELLS:-"grpo grpo_fp32 grpo_R2 grpo_R3 grpo_tis grpo_icepop gspo gspo_sampler grpo_copy"}
for cell in $CELLS; do
  [[ -n "${OVERRIDES[$cell]+x}" ]] || { echo "unknown cell '$cell'; cells: ${!OVERRIDES[*]}" >&2; exit 2; }
done

# shellcheck source=scripts/study_lib.sh
source "$(dirname "$0")/study_lib.sh"
cell() {  # cell CELL SEED OVERRIDES...
  local name=$1 seed=$2
  shift 2
  # the engine's process takes turns with its trainer on one thread (rollout.worker_threads)
  run_one "$name seed $seed" "$OUT/$name/seed$seed" +experiment=engine_mismatch "$@" "name=$name" "seed=$seed" \
    algo.beta=0 rollout.worker_threads=1
}
export -f cell

mkdir -p "$OUT/logs"
start=$(date +%s)
build_base +experiment=engine_mismatch
# the mismatch of the starting policy, before any update: the bf16 engine, the float32 engine, the bf16 copy
for sampler in "engine_bf16 rollout.dtype=bfloat16" "engine_fp32 rollout.dtype=float32" \
               "copy_bf16 rollout.engine=auto rollout.dtype=bfloat16"; do
  ((PROBE_BATCHES > 0)) || break
  read -r name overrides <<<"$sampler"
  if [[ ! -s "$OUT/probe_$name.json" ]]; then
    # shellcheck disable=SC2086
    python "$(dirname "$0")/probe_mismatch.py" +experiment=engine_mismatch $overrides hardware.threads=1 $EXTRA \
      --batches "$PROBE_BATCHES" >"$OUT/probe_$name.json"
  fi
  echo "mismatch before any update ($name): $(cat "$OUT/probe_$name.json")"
done
for cell in $CELLS; do
  for ((seed = 0; seed < SEEDS; seed++)); do
    echo "$cell $seed ${OVERRIDES[$cell]}"
  done
done | xargs -P "$JOBS" -L1 bash -c 'cell "$@"' _
wall=$(( $(date +%s) - start ))
echo "study wall time: ${wall} s ($JOBS jobs at a time; cells: $CELLS)" | tee -a "$OUT/wall_time.txt"

baseline=()
[[ " $CELLS " == *" grpo "* ]] && baseline=(--baseline grpo)
$GSPO compare "$OUT" --by name "${baseline[@]}" --out "$OUT/compare"
