#!/usr/bin/env bash
# The staleness study's question (d): how much wall time does each K save? Time per step of GRPO on
# +experiment=staleness (20 steps, no held-out evaluation) with one rollout worker one to eight steps ahead
# (trainer and worker one thread each), against the synchronous run in one process (2 threads, and 1) and a
# worker at K=0 (no overlap). Fresh processes, alternating, ROUNDS rounds; prints each run's means over steps
# 3-20. Time it on idle cores: nothing else may run meanwhile.
#
#   bash scripts/time_staleness.sh                 # OUT=outputs/time_staleness ROUNDS=2
set -uo pipefail
OUT=${OUT:-outputs/time_staleness}
ROUNDS=${ROUNDS:-2}
GSPO=${GSPO:-gspo}
declare -A OV=([sync_t2]="hardware.threads=2" [sync_t1]="hardware.threads=1"
  [w1_k0]="rollout.workers=1 rollout.staleness=0 hardware.threads=1" [w1_k1]="rollout.workers=1 rollout.staleness=1 hardware.threads=1"
  [w1_k2]="rollout.workers=1 rollout.staleness=2 hardware.threads=1" [w1_k4]="rollout.workers=1 rollout.staleness=4 hardware.threads=1"
  [w1_k8]="rollout.workers=1 rollout.staleness=8 hardware.threads=1")
for ((round = 1; round <= ROUNDS; round++)); do
  for side in sync_t2 sync_t1 w1_k0 w1_k1 w1_k2 w1_k4 w1_k8; do
    dir=$OUT/$side-$round
    rm -rf "$dir" && mkdir -p "$OUT"
    # shellcheck disable=SC2086  # OV values and GSPO are word lists
    $GSPO train +experiment=staleness algo=grpo algo.beta=0 train.steps=20 eval.every=0 task.eval_size=8 ${OV[$side]} \
      logger.progress=false "hydra.run.dir=$dir" >"$dir.log" 2>&1 || { echo "FAILED $side (see $dir.log)"; continue; }
    "${PYTHON:-python}" - "$dir" "$side" <<'PY'
import json, sys
d, side = sys.argv[1], sys.argv[2]
rows = [r for r in map(json.loads, open(d + "/metrics.jsonl")) if "time/step_s" in r][2:]
m = lambda k: sum(r.get(k, 0.0) for r in rows) / len(rows)
print(f"{side:8s} step {m('time/step_s'):.3f} s  update {m('time/update_s'):.3f}  rollout {m('time/rollout_s'):.3f}  "
      f"waits for its batch {m('time/sampler_wait_s'):.3f}  worker idle {m('time/worker_idle_s'):.3f}")
PY
  done
done
