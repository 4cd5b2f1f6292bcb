"""Prompt templates: how a question becomes the text the policy continues.

"plain" is what the shipped base models were trained on: the question, then a
"Solution:" cue; the model writes its working and ends with an `Answer: X` line.
"chat" goes through the tokenizer's chat template: an optional system message
(`data.system_prompt`), then the question followed by an instruction
(`data.instruction`, by default: put the final answer in <answer>...</answer>).
"""

from __future__ import annotations

from typing import Any

PLAIN_TEMPLATE = "Question: {question}\nSolution:"

# No worked example in the instruction: a model that copies an example answer must not score with it.
CHAT_INSTRUCTION = "Solve the problem step by step. Put only the final answer in <answer></answer> tags."


def render_plain(question: str) -> str:
    return PLAIN_TEMPLATE.format(question=question)


def render_chat(question: str, tokenizer: Any, system_prompt: str | None = None,
                instruction: str | None = CHAT_INSTRUCTION, tools: list[dict] | None = None) -> str:
    """Through the tokenizer's chat template; `tools` (JSON schemas) are shown the way the template shows
    them (rollout.tool_format=chat)."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    user = f"{question}\n\n{instruction}" if instruction else question
    messages.append({"role": "user", "content": user})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **({"tools": tools} if tools else {}))


def render(question: str, template: str, tokenizer: Any = None, system_prompt: str | None = None,
           instruction: str | None = CHAT_INSTRUCTION, tools: list[dict] | None = None) -> str:
    """The prompt text for one question under the recipe's template ("plain" | "chat")."""
    if template == "plain":
        return render_plain(question)
    if tokenizer is None:
        raise ValueError("the chat template needs the model's tokenizer")
    return render_chat(question, tokenizer, system_prompt, instruction, tools)


def render_row(row: dict[str, Any], data: Any, tokenizer: Any = None, tools: list[dict] | None = None) -> str:
    """A dataset row's prompt under the recipe's `data` section (template, prompt column, system prompt),
    with the chat-format tools' schemas when there are any."""
    return render(row[data.prompt_column], data.template, tokenizer, data.system_prompt, data.instruction, tools)
