#!/usr/bin/env bash
# The GPU sitting of the mismatch study (issue 22, docs/results.md): GRPO, GRPO + R3 and GSPO, 3 seeds each,
# on one CUDA GPU with a float32 trainer and a bf16 sampler (+experiment=moe_mismatch otherwise: `chain`,
# lr 1e-4, 32 prompts x G=8, 64 new tokens, 4 minibatches, 200 steps), on a MoE wider than the CPU's:
# qwen3-moe-wide at hidden 256 (4 heads of 64) with 128 experts of width 32, top-8 (Qwen3-30B-A3B's expert
# count and top-k, 4 layers). All runs at once (JOBS=9), one process each, sharing the GPU.
# It is scripts/study_moe_mismatch.sh with these settings: the same cells, resumable the same way (a run
# stopped by SIGTERM checkpoints its step and resumes on the next invocation), CELLS/SEEDS/EXTRA as there.
#
#   bash scripts/study_gpu_mismatch.sh
set -euo pipefail
WIDER="model.hidden_size=256 model.num_heads=4 model.head_dim=64 model.num_experts=128 model.top_k=8 model.moe_intermediate_size=32"
export CELLS=${CELLS:-"grpo grpo_R3 gspo"} SEEDS=${SEEDS:-3} JOBS=${JOBS:-9} OUT=${OUT:-outputs/study_gpu_mismatch}
export EXTRA="hardware=gpu hardware.dtype=float32 $WIDER ${EXTRA:-}"
exec bash "$(dirname "$0")/study_moe_mismatch.sh"
