#!/usr/bin/env bash
# GRPO vs GSPO on long completions, on a tiny MoE and on its dense control (docs/results.md).
#
#   moe_long:   GRPO, GRPO + Routing Replay R2, GRPO + R3, GSPO
#   dense_long: GRPO, GSPO
#   x SEEDS seeds each (default 5), KL off for every algorithm (algo.beta=0), so the runs
#   differ in ratio, clip and routing replay only; then `gspo compare` on each setting, with
#   plain GRPO as the baseline of the pairwise comparison. Every run recomputes the old
#   policy's log-probs (rollout.old_logprobs=recompute): then R2 replays that pass's routing and
#   R3 the sampler's, as the GSPO paper defines them (with the sampler's log-probs as the old
#   policy's there is no old-policy pass, and R2 and R3 would replay the same routing).
#
# JOBS single-thread runs at a time (default 2: one per core of a 2-core machine). Each run
# has a fixed directory, OUT/<experiment>/<algo>/seed<k>; a rerun skips the runs whose
# summary.json says "status": "finished", resumes the others from their last checkpoint (or
# starts them afresh), so the study can be finished in several sittings (Ctrl-C, then run the
# same command again).
#
#   bash scripts/study_moe_long.sh                                  # the study (about 45 min on 2 cores)
#   SEEDS=5 bash scripts/study_moe_long.sh                          # more seeds (finished runs are kept)
#   OUT=outputs/study_smoke SEEDS=1 EXTRA="train.steps=3 eval.every=0 task.eval_size=20" \
#       bash scripts/study_moe_long.sh                              # a smoke test: minutes
set -euo pipefail
OUT=${OUT:-outputs/study_moe_long}
SEEDS=${SEEDS:-5}
JOBS=${JOBS:-2}
EXTRA=${EXTRA:-}  # more overrides for every run (e.g. train.steps=3)
GSPO=${GSPO:-gspo}  # the command (e.g. "python -m cli.main" in a source checkout)

# experiment, algo, routing replay, directory name
CELLS=(
  "moe_long grpo none grpo"
  "moe_long grpo R2 grpo_R2"
  "moe_long grpo R3 grpo_R3"
  "moe_long gspo none gspo"
  "dense_long grpo none grpo"
  "dense_long gspo none gspo"
)

# shellcheck source=scripts/study_lib.sh
source "$(dirname "$0")/study_lib.sh"
cell() {  # cell EXPERIMENT ALGO REPLAY NAME SEED
  run_one "$1 $4 seed $5" "$OUT/$1/$4/seed$5" "+experiment=$1" "algo=$2" "moe.routing_replay=$3" "seed=$5" algo.beta=0 \
    rollout.old_logprobs=recompute
}
export -f cell

mkdir -p "$OUT/logs"
start=$(date +%s)
# The warm-started bases first, one per experiment (in parallel), so the runs never race to build them.
printf '%s\n' moe_long dense_long | xargs -P "$JOBS" -I{} bash -c 'build_base "+experiment={}"'
for cell in "${CELLS[@]}"; do
  for ((seed = 0; seed < SEEDS; seed++)); do
    echo "$cell $seed"
  done
done | xargs -P "$JOBS" -L1 bash -c 'cell "$@"' _
wall=$(( $(date +%s) - start ))
echo "study wall time: ${wall} s ($JOBS jobs at a time)" | tee -a "$OUT/wall_time.txt"

$GSPO compare "$OUT/moe_long" --by algo,moe.routing_replay --baseline "grpo routing_replay=none" --out "$OUT/compare_moe"
$GSPO compare "$OUT/dense_long" --by algo --baseline grpo --out "$OUT/compare_dense"
