#!/usr/bin/env bash
# Multi-turn rollouts with a tool (docs/results.md, "Tool use"): GRPO vs GSPO on +experiment=tools, the tiny MoE
# learning to call a calculator for products of two 3-digit numbers.
#
#   cells: grpo, gspo (the presets as shipped) x SEEDS RL seeds (default 3), from one warm-started base; then
#   `gspo compare` (held-out accuracy, clip fractions, ...) with grpo as the baseline, and
#   scripts/tools_summary.py: each run's base and final held-out accuracy, share of trajectories that got the
#   product from the tool (`eval/correct_call`), tool calls, and the sampled batches' tool metrics.
#   WS_SEEDS=N also runs gspo from N-1 more warm-started bases (model.warm_start.seed=1..N-1, RL seed 0).
#
# JOBS single-thread runs at a time (default 2); each run has a fixed directory OUT/<cell>/seed<k>, and a rerun
# skips finished runs and resumes the others (scripts/study_lib.sh).
#
#   bash scripts/study_tools.sh                                       # the study
#   OUT=outputs/tools_smoke SEEDS=1 EXTRA="train.steps=2 eval.every=0 task.eval_size=20 model.warm_start.steps=20" \
#       bash scripts/study_tools.sh                                   # a smoke test
set -euo pipefail
OUT=${OUT:-outputs/study_tools}
SEEDS=${SEEDS:-3}
WS_SEEDS=${WS_SEEDS:-1}
JOBS=${JOBS:-2}
EXTRA=${EXTRA:-}  # more overrides for every run
GSPO=${GSPO:-gspo}  # the command (e.g. "python -m cli.main" in a source checkout)

# shellcheck source=scripts/study_lib.sh
source "$(dirname "$0")/study_lib.sh"
cell() {  # cell ALGO SEED WARM_START_SEED
  local dir="$OUT/$1/seed$2" label="$1 seed $2"
  if [ "$3" != 0 ]; then dir="$OUT/$1_ws$3/seed$2"; label="$1 ws $3 seed $2"; fi
  run_one "$label" "$dir" +experiment=tools "algo=$1" "seed=$2" "model.warm_start.seed=$3"
}
export -f cell

mkdir -p "$OUT/logs"
start=$(date +%s)
for ((ws = 0; ws < WS_SEEDS; ws++)); do echo "$ws"; done | \
  xargs -P "$JOBS" -I{} bash -c 'build_base +experiment=tools model.warm_start.seed={}'
{
  for ((seed = 0; seed < SEEDS; seed++)); do
    for algo in grpo gspo; do echo "$algo $seed 0"; done
  done
  for ((ws = 1; ws < WS_SEEDS; ws++)); do echo "gspo 0 $ws"; done
} | xargs -P "$JOBS" -L1 bash -c 'cell "$@"' _
wall=$(( $(date +%s) - start ))
echo "study wall time: ${wall} s ($JOBS jobs at a time)" | tee -a "$OUT/wall_time.txt"

$GSPO compare "$OUT/grpo" "$OUT/gspo" --by algo --baseline grpo --out "$OUT/compare"
python "$(dirname "$0")/tools_summary.py" "$OUT"
