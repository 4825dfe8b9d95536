#!/usr/bin/env bash
# PPO with a critic and TRL's RLOO against GRPO and GSPO at equal samples (docs/results.md, "PPO with a critic").
#
#   default:  the default job (tiny MoE, addition, 600 steps of 32 prompts x 8): grpo, gspo, ppo, rloo
#   moe_long: +experiment=moe_long (tiny MoE, ~42-token derivations, 200 steps of 32 x 8): grpo, gspo, ppo
#   x SEEDS seeds each (default 3), every preset as it is (no other option): each run samples the same prompts
#   and as many completions per step; PPO also trains its critic on them. Then `gspo compare` per setting, GRPO
#   the baseline, the critic's metrics in a table of their own.
#
# JOBS single-thread runs at a time (default 2); fixed run directories OUT/<setting>/<algo>/seed<k>: a rerun skips
# finished runs and resumes the others (scripts/study_lib.sh), so the study can be done in several sittings.
#
#   bash scripts/study_baselines.sh
#   OUT=outputs/study_smoke SEEDS=1 EXTRA="train.steps=3 eval.every=0 task.eval_size=20" bash scripts/study_baselines.sh
set -euo pipefail
OUT=${OUT:-outputs/study_baselines}
SEEDS=${SEEDS:-3}
JOBS=${JOBS:-2}
EXTRA=${EXTRA:-}
GSPO=${GSPO:-gspo}

CELLS=(  # setting, algo
  "default grpo" "default gspo" "default ppo" "default rloo"
  "moe_long grpo" "moe_long gspo" "moe_long ppo"
)

# shellcheck source=scripts/study_lib.sh
source "$(dirname "$0")/study_lib.sh"
cell() {  # cell SETTING ALGO SEED
  local experiment=()
  [[ $1 == default ]] || experiment=("+experiment=$1")
  run_one "$1 $2 seed $3" "$OUT/$1/$2/seed$3" "${experiment[@]}" "algo=$2" "seed=$3"
}
export -f cell

mkdir -p "$OUT/logs"
start=$(date +%s)
printf '%s\n' "" "+experiment=moe_long" | xargs -P "$JOBS" -I{} bash -c 'build_base {}'
for cell in "${CELLS[@]}"; do
  for ((seed = 0; seed < SEEDS; seed++)); do
    echo "$cell $seed"
  done
done | xargs -P "$JOBS" -L1 bash -c 'cell "$@"' _
wall=$(( $(date +%s) - start ))
echo "study wall time: ${wall} s ($JOBS jobs at a time)" | tee -a "$OUT/wall_time.txt"

$GSPO compare "$OUT/default" --by algo --baseline grpo --out "$OUT/compare_default"
$GSPO compare "$OUT/moe_long" --by algo --baseline grpo --out "$OUT/compare_moe_long"
