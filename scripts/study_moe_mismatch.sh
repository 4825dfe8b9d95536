#!/usr/bin/env bash
# GRPO, its Routing Replay and mismatch corrections, and GSPO under a sampler/trainer mismatch
# (+experiment=moe_mismatch: the wide MoE on `chain`, sampled by a bf16 copy, trained in float32).
#
#   cells (name: overrides on top of +experiment=moe_mismatch, algo.beta=0 for all):
#     grpo           GRPO, the old policy's log-probs recomputed by the trainer (auto)
#     grpo_R2        + Routing Replay R2 (replays the trainer's recomputed routing)
#     grpo_R3        + Routing Replay R3 (replays the bf16 sampler's routing)
#     grpo_tis       + token TIS, C = 2
#     grpo_icepop    + token masking (IcePop / masked IS), rho outside [0.5, 5]
#     gspo           GSPO at the paper's clip range (3e-4, 4e-4), recomputed log-probs
#     gspo_sampler   GSPO with the sampler's log-probs as the old policy's (no recomputation)
#     grpo_sampler   GRPO with the sampler's log-probs as the old policy's (the other half of that claim)
#     gspo_wide      GSPO at the 10x wider clip range (3e-3, 4e-3) that was level with GRPO on moe_long
#     grpo_fp16      GRPO, fp16 sampler (Precision-RL's claim)
#     gspo_fp16      GSPO, fp16 sampler
#     grpo_fp32      GRPO, float32 sampler (the trainer's precision: no mismatch; the control for the others)
#   x SEEDS seeds each (default 5); then `gspo compare --by name --baseline grpo` (Welch 95% intervals).
#   Before the runs, scripts/probe_mismatch.py measures the mismatch of the starting policy (bf16 and fp16
#   samplers): OUT/probe_bfloat16.json, OUT/probe_float16.json (PROBE_BATCHES=0 skips them: a sweep of
#   learning rates needs them once, not per OUT).
#
# Budget: 50 runs of the preset's 200 steps each on the wide MoE are more than 3 hours on 2 cores; size
# the study from a 1-seed pilot's s/step (the compare table shows it) with EXTRA="train.steps=N" or CELLS.
# JOBS single-thread runs at a time (default 2). Each run has a fixed directory OUT/<cell>/seed<k>; a
# rerun skips finished runs, resumes the others from their last checkpoint (or restarts them), so the
# study can be done in several sittings (Ctrl-C, then the same command again). CELLS picks a subset.
# EXPERIMENT=engine_mismatch runs the same cells (and grpo_copy) sampled by the vLLM engine instead of the
# bf16 copy: scripts/study_engine_mismatch.sh, which says so.
#
#   bash scripts/study_moe_mismatch.sh                                    # the study
#   CELLS="grpo gspo" SEEDS=1 OUT=outputs/mm_pilot EXTRA="train.steps=3 eval.every=0 task.eval_size=20" \
#       bash scripts/study_moe_mismatch.sh                                # a pilot: minutes
#   EXTRA="train.lr=3e-4" OUT=outputs/mm_lr3e-4 bash scripts/study_moe_mismatch.sh   # looking for the edge
#   # the sitting in docs/results.md ("At the edge"): lr 5e-4, 16 prompts per step, 40 steps
#   OUT=outputs/mm_edge CELLS="grpo grpo_fp32 grpo_R3 gspo grpo_R2 gspo_sampler grpo_fp16 grpo_icepop grpo_tis gspo_wide grpo_sampler" \
#       EXTRA="train.lr=5e-4 rollout.prompts_per_step=16 train.steps=40 eval.every=10" bash scripts/study_moe_mismatch.sh
set -euo pipefail
EXPERIMENT=${EXPERIMENT:-moe_mismatch}  # or engine_mismatch (scripts/study_engine_mismatch.sh)
OUT=${OUT:-outputs/study_$EXPERIMENT}
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
  [grpo_sampler]="algo=grpo rollout.old_logprobs=sampler"
  [gspo_wide]="algo=gspo algo.eps_low=3e-3 algo.eps_high=4e-3"
  [grpo_fp16]="algo=grpo rollout.dtype=float16"
  [gspo_fp16]="algo=gspo rollout.dtype=float16"
  [grpo_fp32]="algo=grpo rollout.dtype=float32"
  [grpo_copy]="algo=grpo rollout.engine=auto"  # engine_mismatch: gspo's bf16 copy samples instead of the engine
)
RUN_EXTRA=""  # what every run of this experiment adds
if [[ $EXPERIMENT == engine_mismatch ]]; then
  CELLS=${CELLS:-"grpo grpo_fp32 grpo_R2 grpo_R3 grpo_tis grpo_icepop gspo gspo_sampler grpo_copy"}
  RUN_EXTRA="rollout.worker_threads=1"  # the engine's process takes turns with its trainer on one thread
  PROBES=("engine_bf16 rollout.dtype=bfloat16" "engine_fp32 rollout.dtype=float32"
          "copy_bf16 rollout.engine=auto rollout.dtype=bfloat16")
else
  CELLS=${CELLS:-"grpo grpo_fp32 grpo_R2 grpo_R3 grpo_tis grpo_icepop grpo_sampler gspo gspo_sampler gspo_wide grpo_fp16 gspo_fp16"}
  PROBES=("bfloat16 rollout.dtype=bfloat16" "float16 rollout.dtype=float16")
fi
export EXPERIMENT RUN_EXTRA
for cell in $CELLS; do
  [[ -n "${OVERRIDES[$cell]+x}" ]] || { echo "unknown cell '$cell'; cells: ${!OVERRIDES[*]}" >&2; exit 2; }
done

# shellcheck source=scripts/study_lib.sh
source "$(dirname "$0")/study_lib.sh"
cell() {  # cell CELL SEED OVERRIDES...
  local name=$1 seed=$2
  shift 2
  # shellcheck disable=SC2086  # RUN_EXTRA is a word list
  run_one "$name seed $seed" "$OUT/$name/seed$seed" "+experiment=$EXPERIMENT" "$@" "name=$name" "seed=$seed" \
    algo.beta=0 $RUN_EXTRA
}
export -f cell

mkdir -p "$OUT/logs"
start=$(date +%s)
# The warm-started base first, then the mismatch of the starting policy, before any update, for each sampler.
build_base "+experiment=$EXPERIMENT"
for probe in "${PROBES[@]}"; do
  ((PROBE_BATCHES > 0)) || break
  read -r name overrides <<<"$probe"
  if [[ ! -s "$OUT/probe_$name.json" ]]; then
    # shellcheck disable=SC2086
    python "$(dirname "$0")/probe_mismatch.py" "+experiment=$EXPERIMENT" $overrides hardware.threads=1 $EXTRA \
      --batches "$PROBE_BATCHES" >"$OUT/probe_$name.json"
  fi
  echo "mismatch before any update ($name sampler): $(cat "$OUT/probe_$name.json")"
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
