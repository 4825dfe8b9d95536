#!/usr/bin/env bash
# Where does staleness break GRPO, does a correction hold it, is GSPO more tolerant? (+experiment=staleness: the
# wide MoE on `chain`, a bf16 sampler, the batch of step t sampled by the policy after step t-1-K.)
#
#   cells (name: overrides on top of +experiment=staleness, algo.beta=0 for all), each at K in $KS:
#     grpo           GRPO, the old log-probs recomputed by the current weights (the proximal policy)
#     grpo_decoupled + AReaL's decoupled objective: weight pi_prox/mu, dropped above 5 (token TIS x token mask)
#     gspo           GSPO at the paper's clip range, recomputed log-probs
#     gspo_sampler   GSPO with the behaviour policy's (sampler's) log-probs as the old policy's
#   x SEEDS seeds each (default 5); run directories OUT/<cell>_k<K>/seed<s>; then `gspo compare --by name`: every
#   cell against GRPO at equal K (OUT/compare_k<K>), every cell's K against its K=0 (OUT/compare_<cell>); and
#   OUT/staleness_vs_k.png, every cell's final accuracy against K (scripts/plot_staleness.py).
#
#   bash scripts/study_staleness.sh                                              # the study
#   KS="0 8" CELLS="grpo" SEEDS=1 OUT=outputs/st_pilot bash scripts/study_staleness.sh   # a pilot
# JOBS single-thread runs at a time (default 2); a rerun skips finished runs and resumes the others.
set -euo pipefail
OUT=${OUT:-outputs/study_staleness}
SEEDS=${SEEDS:-5}
JOBS=${JOBS:-2}
KS=${KS:-"0 1 2 4 8"}
EXTRA=${EXTRA:-}
GSPO=${GSPO:-gspo}

declare -A OVERRIDES=(
  [grpo]="algo=grpo"
  [grpo_decoupled]="algo=grpo rollout.tis=token rollout.tis_cap=5.0 rollout.mask=token rollout.mask_low=0.0 rollout.mask_high=5.0"
  [gspo]="algo=gspo"
  [gspo_sampler]="algo=gspo rollout.old_logprobs=sampler"
)
CELLS=${CELLS:-"grpo grpo_decoupled gspo gspo_sampler"}
for cell in $CELLS; do
  [[ -n "${OVERRIDES[$cell]+x}" ]] || { echo "unknown cell '$cell'; cells: ${!OVERRIDES[*]}" >&2; exit 2; }
done

# shellcheck source=scripts/study_lib.sh
source "$(dirname "$0")/study_lib.sh"
cell() {  # cell CELL K SEED OVERRIDES...
  local name=$1 k=$2 seed=$3
  shift 3
  run_one "${name}_k$k seed $seed" "$OUT/${name}_k$k/seed$seed" +experiment=staleness "$@" "rollout.staleness=$k" \
    "name=${name}_k$k" "seed=$seed" algo.beta=0
}
export -f cell

mkdir -p "$OUT/logs"
start=$(date +%s)
build_base +experiment=staleness
for ((seed = 0; seed < SEEDS; seed++)); do  # seed-major: a sitting cut short still has every cell at low seeds
  for k in $KS; do
    for cell in $CELLS; do
      echo "$cell $k $seed ${OVERRIDES[$cell]}"
    done
  done
done | xargs -P "$JOBS" -L1 bash -c 'cell "$@"' _
wall=$(( $(date +%s) - start ))
echo "study wall time: ${wall} s ($JOBS jobs at a time; cells: $CELLS; K: $KS)" | tee -a "$OUT/wall_time.txt"
# (a)-(c): each cell against GRPO at equal K, and each cell's K against its K=0 (Welch 95% intervals); the
# second over every K of the cell in OUT, so that a sitting which adds a K (KS="3") compares it with the rest
for k in $KS; do
  [[ " $CELLS " == *" grpo "* ]] || break
  $GSPO compare $(for cell in $CELLS; do echo "$OUT/${cell}_k$k"; done) --by name --baseline "grpo_k$k" --out "$OUT/compare_k$k"
done
for cell in $CELLS; do
  baseline=()
  [[ -d "$OUT/${cell}_k0" ]] && baseline=(--baseline "${cell}_k0")
  # shellcheck disable=SC2046  # one argument per run directory, none with spaces (the script names them)
  $GSPO compare $(ls -dv "$OUT/${cell}"_k[0-9]*) --by name ${baseline[@]+"${baseline[@]}"} --out "$OUT/compare_$cell"
done
# every cell's final accuracy against K in one figure (and its numbers as a table)
"${PYTHON:-python}" "$(dirname "$0")/plot_staleness.py" "$OUT" "$OUT/staleness_vs_k.png"
