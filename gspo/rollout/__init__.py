"""Sampling: G completions per prompt with their log-probs (`generate`), the fast decode engine for
Qwen3 / Qwen3-MoE, and the sampler that may be a copy of the policy in another precision.

Imports `gspo.models` and `gspo.config`.
"""
