"""The model a run starts from (`base_model`), made once and cached in `cache_dir` by content.

warm_start.py: the base a run trains (a built-in model warm-started on the task's reference solutions; or a
model=hf checkpoint, a GGUF file through its dequantized copy, gspo/models/gguf.py); split_moe.py: a dense Llama
split into a mixture of experts (`model.split_experts`: the calibration text the model writes, the build cached; the
construction is gspo/models/split_experts.py).
"""
