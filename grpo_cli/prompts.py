"""Prompt templates: how a question becomes the text the policy continues.

"plain" is what the shipped base model was trained on: the question, then a
"Solution:" cue; the model writes its working and ends with an `Answer: X` line.
"chat" goes through the tokenizer's chat template with an instruction to put the
final answer in <answer>...</answer>, for instruct models.
"""

from __future__ import annotations

from typing import Any

PLAIN_TEMPLATE = "Question: {question}\nSolution:"

CHAT_INSTRUCTION = (
    "Solve the problem step by step. Put only the final number in <answer></answer> tags, "
    "for example <answer>48.60</answer>."
)


def render_plain(question: str) -> str:
    return PLAIN_TEMPLATE.format(question=question)


def render_chat(question: str, tokenizer: Any) -> str:
    messages = [{"role": "user", "content": f"{question}\n\n{CHAT_INSTRUCTION}"}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def render(question: str, template: str, tokenizer: Any = None) -> str:
    """The prompt text for one question under the recipe's template ("plain" | "chat")."""
    if template == "plain":
        return render_plain(question)
    if tokenizer is None:
        raise ValueError("the chat template needs the model's tokenizer")
    return render_chat(question, tokenizer)
