"""The model side: building tiny models from config and loading any Hugging Face checkpoint (a GGUF file through its
dequantized copy: gguf.py), LoRA adapters (peft), MoE routers (capture, replay, statistics), a dense Llama split into
a mixture of experts (split_experts.py: the construction, on the calibration text it is given), LM-head log-probs.

Imports only `gspo.config` and `gspo.core`.
"""
