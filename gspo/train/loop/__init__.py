"""The training loop and its components: what runs every step.

trainer.py (`train`: the loop), setup.py (everything it needs, built from the config), components.py (the interfaces
they meet), checkpointer.py (when to save, what a save holds, where a resumed run starts, summary.json), critic.py
(PPO's value model), reference.py (the KL reference), teacher.py (distillation's teacher), moe_step.py (MoE routing
replay and statistics in the update), logging.py (metrics.jsonl and W&B).
"""
