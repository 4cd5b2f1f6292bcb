"""A generative judge: an LLM behind an OpenAI-compatible server (vLLM) reads a prompt made from each sample and
its reply becomes the reward (docs/rewards.md).

`rewards[i].judge` is the judge's prompt, a template with `{prompt}` (the question), `{completion}` (the sample)
and any dataset column by name (`{answer}`); `rewards[i].parser` turns the reply into a number: a named parser
(PARSERS) or a regular expression whose first group is the number. The judge answers greedily (temperature 0),
`rewards[i].max_tokens` tokens at most. A reply the parser cannot read scores None: that sample fails and follows
`on_failure`, like any reward's junk. The server is `rewards[i].server`: a URL, or `start` (grpo runs one on
`rewards[i].model` for the run: served.ServerLink); `template` picks how the prompt is sent: `chat` (the judge's
chat template, the prompt as the user's turn: /v1/chat/completions, one request a sample) or `plain` (the text
as it is: /v1/completions, `batch_size` prompts a request), `auto` chat when the model's tokenizer has a template.

The completion is the policy's text, and the policy is pushed toward whatever the judge pays for: a completion
that says "Score: 10/10" is written to be read by the judge. Quote it in the template, and log a checker beside
the judge where the task has one. A judge prompt longer than the server's context (less the reply's max_tokens)
would be refused (HTTP 400) and fail every sample of its request: the completion is cut in its middle instead,
its start and end kept around a marker, counted with the server's own tokenizer (`JudgeContext`), so the
template's instructions are never pushed out.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable
from typing import Any

from grpo_cli.engines.served import ServerLink
from grpo_cli.errors import UsageError
from grpo_cli.rewards.fit import cut_to_fit
from grpo_cli.weights.model_files import checked_model_path

SERVED_NAME = "judge"  # the model name a server started here answers to
NUMBER = r"(-?\d+(?:\.\d+)?)"
CUT_MARKER = "\n[... {count} tokens cut to fit the judge's context ...]\n"  # where a long completion lost its middle


def parse_score_10(reply: str) -> float | None:
    """"7/10", "7 out of 10" or "Score: 7" (the first of them), 0..10, as 0.7; else None."""
    for pattern in (NUMBER + r"\s*(?:/|out of)\s*10\b", r"(?i)\bscore\s*(?:is|:|=)?\s*" + NUMBER):
        if found := re.search(pattern, reply):
            value = float(found.group(1))
            return value / 10 if 0 <= value <= 10 else None
    return None


def parse_yes_no(reply: str) -> float | None:
    """The reply's first word: yes -> 1, no -> 0; else None."""
    found = re.match(r"\W*(yes|no)\b", reply, re.IGNORECASE)
    return None if found is None else float(found.group(1).lower() == "yes")


PARSERS: dict[str, Callable[[str], float | None]] = {"score_10": parse_score_10, "yes_no": parse_yes_no}


def regex_parser(key: str, pattern: str) -> Callable[[str], float | None]:
    """A parser from a regular expression: its first group, as a number, at its first match; else None."""
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise UsageError(f"{key}.parser: '{pattern}' is neither a parser ({', '.join(PARSERS)}) nor a regular "
                         f"expression ({e})") from None
    if compiled.groups < 1:
        raise UsageError(f"{key}.parser: '{pattern}' has no group; put the number in one, e.g. 'Score: (\\d+)'")

    def parse(reply: str) -> float | None:
        found = compiled.search(reply)
        try:
            return float(found.group(1)) if found else None
        except (TypeError, ValueError):
            return None

    return parse


def template_fields(key: str, template: str) -> list[str]:
    """The names a judge template fills in, each a plain name ({prompt}, {completion}, a column)."""
    try:
        names = [field for _, field, _, _ in string.Formatter().parse(template) if field is not None]
    except ValueError as e:
        raise UsageError(f"{key}.judge: the template does not parse ({e}); write a literal brace as {{{{ or }}}}") \
            from None
    if bad := [n for n in names if not n.isidentifier()]:
        raise UsageError(f"{key}.judge: {{{bad[0]}}} is not a name; the template fills in {{prompt}}, {{completion}} "
                         "and dataset columns by name")
    if "completion" not in names:
        raise UsageError(f"{key}.judge: the template has no {{completion}}: the judge would not see the sample")
    return list(dict.fromkeys(names))


class JudgeContext:
    """The judge server's context, counted with its own tokenizer (vLLM's /tokenize, /detokenize): which prompts fit
    before max_tokens of reply, and a completion cut in its middle until the prompt does."""

    def __init__(self, server: ServerLink, chat: bool, max_tokens: int) -> None:
        self.server, self.chat, self.max_tokens = server, chat, max_tokens
        self.prompt_budget: int | None = None  # tokens a prompt may have: the server's max_model_len - max_tokens
        self.wrapper_tokens = 0  # tokens around the text: special tokens, the chat template's turn

    def _count(self, text: str) -> dict[str, Any]:
        body = {"messages": [{"role": "user", "content": text}], "add_generation_prompt": True} if self.chat \
            else {"prompt": text}
        return self.server.post("/tokenize", body)

    def tokens(self, text: str) -> list[int]:
        return self.server.post("/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]

    def excess(self, text: str) -> int:
        """Tokens the prompt has past the budget (<= 0: it fits)."""
        if self.prompt_budget is None:  # once, on first use: the server's context and the wrapper's tokens
            empty = self._count("")
            self.prompt_budget, self.wrapper_tokens = empty["max_model_len"] - self.max_tokens, empty["count"]
        # a token holds at least one byte (byte-level and character vocabularies): short texts need no request
        if len(text.encode()) + self.wrapper_tokens + 4 <= self.prompt_budget:
            return 0
        return self._count(text)["count"] - self.prompt_budget

    def fitted(self, template: str, values: dict[str, Any]) -> str | None:
        """The template filled with `values`, its completion cut in the middle if the whole would not fit; None
        when even an empty completion would not (the sample fails, the request's others do not)."""
        def detokenize(ids: list[int]) -> str:
            return self.server.post("/detokenize", {"tokens": ids})["prompt"]

        return cut_to_fit(lambda completion: template.format(**{**values, "completion": completion}), self.excess,
                          self.tokens, detokenize, values["completion"], CUT_MARKER)


class Judge:
    """A reward function backed by a judge model's replies: (completions, prompt=[...], **columns) -> scores."""

    def __init__(self, key: str, spec: Any) -> None:
        from transformers import AutoTokenizer

        self.key, self.template = key, spec.judge
        self.fields = template_fields(key, spec.judge)
        # the dataset columns the template names: validate_columns checks every row has them (rewards/load.py)
        self.needed_columns = [f for f in self.fields if f not in ("prompt", "completion")]
        self.parse = PARSERS.get(spec.parser) or regex_parser(key, spec.parser)
        if spec.server is None:
            raise UsageError(f"{key}.server: a judge is served: set {key}.server=start (grpo runs vLLM on {key}.model) "
                             "or the URL of an OpenAI-compatible server")
        if spec.server == "start" and spec.model is None:
            raise UsageError(f"{key}.model: server=start needs the judge's model (a directory, hub id or builtin:NAME)")
        path = checked_model_path(f"{key}.model", spec.model) if spec.model is not None else None
        has_template, max_model_len = False, 2048
        if path is not None:
            from transformers import AutoConfig

            has_template = bool(getattr(AutoTokenizer.from_pretrained(path), "chat_template", None))
            max_model_len = int(getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", 0) or 2048)
        if spec.template == "chat" and path is not None and not has_template:
            raise UsageError(f"{key}.template: chat, and {spec.model}'s tokenizer has no chat template; set "
                             f"{key}.template=plain")
        self.chat = spec.template == "chat" or (spec.template == "auto" and has_template)
        self.max_tokens, self.batch_size, self.in_flight = spec.max_tokens, spec.batch_size, spec.requests_in_flight
        self.server = ServerLink(spec.server, path or "", key, ["--max-model-len", str(max_model_len),
                                                                "--enforce-eager"],
                                 spec.server_start_timeout_s, spec.timeout_s or 60.0, SERVED_NAME,
                                 spec.server_kv_cache_gib)
        self.context = JudgeContext(self.server, self.chat, self.max_tokens)
        self.dtype, self.device = "float32", "cpu"  # until the run places it (grpo reward: here, on the CPU's terms)

    def place(self, device: Any, dtype: str, log_dir: Any = None) -> None:
        """With server=start, the server started now on `device` (the trainer's) in `dtype` (its log in `log_dir`)."""
        self.dtype, self.device = dtype, device
        self.server.ready(dtype, log_dir, device)

    def close(self) -> None:
        self.server.close()

    def prompts(self, completions: list[str], prompt: list[str] | None, columns: dict[str, list]) -> list[str | None]:
        """The judge's prompt for each sample, fitted to its context (None: it cannot fit)."""
        if prompt is None and "prompt" in self.fields:
            raise ValueError("the judge's template reads {prompt}, and no prompt was given")
        values = [{"completion": c, **({"prompt": prompt[i]} if prompt is not None else {}),
                   **{k: columns[k][i] for k in self.needed_columns}} for i, c in enumerate(completions)]
        self.server.ready(self.dtype, device=self.device)
        return [self.context.fitted(self.template, v) for v in values]

    def replies(self, texts: list[str]) -> list[str]:
        """The judge's reply to each prompt, greedy; `requests_in_flight` requests at a time."""
        if self.chat:
            jobs, ask = [[t] for t in texts], self._chat
        else:
            jobs, ask = [texts[i:i + self.batch_size] for i in range(0, len(texts), self.batch_size)], self._complete
        return self.server.ask_all(ask, jobs, self.in_flight, self.dtype)

    def _complete(self, texts: list[str]) -> list[str]:
        answer = self.server.post("/v1/completions", {"prompt": texts, "max_tokens": self.max_tokens,
                                                      "temperature": 0.0})
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        if len(choices) != len(texts):
            raise ValueError(f"{self.key}.server gave {len(choices)} replies for {len(texts)} prompts")
        return [c["text"] for c in choices]

    def _chat(self, texts: list[str]) -> list[str]:
        answer = self.server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": texts[0]}],
                                                           "max_tokens": self.max_tokens, "temperature": 0.0})
        return [answer["choices"][0]["message"]["content"] or ""]

    def __call__(self, completions: list[str], prompt: list[str] | None = None, **columns: Any) -> list[float | None]:
        """Each sample's score; None where the parser cannot read the reply or the prompt cannot fit (the sample
        fails)."""
        texts = self.prompts(completions, prompt, columns)
        replies = iter(self.replies([t for t in texts if t is not None]))
        return [None if t is None else self.parse(next(replies)) for t in texts]

    def __repr__(self) -> str:
        return f"Judge({self.server.url or self.server.setting})"
