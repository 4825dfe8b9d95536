"""Tiny GGUF files written here with the `gguf` package, as llama.cpp's converter writes a Llama checkpoint: a
random LlamaForCausalLM from config, a byte-level BPE tokenizer trained on a sentence, a ChatML template. Nothing
is downloaded. The source model comes back with the file, to compare what a GGUF loads into against it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HEADS, KV_HEADS, LAYERS = 4, 2, 2


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["Tom has 3 apples and gets 4 more. How many apples does Tom have now? "
                             "The answer is 7."] * 20, trainer)
    tokens = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in json.loads(tok.to_str())["model"]["merges"]]
    return tokens, merges


def _permute(x: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's reordering of q/k rows (transformers' GGUF loader undoes it)."""
    return x.reshape(heads, 2, x.shape[0] // heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def write_tiny_gguf(path: Path, arch: str = "llama", quantize: bool = False, seed: int = 0):
    """Write a tiny Llama GGUF to `path` (float32 tensors; `quantize`: the MLP's weights in Q8_0, as a quantized
    file holds them); return the LlamaForCausalLM it holds. `arch`: the header's architecture name only."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    tokens, merges = _tokenizer()
    config = LlamaConfig(vocab_size=len(tokens), hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=16,
                         max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=True, rms_norm_eps=1e-5,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(96)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_rope_dimension_count(16)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if quantize else gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t.startswith("<") else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template(CHATML)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    for i in range(LAYERS):
        for hf, gg in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"),
                       ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
                       ("self_attn.o_proj", "attn_output"), ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
                       ("mlp.down_proj", "ffn_down")):
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    state = model.state_dict()
    for key, name in names.items():
        x = state[key].numpy().astype(np.float32)
        if name.endswith("attn_q.weight"):
            x = _permute(x, HEADS)
        elif name.endswith("attn_k.weight"):
            x = _permute(x, KV_HEADS)
        if quantize and ".ffn_" in name and not name.endswith("norm.weight"):
            q = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            # what the file holds: the model the GGUF loads into has these weights, not the random ones
            deq = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
            state[key].copy_(torch.from_numpy(np.ascontiguousarray(deq)))
        else:
            w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model
