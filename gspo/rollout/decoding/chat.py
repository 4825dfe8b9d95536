"""What a multi-turn rollout needs of the chat template: the tools' turns as tokens, the model's tool calls read.

Token in, token out: a trajectory is never rendered again. The model's tokens are kept as sampled; a tool reply
is appended as the template renders it after an assistant turn, found much as TRL finds it
(trl/trainer/grpo_trainer.py `GRPOTrainer._get_tool_suffix_ids`): in the template's rendering of a dummy user
and assistant turn followed by the tool messages and the generation prompt, what follows the assistant turn's
end token. Earlier turns are never re-rendered: a template that drops a reasoning block from past turns
(Qwen3's `<think>`) cannot change what was sampled.

Tool calls are read as the template writes them: with the tokenizer's own `response_template` (transformers'
`parse_response`), else in the Qwen3 / Hermes format `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
that Qwen2.5, Qwen3 and the tiny models' template (gspo/models/build.py) render. A `<tool_call>` block that does
not parse as such is a malformed call: counted, and answered with an error, never a crash.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from gspo.core.errors import ConfigError

_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)


@dataclass
class Turn:
    """One assistant turn, read."""

    content: str  # the text before its tool calls
    calls: list[dict] = field(default_factory=list)  # {"type": "function", "function": {"name", "arguments"}}
    malformed: list[str] = field(default_factory=list)  # why each unreadable call could not be read


def read_turn(tokenizer, text: str, ids: list[int], prefix: list[int], schemas: list[dict]) -> Turn:
    """The content and tool calls of an assistant turn: `text` (its tokens `ids`, stop token excluded, decoded
    with special tokens skipped) after `prefix` (the token ids before it)."""
    if getattr(tokenizer, "response_template", None) is not None:
        try:
            msg = tokenizer.parse_response(ids, prefix=prefix, tools=schemas)
        except Exception as e:  # the template's parser gave up on what the model wrote
            return Turn(text, malformed=[f"{type(e).__name__}: {e}"])
        turn = Turn(str(msg.get("content") or ""))
        found = [_as_call(c.get("function") if isinstance(c, dict) else None) for c in msg.get("tool_calls") or []]
    else:
        first = text.find("<tool_call>")
        turn = Turn(text if first < 0 else text[:first].rstrip("\n"))
        found = []
        for body, close in _CALL.findall(text[first:] if first >= 0 else ""):
            try:
                found.append(_as_call(json.loads(body)) if close else "<tool_call> without </tool_call>")
            except json.JSONDecodeError as e:
                found.append(f"not JSON ({e})")
    for c in found:
        if isinstance(c, str):
            turn.malformed.append(c)
        else:
            turn.calls.append(c)
    return turn


def _as_call(fn) -> dict | str:
    """The call `{"type": "function", "function": {"name", "arguments"}}` that `fn` ({"name", "arguments"}) is, or
    why it is none. Arguments written as a JSON string (Qwen2.5 does) are read."""
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        return "no tool name"
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        return "arguments are not an object"
    return {"type": "function", "function": {"name": fn["name"], "arguments": args}}


def tool_suffix(tokenizer, tool_messages: list[dict], stops: set[int]) -> list[int]:
    """The token ids the template puts after an assistant turn's end token (one of `stops`) for these tool
    messages, the next assistant turn's opening included: what a trajectory appends after the model's stop token.

    TRL takes what follows the dummy conversation's rendering, which must then be a prefix of the one with the
    tools' messages; gspo takes what follows the assistant turn's end token, found by counting end tokens, so a
    template that renders that turn differently once messages follow it (Qwen3's own drops the empty `<think>`
    block, which is why TRL swaps in a training template) gives its suffix all the same."""
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    before = _ids(tokenizer, tokenizer.apply_chat_template(dummy, tokenize=False))
    after = _ids(tokenizer, tokenizer.apply_chat_template(dummy + tool_messages, add_generation_prompt=True,
                                                          tokenize=False))
    n = sum(t in stops for t in before)  # end tokens up to the assistant's (Qwen3 writes "\n" after it: the suffix's)
    ends = [i for i, t in enumerate(after) if t in stops]
    if not n or len(ends) < n:
        raise ConfigError("rollout.tools: the chat template ends no assistant turn with a stop token (the tokenizer's "
                          "EOS or the generation config's): the tools' turns cannot be placed after what the model "
                          "sampled")
    return after[ends[n - 1] + 1 :]


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


_CHECKED: dict[tuple[int, frozenset], None] = {}


def check_template(tokenizer, stops: set[int]) -> None:
    """Refuse (ConfigError, one line) a tokenizer whose chat template cannot hold a tool conversation: it must
    render a user -> assistant (tool call) -> tool exchange with every part in it (TRL's
    `supports_tool_calling` test), write tool calls in a format gspo can read (above) and end the assistant's
    turn with one of `stops` (the ids a model turn ends at), after which the tools' turn is placed (`tool_suffix`)."""
    key = (id(tokenizer), frozenset(stops))
    if key in _CHECKED:
        return
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("rollout.tools needs a chat template: this tokenizer has none")
    calls = [{"type": "function", "function": {"name": "tool_a8f3", "arguments": {"key_b9d4": "value_d6e7"}}}]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "name": "tool_a8f3", "content": "result_c4f9"}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as e:
        raise ConfigError(f"rollout.tools: the chat template cannot render a tool call and its result ({e})") from None
    missing = [s for s in ("tool_a8f3", "key_b9d4", "value_d6e7", "result_c4f9") if s not in text]
    if missing:
        raise ConfigError("rollout.tools: the chat template drops tool calls or tool messages (it does not render "
                          f"{', '.join(missing)}); use a checkpoint whose template supports tools")
    if getattr(tokenizer, "response_template", None) is None and "<tool_call>" not in text:
        raise ConfigError("rollout.tools: gspo cannot read this template's tool calls: it writes none as "
                          "<tool_call>{...}</tool_call> and the tokenizer declares no response_template "
                          "(transformers' parse_response); set tokenizer.response_template in the checkpoint")
    tool_suffix(tokenizer, messages[2:], stops)  # the tools' turn after what the model sampled: as at every call
    _CHECKED[key] = None


def render_reference(tokenizer, prompt_ids: list[int], prompt: list[dict], messages: list[dict],
                     stops: set[int]) -> tuple[list[int], list[int]]:
    """A reference conversation after a prompt, as the token ids a rollout that sampled it would hold, and its
    model mask (1: the model's tokens, to learn; 0: the prompt's and the tools'): the warm start's target.

    `prompt_ids`: the prompt rendered (tools and generation prompt included); `prompt`: its messages. Each
    assistant turn is the template's rendering of it, cut after its first stop token; tool messages are
    `tool_suffix`, exactly what a rollout appends."""
    ids, mask, history = list(prompt_ids), [0] * len(prompt_ids), list(prompt)
    i = 0
    while i < len(messages):
        m = messages[i]
        if m["role"] == "tool":
            j = i
            while j < len(messages) and messages[j]["role"] == "tool":
                j += 1
            suffix = tool_suffix(tokenizer, messages[i:j], stops)
            ids, mask, history, i = ids + suffix, mask + [0] * len(suffix), history + messages[i:j], j
            continue
        opened = _ids(tokenizer, tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False))
        full = _ids(tokenizer, tokenizer.apply_chat_template(history + [m], tokenize=False))
        turn = full[len(opened):]
        end = next((k for k, t in enumerate(turn) if t in stops), len(turn) - 1)
        turn = turn[: end + 1]
        ids, mask, history, i = ids + turn, mask + [1] * len(turn), history + [m], i + 1
    return ids, mask
