"""Every causal-LM family the installed transformers ships, at tiny size: does gspo sample and score it right?

    python scripts/check_families.py                  # all families (a few minutes on one core)
    python scripts/check_families.py llama gpt_oss    # some

Per family: a tiny random model from the family's own config class (tests/models/test_families.py's builder:
4 layers, width 32, 4 experts), then gspo's greedy sampler against `model.generate` on the same
left-padded prompts, and gspo's token log-probs against a plain forward's. One line each:

    <model_type>: <Class> [attention] ok | sampler != generate | logp off by X | FAIL <error> | BUILD <error>

BUILD means the generic tiny config does not fit that family's validation (not a gspo failure);
a FAIL can be the tiny config too (e.g. an MLA family whose rotary head size it gets wrong): look
before concluding. Run it after upgrading transformers. Routing (R2/R3) is tested in the test suite.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout: its tests package
MAX_PARAMS = 5_000_000


def check(model_type: str) -> tuple[str, str]:
    """(status: ok | wrong | FAIL | BUILD | SKIP, the report line) for one family."""
    from tests.models import test_families as tf
    from transformers import AutoConfig, AutoModelForCausalLM

    from gspo.models.build import char_tokenizer, choose_attention, normalise_config
    from gspo.models.logprobs import check_head
    from gspo.rollout.decoding.generate import encode_prompts, generate, left_pad, position_ids, token_logprobs
    from gspo.rollout.decoding.params import SamplingParams

    tok = char_tokenizer(tf.ALPHABET)
    try:
        base = AutoConfig.for_model(model_type).to_dict()
        kw = {k: v for k, v in tf.SMALL.items() if k in base}
        if "num_hidden_layers" in kw and "layer_types" not in tf.EXTRA.get(model_type, {}):
            kw["num_hidden_layers"] = 4  # hybrids place their attention layers every few layers
        kw.update(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                  bos_token_id=tok.eos_token_id, **tf.EXTRA.get(model_type, {}))
        config = AutoConfig.for_model(model_type, **kw)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if getattr(text, "hidden_size", None) not in (None, 32):
            return "SKIP", f"{model_type}: SKIP (its config has no width the tiny builder sets)"
        normalise_config(config)
        cls = AutoModelForCausalLM._model_mapping[type(config)]
        config._attn_implementation = choose_attention(cls, "auto")
        with torch.device("meta"):  # count first: some families keep sub-models the tiny builder does not shrink
            size = sum(p.numel() for p in cls(config).parameters())
        if size > MAX_PARAMS:
            return "SKIP", f"{model_type}: SKIP ({size / 1e6:.0f} M parameters at the tiny builder's settings)"
        torch.manual_seed(0)
        model = cls(config).eval()
    except Exception as e:  # noqa: BLE001  (a report line per family, whatever goes wrong)
        return "BUILD", f"{model_type}: BUILD {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    head = f"{model_type}: {cls.__name__} [{config._attn_implementation}]"
    prompts = ["12+3=", "7*8=", "123+45="]
    try:
        with torch.no_grad():
            ours = generate(model, tok, prompts, 1, SamplingParams(6, greedy=True))
            ids, mask = left_pad(encode_prompts(tok, prompts), tok.pad_token_id)
            theirs = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                    pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)[:, ids.shape[1]:]
        same = all(torch.equal(a[: int(m.sum())], b[: int(m.sum())])
                   for a, b, m in zip(ours.completion_ids, theirs, ours.completion_mask))
        check_head(model)
        ro = generate(model, tok, prompts, 2, SamplingParams(5), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            got = token_logprobs(model, ro)[0]
            mask = ro.attention_mask
            logits = model(input_ids=ro.input_ids, attention_mask=mask, position_ids=position_ids(mask)).logits.float()
            want = torch.log_softmax(logits[:, ro.prompt_len - 1 : -1], -1).gather(-1, ro.completion_ids[..., None])[..., 0]
        off = float(((got - want) * ro.completion_mask).abs().max())
    except Exception as e:  # noqa: BLE001
        return "FAIL", f"{head} FAIL {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    problems = ([] if same else ["sampler != generate"]) + ([f"logp off by {off:.1e}"] if off > 1e-4 else [])
    return ("wrong" if problems else "ok"), f"{head} " + (" | ".join(problems) or "ok")


def main(argv: list[str]) -> int:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    families = argv or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    counts: dict[str, int] = {}
    for family in families:
        status, line = check(family)
        counts[status] = counts.get(status, 0) + 1
        print(line, flush=True)
    print(f"transformers {transformers.__version__}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
