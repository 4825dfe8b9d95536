"""Tools (gspo/tasks/tools.py), the chat template's side of a tool conversation (gspo/rollout/decoding/chat.py) and the
multi-turn driver (gspo/rollout/decoding/multiturn.py) on a scripted engine: what a trajectory holds, token by token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gspo.core.errors import ConfigError
from gspo.models.build import char_tokenizer
from gspo.rollout.decoding import chat
from gspo.rollout.decoding.decoder import Continuation, Decoder
from gspo.rollout.decoding.multiturn import ToolUse
from gspo.rollout.decoding.params import SamplingParams
from gspo.rollout.decoding.rollouts import rollout
from gspo.tasks.tools import Toolbox
from tests.conftest import REPO

TOOLS = '''
import asyncio, os, sys, time

print("imported")  # never reaches gspo's output


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def boom(x: int) -> int:
    """Raises.

    Args:
        x: Anything.
    """
    raise ValueError("no good")


def hang(x: int) -> int:
    """Never returns.

    Args:
        x: Anything.
    """
    time.sleep(600)


def die(x: int) -> int:
    """Kills its process.

    Args:
        x: Anything.
    """
    os._exit(3)


def loud(x: int) -> int:
    """Prints, through Python and through the file descriptor.

    Args:
        x: Anything.
    """
    print("NOISE-PY")
    os.write(1, b"NOISE-FD\\n")
    return x


def leave(x: int) -> int:
    """Calls sys.exit.

    Args:
        x: Anything.
    """
    sys.exit(1)


async def later(x: int) -> int:
    """An async tool.

    Args:
        x: Anything.
    """
    await asyncio.sleep(0)
    return x + 1


def undocumented(x):
    return x
'''


@pytest.fixture(scope="module")
def tool_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tools") / "tools.py"
    path.write_text(TOOLS)
    return path


@pytest.fixture(scope="module")
def box(tool_file):
    b = Toolbox([f"{tool_file}:add,boom,hang,die,loud,leave,later"], timeout_s=1.0)
    yield b
    b.close()


def test_a_tool_is_a_typed_documented_function_with_transformers_schema(box):
    from transformers.utils import get_json_schema

    def add(a: int, b: int) -> int:
        """Adds two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """

    assert box.names == ["add", "boom", "hang", "die", "loud", "leave", "later"]
    assert box.schemas[0] == get_json_schema(add)  # what TRL (transformers' apply_chat_template) renders
    assert box.call("add", {"a": 2, "b": 3}) == ("5", False)
    assert box.call("later", {"x": 1}) == ("2", False)  # async def: awaited


def test_failures_answer_the_model_as_trl_does_and_never_stop_the_run(box, capfd):
    assert box.call("boom", {"x": 1}) == ("{'error': 'no good'}", True)  # TRL: str({"error": str(e)})
    assert box.call("add", {"a": 1})[1]  # a missing argument: a TypeError, answered
    assert box.call("nope", {}) == ("{'error': 'Tool nope not found.'}", True)
    assert box.call("leave", {"x": 1})[1]  # sys.exit inside a tool: that call's failure
    content, failed = box.call("hang", {"x": 1})
    assert failed and "timed out after 1 s (rollout.tool_timeout_s)" in content
    content, failed = box.call("die", {"x": 1})
    assert failed and "process died (exit code 3)" in content
    assert box.call("loud", {"x": 7}) == ("7", False)  # a new process after each of the two above
    assert box.call("add", {"a": 2, "b": 2}) == ("4", False)
    out, err = capfd.readouterr()
    assert "NOISE" not in out + err and "imported" not in out + err


@pytest.mark.parametrize("spec, message", [
    ("nofile.py:f", "no such file nofile.py"),
    ("{file}:missing", "has no function 'missing'. Functions there: add, boom"),
    ("{file}:undocumented", "undocumented: "),
    ("{file}", "expected FILE.py:fn1,fn2"),
])
def test_a_bad_tool_spec_is_one_line(spec, message, tool_file):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as e:
        Toolbox([spec.format(file=tool_file)], timeout_s=1.0)
    assert "\n" not in str(e.value)


def test_a_trl_tool_file_runs_unchanged():
    """examples/tools.py is written as TRL's docs write tools; gspo loads, describes and calls it."""
    b = Toolbox([f"{REPO / 'examples/tools.py'}:multiply,add"], timeout_s=5.0)
    try:
        assert b.schemas[0]["function"]["parameters"]["required"] == ["a", "b"]
        assert b.call("multiply", {"a": 6, "b": 7}) == ("42", False)
    finally:
        b.close()


# --------------------------------------------------------------------------- the chat template's side


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer("0123456789*+-= abcdefghijklmnopqrstuvwxyz{}[]\":,'._", chat=True)


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_tool_calls_are_read_as_the_template_writes_them(tok):
    calls = [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]
    text = tok.apply_chat_template([{"role": "user", "content": "1+2"},
                                    {"role": "assistant", "content": "", "tool_calls": calls}], tokenize=False)
    body = text.split("<|assistant|>")[1].removesuffix("<eos>")
    assert body == '<tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call>'
    turn = chat.read_turn(tok, body, ids(tok, body), [], [])
    assert turn.calls == calls and turn.content == "" and not turn.malformed
    # Qwen3's own rendering (newlines, spaces) and Qwen2.5's arguments-as-a-string read the same
    qwen = '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}\n</tool_call>'
    assert chat.read_turn(tok, "sure\n" + qwen, [], [], []).calls == calls
    assert chat.read_turn(tok, "sure\n" + qwen, [], [], []).content == "sure"
    assert chat.read_turn(tok, "42", [], [], []).calls == []


@pytest.mark.parametrize("body, why", [
    ("<tool_call>{name: add}</tool_call>", "not JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', "no tool name"),
    ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "arguments are not an object"),
    ('<tool_call>{"name": "add"', "without </tool_call>"),
])
def test_a_malformed_call_is_an_outcome_not_a_crash(tok, body, why):
    turn = chat.read_turn(tok, body, [], [], [])
    assert turn.calls == [] and len(turn.malformed) == 1 and why in turn.malformed[0]


def test_a_declared_response_template_is_used(tok):
    """A tokenizer that declares its format (transformers' `response_template`) is parsed with it."""
    import copy

    t = copy.deepcopy(tok)
    t.response_template = {"defaults": {"role": "assistant"}, "start_anchor": "<|assistant|>", "fields": {
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<eos>\s*", "content": "text"}}}
    body = '<tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call>'
    turn = chat.read_turn(t, "", ids(t, body), ids(t, "<|user|>1+2<|assistant|>"), [])
    assert turn.calls == [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]
    assert chat.read_turn(t, "", ids(t, "<tool_call>{x</tool_call>"), ids(t, "<|assistant|>"), []).malformed


def test_the_tools_turn_is_what_the_template_renders_after_the_models_end_token(tok):
    reply = [{"role": "tool", "name": "add", "content": "3"}]
    assert tok.decode(chat.tool_suffix(tok, reply, {tok.eos_token_id})) == "<|tool|>3<|assistant|>"


def test_qwen3s_template_gives_its_tool_turn_without_re_rendering_the_model_turn():
    """Qwen3's own template (as TRL ships it) writes "\\n" after <|im_end|>: the suffix starts with it; and it drops
    the empty <think> block of an assistant turn once messages follow, which changes nothing here (TRL swaps in
    its training template for that)."""
    jinja = pytest.importorskip("trl").__file__.replace("__init__.py", "chat_templates/qwen3.jinja")
    tok = char_tokenizer("".join(map(chr, range(32, 127))) + "\n")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    tok.eos_token = "<|im_end|>"
    tok.chat_template = Path(jinja).read_text()
    chat.check_template(tok, {tok.eos_token_id})
    suffix = tok.decode(chat.tool_suffix(tok, [{"role": "tool", "name": "add", "content": "3"}], {tok.eos_token_id}))
    assert suffix == "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_a_template_without_tools_is_refused_in_one_line(tok):
    import copy

    t = copy.deepcopy(tok)
    t.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ConfigError, match="drops tool calls or tool messages"):
        chat.check_template(t, {t.eos_token_id})


def test_a_template_that_cannot_close_a_tool_turn_is_refused_before_any_work(tmp_path):
    """A checkpoint whose template renders tool calls and replies but ends the assistant's turn with no stop id
    (here ';'): the tools' turn cannot be placed after what the model samples. `gspo train`'s checks refuse it in
    one line, before any work (it failed at the first tool call a run answered)."""
    from gspo.config.loading import compose
    from gspo.models.build import CHAT_TEMPLATE, EOS, build_model
    from gspo.train.preflight import check

    t = char_tokenizer("0123456789*+-= abcdefghijklmnopqrstuvwxyz{}[]\":,'._;", chat=True)
    t.chat_template = CHAT_TEMPLATE.replace("{%- endfor -%}" + EOS, "{%- endfor -%};")
    assert t.chat_template != CHAT_TEMPLATE
    cfg = compose(["model=qwen3-tiny", "model.head_dim=16"])
    build_model(cfg.model, len(t), t, seed=0).save_pretrained(tmp_path)
    t.save_pretrained(tmp_path)
    tools = f"rollout.tools={REPO / 'examples/tools.py'}:add"
    with pytest.raises(ConfigError, match="rollout.tools: the chat template ends no assistant turn with a stop token"):
        check(compose(["model=hf", f"model.path={tmp_path}", tools]))
    t.chat_template = CHAT_TEMPLATE  # the same checkpoint, its turns ended by EOS: accepted
    t.save_pretrained(tmp_path)
    check(compose(["model=hf", f"model.path={tmp_path}", tools]))


# --------------------------------------------------------------------------- the driver, on a scripted engine


class Scripted(Decoder):
    """A decoder that continues sequences with the given turns, log-prob -0.5 per token."""

    def __init__(self, tok, turns: list[str]):
        self.turns = [ids(tok, t) for t in turns]
        self.calls: list[tuple] = []
        self.stop = tok.eos_token_id

    def stop_ids(self, tokenizer):
        return torch.tensor([self.stop])

    def sample(self, *args):
        raise NotImplementedError("a multi-turn rollout only continues sequences")

    def continue_sequences(self, tokenizer, sequences, max_new_tokens, generators, params):
        self.calls.append((sequences, max_new_tokens))
        out = []
        for seq, m in zip(sequences, max_new_tokens):
            script = self.turns[len(self.calls) - 1][:m]
            out.append(Continuation(script, torch.full((len(script),), -0.5), script[-1:] == [self.stop]))
        return out


@pytest.fixture
def tools(tool_file):
    return ToolUse((f"{tool_file}:add,boom,hang,die,loud,leave,later",), 1.0, 3)


CALL = '<tool_call>{"name":"add","arguments":{"a":2,"b":3}}</tool_call><eos>'


def test_a_trajectory_holds_the_models_tokens_and_the_tools_as_rendered(tok, tools):
    engine = Scripted(tok, [CALL, "5<eos>"])
    r = rollout(engine, tok, ["2+3"], 1, SamplingParams(64), [(0,)], tools=tools)
    prompt = ids(tok, "<|system|>add,boom,hang,die,loud,leave,later<|user|>2+3<|assistant|>")
    reply = ids(tok, "<|tool|>5<|assistant|>")
    assert engine.calls[1][0] == [prompt + ids(tok, CALL) + reply]  # token in, token out: nothing re-rendered
    assert r.input_ids[0].tolist() == prompt + ids(tok, CALL) + reply + ids(tok, "5<eos>")
    mine = [1.0] * len(ids(tok, CALL)) + [0.0] * len(reply) + [1.0, 1.0]
    assert r.completion_mask[0].tolist() == mine and r.attention_mask[0].tolist() == [1] * r.input_ids.shape[1]
    assert r.sampler_logp[0].tolist() == [-0.5 * m for m in mine]  # behaviour log-probs on the model's tokens only
    assert r.texts == ["5"] and r.lengths.tolist() == [sum(mine)]
    assert r.conversations == [[
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "assistant", "content": "5"}]]
    assert (r.turns.tolist(), r.tool_calls.tolist(), r.tool_errors.tolist()) == ([2], [1], [0])
    assert not r.truncated[0] and not r.ill_formed[0]
    assert engine.calls[0][1] == [64] and engine.calls[1][1] == [64 - len(ids(tok, CALL)) - len(reply)]  # one budget
    from gspo.tasks.rewards import completion_ids

    assert completion_ids(r) == [ids(tok, CALL) + reply + ids(tok, "5<eos>")]  # TRL's: the tools' tokens too


def test_max_turns_budget_and_failures_end_or_shape_a_trajectory(tok, tools, tool_file):
    # the last allowed turn's calls are not run
    one = ToolUse(tools.specs, 1.0, 1)
    r = rollout(Scripted(tok, [CALL]), tok, ["2+3"], 1, SamplingParams(64), [(0,)], tools=one)
    assert (r.turns.tolist(), r.tool_calls.tolist(), r.completion_mask.sum().item()) == ([1], [0], len(ids(tok, CALL)))
    # no room for the tool's reply and one more token: the call ran, the trajectory ends (as TRL rolls back)
    reply = len(ids(tok, "<|tool|>5<|assistant|>"))
    r = rollout(Scripted(tok, [CALL]), tok, ["2+3"], 1, SamplingParams(len(ids(tok, CALL)) + reply), [(0,)],
                tools=tools)
    tail = r.input_ids.shape[1] - r.prompt_len
    assert (r.turns.tolist(), r.tool_calls.tolist(), tail) == ([1], [1], len(ids(tok, CALL)))
    # the budget runs out inside the second turn: truncated
    r = rollout(Scripted(tok, [CALL, "555555555<eos>"]), tok, ["2+3"], 1,
                SamplingParams(len(ids(tok, CALL)) + reply + 4), [(0,)],
                tools=tools)
    assert bool(r.truncated[0]) and r.completion_mask.sum().item() == len(ids(tok, CALL)) + 4
    # a malformed call and a raising tool: answered, counted, the model goes on
    bad = '<tool_call>{oops</tool_call><tool_call>{"name":"boom","arguments":{"x":1}}</tool_call><eos>'
    r = rollout(Scripted(tok, [bad, "0<eos>"]), tok, ["2+3"], 1, SamplingParams(250), [(0,)], tools=tools)
    assert (r.turns.tolist(), r.tool_calls.tolist(), r.tool_errors.tolist()) == ([2], [2], [2])
    replies = [m["content"] for m in r.conversations[0] if m["role"] == "tool"]
    assert replies[0] == "{'error': 'no good'}" and replies[1].startswith("{'error': 'malformed tool call: not JSON")


def test_the_rollout_metrics(tok, tools):
    from gspo.rollout.batch import tool_metrics

    r = rollout(Scripted(tok, [CALL, "5<eos>"]), tok, ["2+3", "1+1"], 1, SamplingParams(64), [(0,), (1,)], tools=tools)
    m = tool_metrics(r)
    env = len(ids(tok, "<|tool|>5<|assistant|>"))
    assert m["rollout/turns_mean"] == 2.0 and m["rollout/tool_calls_mean"] == 1.0 and m["rollout/tool_errors_frac"] == 0
    assert m["rollout/env_token_frac"] == pytest.approx(env / (len(ids(tok, CALL)) + env + 2))
    assert json.dumps(r.conversations)  # plain JSON: samples.jsonl and checkpoints hold it


def test_dapos_overlong_penalty_counts_every_token_the_budget_counts(tok, tool_file):
    """rollout.max_new_tokens budgets everything after the prompt, the tools' replies included: DAPO's soft overlong
    punishment measures a trajectory in the same unit (verl counts the whole response, its attention mask), so one
    that used its whole budget is punished in full however much of it the tools wrote (by the model's tokens alone
    it would look 3 tokens shorter: -0.25 here)."""
    import contextlib

    from gspo.config.loading import compose
    from gspo.rollout.batch import Share, collect
    from gspo.tasks import build_task

    reply, answer = len(ids(tok, "<|tool|>5<|assistant|>")), len(ids(tok, "5<eos>"))
    budget = len(ids(tok, CALL)) + reply + answer  # the call, the reply and the answer fill it exactly
    cfg = compose(["algo=grpo", f"rollout.tools={tool_file}:add", f"rollout.max_new_tokens={budget}",
                   "algo.overlong_buffer=4", "rollout.prompts_per_step=1", "rollout.group_size=2",
                   "train.minibatches=1"])
    engine = Scripted(tok, [CALL, "5<eos>"])
    batch, _ = collect(cfg, 1, lambda: contextlib.nullcontext(engine), tok, build_task(cfg.task), Share(0, 1),
                       SamplingParams.of(cfg))
    assert (batch.rollout.attention_mask[:, batch.rollout.prompt_len:].sum(-1) == budget).all()
    assert batch.rollout.lengths.tolist() == [budget - reply] * 2 and not batch.rollout.truncated.any()
    assert batch.parts["overlong"].tolist() == [-1.0, -1.0]


def test_prompts_are_rendered_with_the_tools_names(tok, tools):
    engine = Scripted(tok, ["7<eos>"])
    rollout(engine, tok, [[{"role": "user", "content": "3+4"}]], 2, SamplingParams(8), [(0,)], tools=tools)
    assert tok.decode(engine.calls[0][0][0]) == "<|system|>add,boom,hang,die,loud,leave,later<|user|>3+4<|assistant|>"
    assert len(engine.calls[0][0]) == 2  # G = 2 trajectories of the one prompt
