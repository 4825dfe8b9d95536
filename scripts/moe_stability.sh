#!/usr/bin/env bash
# GSPO vs GRPO stability on a tiny Mixture-of-Experts (docs/results.md).
#
# One sweep over algo in {grpo, grpo + Routing Replay R2, gspo, gmpo} x seeds {0,1,2} on the
# top-1 tiny Qwen3-MoE (the GMPO paper's toy routing), off-policy (4 minibatches per rollout
# batch, as in the GSPO paper), KL off for every algorithm so they differ in ratio and clip
# only; then `gspo compare` writes the figure and the table.
#
#   bash scripts/moe_stability.sh                 # STEPS=300, LR=1e-4 by default
#   LR=3e-4 OUT=outputs/moe_stability_lr3e-4 bash scripts/moe_stability.sh
#   STEPS=1000 OUT=outputs/moe_long bash scripts/moe_stability.sh
set -euo pipefail
OUT=${OUT:-outputs/moe_stability}
STEPS=${STEPS:-300}
LR=${LR:-1e-4}
COMMON=(model=qwen3-moe-top1 train.minibatches=4 "train.steps=${STEPS}" "train.lr=${LR}" eval.every=50
        algo.beta=0 logger.progress=false)

start=$(date +%s)
gspo train -m algo=grpo,gspo,gmpo seed=0,1,2 "${COMMON[@]}" "hydra.sweep.dir=${OUT}/sweep"
gspo train -m algo=grpo moe.routing_replay=R2 seed=0,1,2 "${COMMON[@]}" "hydra.sweep.dir=${OUT}/grpo_r2"
echo "sweep wall time: $(( $(date +%s) - start )) s"
gspo compare "${OUT}/sweep" "${OUT}/grpo_r2" --by algo,moe.routing_replay --out "${OUT}/compare"
