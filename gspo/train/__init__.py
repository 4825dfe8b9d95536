"""Training: a run, from its starting model to its last checkpoint.

  run/         a run's files and its survival: the run directory and its lock, checkpoints on disk, what a resume
               may change, stop signals and preemption, a failed rank's record, a sweep's record
  ranks/       more than one process: torch.distributed (`Dist`), the torchrun launcher
  evaluation/  held-out evaluation: the split, pass@k, its records (heldout.py), during training (evaluator.py)
  start/       the model a run starts from: the warm-started base, a dense model split into experts, built once
  preflight.py what is refused before any work starts, checked against every part's registries
  loop/        the loop (`trainer.train`) and its components: set-up, the checkpointer, the critic, the reference
               and teacher models, the MoE step, metrics logging

Floors (tests/contracts/test_layout.py), bottom to top: run, ranks, evaluation, start and preflight, loop; a module
imports its own folder or a lower floor. Imports any part below it (rollout, algos, models, tasks, config, core); never
`gspo.results`.
"""
