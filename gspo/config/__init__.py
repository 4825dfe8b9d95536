"""Configuration: the typed schema, composing it with Hydra, the checks that need only the config.

Imports only `gspo.core` (its errors). Every other part may import it. Validation against the other parts'
registries (loss names, tasks, LoRA, ...) is `gspo.train.preflight`.
"""
