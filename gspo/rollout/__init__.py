"""Sampling: each step's batch of G completions per prompt, drawn, scored and collected.

  processes/  the processes gspo starts (or connects to) to sample for it: the trainer's end, the child's end,
              the shared memory a killed one leaves
  decoding/   how completions are drawn: the one `rollout()` training and evaluation call (rollouts.py), its
              `SamplingParams`, the `Decoder` interface, gspo's own decode loops, multi-turn with tools, the sampler
              copy in another precision
  engine/     an inference engine (vLLM) as the sampler: the trainer's side (client.py), the engine's process,
              `gspo vllm-serve` (server.py), and the weights' way there (slots, tensors, deltas)
  batch.py    a batch sampled, scored and shaped (`collect`); source.py: where it is sampled, in this process
              (`Inline`) or in rollout worker processes (workers.py `WorkerPool`, each a worker.py)

Floors (tests/contracts/test_layout.py): processes/ and decoding/ import neither each other nor anything above them;
engine/ imports those two; the batch modules at the top import any of them. Imports `gspo.models`, `gspo.tasks`,
`gspo.algos`, `gspo.config` and `gspo.core`.
"""
