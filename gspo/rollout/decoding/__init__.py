"""How completions are drawn, in this process: from the settings to the `Rollout`.

rollouts.py (`rollout()`, the one call of training and held-out evaluation), params.py (`SamplingParams`),
seeds.py (each prompt's keyed generators), decoder.py (the `Decoder` interface every sampler is), generate.py (gspo's
own decoding through the model's forward, and `assemble`, the one maker of a sampled Rollout), fast_decode.py and
static_decode.py (the fast decode engine, its static cache), multiturn.py and chat.py (trajectories with tools, the
chat template's turns), sampler.py and quantized.py (the sampler: the policy, or a copy of it in another precision).
Imports no other part of gspo.rollout.
"""
