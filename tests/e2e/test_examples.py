"""The documented command of examples/README.md, run end to end: a user's checkpoint (a tiny Qwen3 with a chat
template, saved here), the shipped chat-format data and reward file, LoRA; then the adapter reloads with peft."""

import json
import re
import shlex
import shutil
from pathlib import Path

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM
from typer.testing import CliRunner

from cli.main import app
from gspo.models.build import char_tokenizer
from tests.conftest import REPO

ROOT = REPO
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def documented_command() -> list[str]:
    """The `gspo train model=hf ...` command of examples/README.md, as argv after `gspo`."""
    text = (ROOT / "examples" / "README.md").read_text()
    block = re.search(r"```bash\n(gspo train model=hf .*?)```", text, re.S).group(1)
    return shlex.split(block.replace("\\\n", " "))[1:]


def user_checkpoint(path: Path) -> Path:
    """A tiny Qwen3 whose tokenizer has a chat template and every character of the example data."""
    data = (ROOT / "examples" / "arithmetic_chat.jsonl").read_text()
    text = "".join(m["content"] for line in data.splitlines() for m in json.loads(line)["messages"])
    tok = char_tokenizer(text + data + CHAT_TEMPLATE + "<>assistantusersystem\n")
    tok.chat_template = CHAT_TEMPLATE
    config = Qwen3Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, intermediate_size=64, max_position_embeddings=1024,
                         tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    teach_the_answer_format(model, tok, [json.loads(line) for line in data.splitlines()])
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def teach_the_answer_format(model, tok, rows, steps: int = 25) -> None:
    """A few supervised steps towards `#### N`, so that sampled rewards differ and RL has a gradient."""
    from gspo.rollout.decoding.generate import encode_prompts

    prompts = encode_prompts(tok, [r["messages"] for r in rows])
    targets = [tok(r["answer"].rsplit("\n", 1)[-1], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
               for r in rows]
    ids = [p + t for p, t in zip(prompts, targets)]
    width = max(map(len, ids))
    input_ids = torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x in ids])
    labels = torch.tensor([[-100] * len(p) + t + [-100] * (width - len(p) - len(t)) for p, t in zip(prompts, targets)])
    mask = (torch.arange(width)[None] < torch.tensor([len(x) for x in ids])[:, None]).long()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(input_ids=input_ids, attention_mask=mask, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()


def with_values(args: list[str], **values) -> list[str]:
    """`args` with KEY=VALUE replaced where KEY is given (dots as __), the rest appended."""
    values = {k.replace("__", "."): v for k, v in values.items()}
    out = [f"{a.split('=', 1)[0]}={values.pop(a.split('=', 1)[0])}" if a.split("=", 1)[0] in values else a for a in args]
    return out + [f"{k}={v}" for k, v in values.items()]


def test_the_documented_command_trains_lora_on_user_data_and_reward(tmp_path, monkeypatch):
    args = documented_command()
    assert args[0] == "train" and "model.lora.r=16" in args and "reward=python" in args and "task=data" in args
    shutil.copytree(ROOT / "examples", tmp_path / "examples")  # the command's relative paths, from the cwd
    model_dir = user_checkpoint(tmp_path / "my-model")
    args = with_values(args, model__path=model_dir, hardware="cpu", train__steps=2, rollout__max_new_tokens=8,
                       rollout__prompts_per_step=4, rollout__group_size=4, train__minibatches=2,
                       logger__progress="false", hardware__threads=1, hydra__run__dir=tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, args)  # the CLI in this process (as a subprocess it only adds its imports)
    assert res.exit_code == 0, res.output[-3000:]
    assert "10 held-out problems" in res.stderr  # the small-file warning, with the true count

    run = tmp_path / "run"
    assert json.loads((run / "summary.json").read_text())["status"] == "finished"
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2]
    assert any(m["reward/frac_zero_std"] < 1.0 for m in lines[1:])  # some group's rewards differed: a gradient
    assert {"reward/fn/accuracy/mean", "reward/fn/formatted/mean", "reward/correct/mean", "kl/old"} <= lines[-1].keys()

    ckpt = run / "checkpoints" / "step_000002"
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), str(ckpt))
    saved = load_file(str(ckpt / "adapter_model.safetensors"))
    lora = {n: p for n, p in adapter.named_parameters() if "lora_" in n}
    assert len(lora) == len(saved) == 2 * 7 * 2  # A and B, 7 projections, 2 layers
    assert any(p.abs().sum() > 0 for n, p in lora.items() if "lora_B" in n)  # trained: B starts at 0
