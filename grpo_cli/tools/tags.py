"""The tag call format, for small plain-text models: the model writes `<calc>3*18</calc>`, the
environment answers `<result>54.00</result>`, the model writes on.

Each tool has its own pair of strings (`rollout.tools[i].open` / `.close`); the engine stops a turn
at any tool's close string. A turn is a call when its text, since the environment last spoke, holds
that tool's open string before the close string it stopped at; the argument is the text between.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class Call(NamedTuple):
    tool: str  # the tool's recipe name ("" for a call the model wrote badly: `argument` says what was wrong)
    argument: str | dict  # tags: the text between its open and close strings; chat: the JSON arguments


@dataclass(frozen=True)
class TagFormat:
    tags: tuple[tuple[str, str, str], ...]  # (tool name, open string, close string) per tool
    result_open: str = "<result>"  # before a tool's result text
    result_close: str = "</result>"  # after it

    @property
    def stops(self) -> list[str]:
        """The strings that end a model turn (each tool's close string)."""
        return sorted({close for _, _, close in self.tags})

    def find_call(self, text: str) -> Call | None:
        """The call `text` ends with (the model's text since the environment last spoke), or None when it
        does not end with a close string, or a close string without its open string before it."""
        ends = [(name, open_, close) for name, open_, close in self.tags if text.endswith(close)]
        for name, open_, close in ends:
            body = text[: len(text) - len(close)]
            start = body.rfind(open_)
            if start >= 0:
                return Call(name, body[start + len(open_):])
        return None

    def reply_parts(self, n: int = 1, model_end: str = "") -> tuple[str, str]:
        """The reply's own text before and after its one result (a tag turn makes one call)."""
        return self.result_open, self.result_close

    def encode(self, result: str) -> str:
        return result

    def render(self, result: str) -> str:
        """The environment's reply to a call: its result between the result strings."""
        return f"{self.result_open}{result}{self.result_close}"
