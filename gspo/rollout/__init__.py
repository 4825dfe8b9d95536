"""Sampling: one `rollout()` (rollouts.py) that training and evaluation call, with the run's `SamplingParams`
(params.py), through a `Decoder` (decoding.py): gspo's own on a torch model (generate.py, and the fast decode engine
of fast_decode.py), or an inference engine (engine.py); trajectories with tools (multiturn.py); the sampler that
may be a copy of the policy in another precision (sampler.py); batches scored and collected (batch.py).

Imports `gspo.models` and `gspo.config`.
"""
