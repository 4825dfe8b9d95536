"""Training: the loop (`trainer.train`) and what it needs: set-up, the warm-started base, held-out
evaluation during training, checkpoints, resume and preemption, torch.distributed, run directories,
metrics logging, the MoE step component, and the check of a whole config before work starts.

Imports any part below it (rollout, algos, models, tasks, config); never `gspo.results`.
"""
