"""The model side: building tiny models from config and loading any Hugging Face checkpoint, LoRA
adapters (peft), MoE routers (capture, replay, statistics) and LM-head log-probs.

Imports only `gspo.config`.
"""
