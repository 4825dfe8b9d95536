#!/usr/bin/env bash
# The engine's mismatch (issue 40; docs/results.md, "The engine's mismatch"): GRPO, Routing Replay on the engine's routing,
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
# The machinery is scripts/study_moe_mismatch.sh's (EXPERIMENT=engine_mismatch): the same cells, other samplers.
#
#   CELLS="grpo grpo_fp32" SEEDS=2 OUT=outputs/em_lr5e-4 EXTRA="train.lr=5e-4 ..." bash scripts/study_engine_mismatch.sh
#   # the sitting in docs/results.md: the same wide MoE on 2-digit addition (on `chain` no step size was found
#   # where the float32 control learns in 100 steps), lr 3e-4, 100 steps, then each run continued to 200
#   OUT=outputs/em_grid_lr3e-4 EXTRA="task=addition rollout.max_new_tokens=5 train.steps=100 eval.every=20 train.lr=3e-4" \
#       bash scripts/study_engine_mismatch.sh
#   ls -d outputs/em_grid_lr3e-4/*/seed* | xargs -P 2 -I{} gspo train resume={} train.steps=200
set -euo pipefail
EXPERIMENT=engine_mismatch exec bash "$(dirname "$0")/study_moe_mismatch.sh"
