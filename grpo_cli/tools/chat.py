"""The chat call format, for hub chat models: the tools' JSON schemas go into the prompt through the
tokenizer's chat template (`tools=`), the model calls them in its family's native syntax, and the results
come back through the template's `tool` role.

A chat turn is the model's whole message: it ends where the model ends its turn (its end-of-sequence
token), and every call in it is read by the family's parser (`CALL_SYNTAXES`, `rollout.tool_call_syntax`;
`auto` picks the syntax the chat template shows the model):

    hermes        Hermes / Qwen2.5 / Qwen3: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one block a call
    llama3_json   Llama 3.1-3.3: the message is a JSON object {"name": ..., "parameters": {...}}, after an optional
                  <|python_tag|>; several are separated by ";"
    mistral       Mistral: [TOOL_CALLS] and a JSON list [{"name": ..., "arguments": {...}}, ...], or (newer
                  tokenizers) [TOOL_CALLS]name[ARGS]{...} per call

The calls of a turn run one after another, in the order written (an environment's methods change its state),
and their results come back together, in one reply: what the template writes between the end of the model's
message and the start of its next turn. It is read off the template once per number of results
(`ChatFormat.from_tokenizer`), by rendering a conversation with markers where the model's text and each
result go. For Qwen2.5 and one result: `<|im_end|>\n<|im_start|>user\n<tool_response>\nRESULT\n</tool_response>
<|im_end|>\n<|im_start|>assistant\n`, its `<|im_end|>` being the model's own last token. A template that
writes a result as a JSON string (Llama 3's and Mistral's do) gets it JSON-escaped there.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grpo_cli.errors import UsageError
from grpo_cli.tools.tags import Call

_MODEL_MARK = "@@grpo-model-7f3a@@"  # where the model's text goes; no template writes it
_RESULT_MARK = '@@grpo-result-{}"7f3a@@'  # where result i goes: its quote shows whether the template JSON-escapes it
PYTHON_TAG, MISTRAL_CALLS, MISTRAL_ARGS = "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]"


# --------------------------------------------------------------------------------------------- the parsers


def _call_of(call: Any, names: dict[str, str], form: str) -> Call:
    """One parsed call as a Call; a call the model wrote badly (no name, no such tool, arguments that are not a
    JSON object) is still a call, of a tool named "" whose argument says what was wrong, so the model reads an
    error and it counts."""
    if not isinstance(call, dict) or "name" not in call:
        return Call("", f"the call is not JSON of the form {form}")
    name = call["name"]
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return Call("", "the call's arguments are not JSON")
    if not isinstance(name, str):
        return Call("", "the call's name is not a string")
    if not isinstance(arguments, dict):
        return Call("", "the call's arguments are not a JSON object")
    if name not in names:
        return Call("", f"no tool is named {name[:40]!r}; the tools are {', '.join(names)}")
    return Call(names[name], arguments)


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: "[" * 100000
        return None


def hermes_calls(text: str, names: dict[str, str]) -> list[Call]:
    """Every <tool_call>JSON</tool_call> of the turn, in order; an unclosed last one is a call written badly."""
    form = '{"name": ..., "arguments": {...}} between <tool_call> and </tool_call>'
    calls = []
    for match in re.finditer(r"<tool_call>(.*?)(</tool_call>|$)", text, re.S):
        closed = bool(match.group(2))
        calls.append(_call_of(_json(match.group(1)), names, form) if closed else
                     Call("", "a <tool_call> without its </tool_call>"))
    return calls


def llama3_json_calls(text: str, names: dict[str, str]) -> list[Call]:
    """A message that is a JSON object (after an optional <|python_tag|>) is a call; several are separated by
    ";". A message that does not open with "{" is the model's answer, no call; text after the calls is ignored."""
    body = text.strip().removeprefix(PYTHON_TAG).lstrip()
    form = '{"name": ..., "parameters": {...}}'
    calls, decoder, at = [], json.JSONDecoder(), 0
    while at < len(body) and body[at] == "{":
        try:
            call, at = decoder.raw_decode(body, at)
        except (ValueError, RecursionError):
            calls.append(Call("", f"the call is not JSON of the form {form}"))
            break
        calls.append(_call_of(call, names, form))
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return calls


def mistral_calls(text: str, names: dict[str, str]) -> list[Call]:
    """After [TOOL_CALLS]: a JSON list of calls, or (newer tokenizers) name[ARGS]{...} after each [TOOL_CALLS]."""
    if MISTRAL_CALLS not in text:
        return []
    pieces = [p.strip() for p in text.split(MISTRAL_CALLS)[1:]]
    form = '[{"name": ..., "arguments": {...}}] after [TOOL_CALLS]'
    calls: list[Call] = []
    for piece in pieces:
        if piece.startswith("["):
            try:
                listed, _ = json.JSONDecoder().raw_decode(piece)
            except (ValueError, RecursionError):
                calls.append(Call("", f"the calls are not JSON of the form {form}"))
                continue
            calls += [_call_of(c, names, form) for c in listed] if isinstance(listed, list) else \
                [Call("", f"the calls are not JSON of the form {form}")]
        elif MISTRAL_ARGS in piece:
            name, arguments = piece.split(MISTRAL_ARGS, 1)
            try:
                parsed, _ = json.JSONDecoder().raw_decode(arguments.strip())
            except (ValueError, RecursionError):
                calls.append(Call("", "the call's arguments after [ARGS] are not JSON"))
                continue
            calls.append(_call_of({"name": name.strip(), "arguments": parsed}, names, form))
        else:
            calls.append(Call("", f"the call is not of the form {form}, or name[ARGS]{{...}}"))
    return calls


CALL_FORMS = {"hermes": '<tool_call>{"name": ..., "arguments": {...}}</tool_call>',
              "llama3_json": '{"name": ..., "parameters": {...}}',
              "mistral": '[TOOL_CALLS][{"name": ..., "arguments": {...}}]'}  # each syntax as grpo check shows it
CALL_SYNTAXES: dict[str, Callable[[str, dict[str, str]], list[Call]]] = {
    "hermes": hermes_calls, "llama3_json": llama3_json_calls, "mistral": mistral_calls}

# What a template shows the model of each syntax (its instructions, or its rendering of past calls): `auto`
# takes the first syntax whose markers all appear in the template's source.
_SHOWN = (("hermes", ("<tool_call>", "</tool_call>")), ("mistral", (MISTRAL_CALLS,)), ("llama3_json", (PYTHON_TAG,)),
          ("llama3_json", ('"parameters"', "<|eot_id|>")))


def call_syntax_problem(template: str | None) -> str | None:
    """Why `auto` cannot tell the call syntax of a model with this chat template (its source), or None."""
    if not template:
        return "the tokenizer has no chat template"
    if shown_syntax(template) is not None:
        return None
    return ("its chat template shows the model none of the call syntaxes parsed (hermes <tool_call>{...}</tool_call>, "
            "llama3_json {\"name\": ..., \"parameters\": ...}, mistral [TOOL_CALLS]); set rollout.tool_call_syntax "
            "to the one the model was trained on")


def shown_syntax(template: str) -> str | None:
    return next((name for name, markers in _SHOWN if all(m in template for m in markers)), None)


def call_syntax(template: str | None, chosen: str) -> str:
    """The call syntax the chat format parses: `chosen` (rollout.tool_call_syntax), or with `auto` the one the
    template shows; a template that shows none is refused, naming the key."""
    if chosen != "auto":
        return chosen
    if (why := call_syntax_problem(template)) is not None:
        raise UsageError(f"rollout.tool_format: chat cannot read this model's tool calls: {why}")
    return shown_syntax(template)  # type: ignore[arg-type, return-value]


def template_source(tokenizer_dir: Any) -> str | None:
    """A local tokenizer's chat template as text, read off its files (no tokenizer loaded): tokenizer_config.json's
    `chat_template` (text, or the named templates' texts together) or chat_template.jinja."""
    from pathlib import Path

    folder = Path(tokenizer_dir)
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    try:
        template = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError):
        return None
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        return "\n".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    return template if isinstance(template, str) else None


def tool_schema(fn: Any, where: str) -> dict[str, Any]:
    """The JSON schema a chat template shows the model, from the function's type hints and docstring."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # DocstringParsingException, TypeHintParsingException
        raise UsageError(f"{where}: the chat format shows a tool to the model as a JSON schema read off its type "
                         f"hints and its docstring's Args section; this one cannot be ({' '.join(str(e).split())})"
                         ) from None


# ----------------------------------------------------------------------------------------------- the reply


def call_id(i: int) -> str:
    """The id of a turn's call i in its tool message (Mistral's templates require 9 letters and digits)."""
    return f"call{i:05d}"


def _reply_parts(tokenizer: Any, n: int) -> tuple[tuple[str, ...], bool]:
    """The template's text around n results after the model's message: n + 1 strings, and whether it writes
    each result as a JSON string (then the result goes in JSON-escaped)."""
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _MODEL_MARK}]
    messages += [{"role": "tool", "content": _RESULT_MARK.format(i), "tool_call_id": call_id(i), "name": "tool"}
                 for i in range(n)]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:
        raise UsageError(f"rollout.tool_format: chat needs a chat template with a tool role; this tokenizer's "
                         f"failed on one ({' '.join(str(e).split())[:200]})") from None
    if _MODEL_MARK not in text:
        raise UsageError("rollout.tool_format: chat needs a chat template with a tool role; this tokenizer's "
                         "drops the assistant's message")
    text = text[text.index(_MODEL_MARK) + len(_MODEL_MARK):]
    marks = [_RESULT_MARK.format(i) for i in range(n)]
    escaped = [json.dumps(m)[1:-1] for m in marks]
    quoted = all(e in text for e in escaped)
    parts = []
    for mark in escaped if quoted else marks:  # a quoted result's quotes stay in the template's strings
        if mark not in text:
            raise UsageError("rollout.tool_format: chat needs a chat template with a tool role; this tokenizer's "
                             "drops tool messages")
        before, text = text.split(mark, 1)
        parts.append(before)
    parts.append(text)
    return tuple(parts), quoted


@dataclass(frozen=True)
class ChatFormat:
    names: dict[str, str]  # the name the model calls a tool by (its function's) -> the tool's recipe name
    syntax: str  # the call syntax parsed (CALL_SYNTAXES)
    replies: tuple[tuple[str, ...], ...]  # [n - 1]: the template's n + 1 strings around n results
    quoted: bool  # the template writes a result as a JSON string: it goes in JSON-escaped

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, names: dict[str, str], syntax: str = "auto",
                       max_calls: int = 1) -> ChatFormat:
        """The format of this tokenizer's template, for turns of up to `max_calls` calls."""
        read = [_reply_parts(tokenizer, n) for n in range(1, max_calls + 1)]
        chosen = call_syntax(getattr(tokenizer, "chat_template", None), syntax)
        return cls(names, chosen, tuple(parts for parts, _ in read), read[0][1])

    @property
    def stops(self) -> list[str]:
        return []  # a chat turn ends where the model ends its message

    def find_calls(self, text: str) -> list[Call]:
        """Every call of a finished turn (its text with special tokens), in order; [] when it has none."""
        return CALL_SYNTAXES[self.syntax](text, self.names)

    def reply_parts(self, n: int, model_end: str = "") -> tuple[str, ...]:
        """The template's text around n results; `model_end`, the model's own end-of-turn token, is not written
        again where the template opens the reply with it."""
        parts = self.replies[n - 1]
        return (parts[0].removeprefix(model_end), *parts[1:]) if model_end else parts

    def encode(self, result: str) -> str:
        """A result as it goes between the template's strings."""
        return json.dumps(result, ensure_ascii=False)[1:-1] if self.quoted else result
