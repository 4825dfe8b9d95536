"""An inference engine (vLLM) as the sampler (`rollout.engine=vllm`), and how the trainer's weights reach it.

client.py: the trainer's side (`EngineSampler`, `Engine`: a `Decoder`; imports no vllm); vllm_engine.py: the engine
itself, in a process of its own (`python -m gspo.rollout.engine.vllm_engine FD`); server.py: `gspo vllm-serve`, the
engine for trainers on other hosts; the weights' way: slots.py (files in /dev/shm), transport.py (tensors over a
process group), delta.py (only what changed). Imports gspo.rollout.decoding and gspo.rollout.processes.
"""
