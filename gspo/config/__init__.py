"""Configuration: the typed schema, composing it with Hydra, the checks that need only the config, errors.

The bottom of the package: it imports nothing from gspo. Every other part may import it.
Validation against the other parts' registries (loss names, tasks, LoRA, ...) is `gspo.train.checks`.
"""
