"""The chat call format, for hub chat models: the tools' JSON schemas go into the prompt through the
tokenizer's chat template (`tools=`), the model calls one in its native syntax,
`<tool_call>{"name": "calculator", "arguments": {"expression": "3*18"}}</tool_call>` (Qwen2.5 and Hermes
templates), and the result comes back through the template's `tool` role.

The reply is what the template writes between the end of the model's text and the start of its next
turn: for Qwen2.5, `<|im_end|>\n<|im_start|>user\n<tool_response>\n54.00\n</tool_response><|im_end|>\n
<|im_start|>assistant\n`. It is read off the template once (`ChatFormat.from_tokenizer`), by rendering a
conversation with markers where the model's text and the result go.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from grpo_cli.errors import UsageError
from grpo_cli.tools.tags import Call

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_MODEL_MARK, _RESULT_MARK = "\u2063MODEL\u2063", "\u2063RESULT\u2063"  # invisible separators no template writes


# Other families' native call syntax, as their templates show it: not parsed here (one call per turn in
# <tool_call> tags is). A template showing one of them, or none, is refused rather than run with zero calls.
_OTHER_SYNTAX = (("[TOOL_CALLS]", "Mistral's [TOOL_CALLS] list"),
                 ("<|python_tag|>", "Llama 3's bare JSON object {\"name\": ..., \"parameters\": ...}"))


def call_syntax_problem(template: str | None) -> str | None:
    """Why the chat format cannot read the calls of a model with this chat template (its source), or None: it
    must show the model the Hermes / Qwen2.5 `<tool_call>{...}</tool_call>` syntax, the one parsed."""
    if not template:
        return "the tokenizer has no chat template"
    if CALL_OPEN in template and CALL_CLOSE in template:
        return None
    shown = next((name for marker, name in _OTHER_SYNTAX if marker in template), None)
    return (f"its chat template shows the model {shown}" if shown else
            "its chat template never shows the model a <tool_call>...</tool_call> call") + \
        ", and only the Hermes / Qwen2.5 <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call> syntax is parsed"


def require_call_syntax(template: str | None) -> None:
    """Refuse, naming the key, a chat template whose calls the chat format cannot read (call_syntax_problem)."""
    if (why := call_syntax_problem(template)) is not None:
        raise UsageError(f"rollout.tool_format: chat cannot read this model's tool calls: {why}")


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


def _reply_parts(tokenizer: Any) -> tuple[str, str]:
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _MODEL_MARK},
                {"role": "tool", "content": _RESULT_MARK}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:
        raise UsageError(f"rollout.tool_format: chat needs a chat template with a tool role; this tokenizer's "
                         f"failed on one ({' '.join(str(e).split())[:200]})") from None
    if _MODEL_MARK not in text or _RESULT_MARK not in text:
        raise UsageError("rollout.tool_format: chat needs a chat template with a tool role; this tokenizer's "
                         "drops tool messages")
    return tuple(text[text.index(_MODEL_MARK) + len(_MODEL_MARK):].split(_RESULT_MARK, 1))  # type: ignore[return-value]


@dataclass(frozen=True)
class ChatFormat:
    names: dict[str, str]  # the name the model calls a tool by (its function's) -> the tool's recipe name
    reply_before: str  # the template's text between the model's call and a result
    reply_after: str  # and after the result, through the start of the model's next turn

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, names: dict[str, str]) -> ChatFormat:
        parts = _reply_parts(tokenizer)
        require_call_syntax(getattr(tokenizer, "chat_template", None))
        return cls(names, *parts)

    @property
    def stops(self) -> list[str]:
        return [CALL_CLOSE]

    def find_call(self, text: str) -> Call | None:
        """The call `text` ends with; a call the model wrote badly (not JSON, no such tool) is still a call,
        of a tool named "" whose argument says what was wrong, so the model reads an error and it counts."""
        if not text.endswith(CALL_CLOSE) or CALL_OPEN not in text:
            return None
        body = text[text.rindex(CALL_OPEN) + len(CALL_OPEN): -len(CALL_CLOSE)]
        try:
            call = json.loads(body)
            name, arguments = call["name"], call.get("arguments", {})
            if isinstance(arguments, str):  # some models write the arguments as a JSON string
                arguments = json.loads(arguments)
        except (ValueError, KeyError, TypeError, RecursionError):
            return Call("", "the call is not JSON of the form {\"name\": ..., \"arguments\": {...}}")
        if not isinstance(name, str):
            return Call("", "the call's name is not a string")
        if not isinstance(arguments, dict):
            return Call("", "the call's arguments are not a JSON object")
        if name not in self.names:
            return Call("", f"no tool is named {str(name)[:40]!r}; the tools are {', '.join(self.names)}")
        return Call(self.names[name], arguments)

    @property
    def around(self) -> tuple[str, str]:
        """The template's text before and after a result (its special tokens among it)."""
        return self.reply_before, self.reply_after

    def render(self, result: str) -> str:
        return f"{self.reply_before}{result}{self.reply_after}"
