"""The equations: policy losses, advantage estimators, KL estimators, reward shaping, and the
sampler/trainer mismatch corrections; each a registry of small functions on tensors.

Imports only `gspo.config` and `gspo.core`; knows nothing of models, rollouts or the loop.
"""
