"""Prompt templates: how a question becomes the text the policy continues.

"plain" is what the shipped base models were trained on: the question, then a
"Solution:" cue; the model writes its working and ends with an `Answer: X` line.
"chat" goes through the tokenizer's chat template: an optional system message
(`data.system_prompt`), then the question followed by an instruction
(`data.instruction`, by default: put the final answer in <answer>...</answer>).

A row's prompt is either text (the question) or a conversation: a list of chat messages, each
`{"role": "system" | "user" | "assistant", "content": text}`, ending with the user's turn (TRL's
"conversational" format). A conversation is rendered as it is through the chat template: it carries its own
system message and instruction, so `data.system_prompt` and `data.instruction` are not added to it.
"""

from __future__ import annotations

import json
from typing import Any

from grpo_cli.config import CHAT_INSTRUCTION
from grpo_cli.prompts.images import row_images

PLAIN_TEMPLATE = "Question: {question}\nSolution:"


MESSAGE_ROLES = ("system", "user", "assistant")


def is_conversation(prompt: Any) -> bool:
    """A prompt given as chat messages (a list), not as text."""
    return isinstance(prompt, list)


def conversation_problem(messages: list) -> str | None:
    """What is wrong with a conversation prompt, or None: each message a {role, content} with a known role and
    text content, and the last one the user's (the policy answers it)."""
    if not messages:
        return "an empty list of messages"
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) - {"role", "content"} or "role" not in message:
            return f"message {i} is not a {{role, content}} object"
        if message["role"] not in MESSAGE_ROLES:
            return f"message {i} has role {message['role']!r} (roles: {', '.join(MESSAGE_ROLES)})"
        if not isinstance(message.get("content"), str) or not message["content"].strip():
            return f"message {i}'s content is not text or is empty"
    if messages[-1]["role"] != "user":
        return f"the last message is the {messages[-1]['role']}'s; a prompt ends with the user's turn"
    return None


def question_text(prompt: Any) -> Any:
    """The question a completion answers, as text: a text prompt itself, a conversation's last user turn (what
    rewards receive as `prompt`, a judge as {prompt}, a reward model as the user's turn)."""
    return prompt[-1]["content"] if is_conversation(prompt) else prompt


def prompt_key(prompt: Any) -> Any:
    """A hashable stand-in for a prompt (a conversation is a list), to compare prompts across splits."""
    return json.dumps(prompt, sort_keys=True) if is_conversation(prompt) else prompt


def render_plain(question: str) -> str:
    return PLAIN_TEMPLATE.format(question=question)


def render_chat(question: str, tokenizer: Any, system_prompt: str | None = None,
                instruction: str | None = CHAT_INSTRUCTION, tools: list[dict] | None = None) -> str:
    """Through the tokenizer's chat template; `tools` (JSON schemas) are shown the way the template shows
    them (rollout.tool_format=chat)."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    user = f"{question}\n\n{instruction}" if instruction else question
    messages.append({"role": "user", "content": user})
    return render_conversation(messages, tokenizer, tools)


def render_conversation(messages: list[dict[str, str]], tokenizer: Any, tools: list[dict] | None = None) -> str:
    """A conversation prompt through the tokenizer's chat template, as it is (its own system message and
    instruction), with the chat-format tools' schemas when there are any."""
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


def render_row(row: dict[str, Any], data: Any, tokenizer: Any = None, tools: list[dict] | None = None,
               vision: Any = None) -> str:
    """A dataset row's prompt under the recipe's `data` section (template, prompt column, system prompt),
    with the chat-format tools' schemas when there are any. A conversation needs the chat template (the data
    check refuses it under the plain one). A row with images (data.image_column, read by prompts.images) puts
    one `vision.image_token` per image before the question: under the plain template ahead of it, under the chat
    template as the user turn's first parts, where the processor's chat template places them."""
    prompt = row[data.prompt_column]
    if images := row_images(row, data.image_column):
        if vision is None:
            raise ValueError("a row with images needs a vision-language model's processor")
        if data.template == "plain":
            return vision.image_token * len(images) + render_plain(prompt)
        return render_image_chat(prompt, len(images), vision.processor, data.system_prompt, data.instruction)
    if is_conversation(prompt):
        return render_conversation(prompt, tokenizer, tools)
    return render(prompt, data.template, tokenizer, data.system_prompt, data.instruction, tools)


def render_image_chat(question: str, num_images: int, processor: Any, system_prompt: str | None = None,
                      instruction: str | None = CHAT_INSTRUCTION) -> str:
    """A question with its images through the processor's chat template: the images, then the text, in the
    user's turn."""
    user = f"{question}\n\n{instruction}" if instruction else question
    messages = [{"role": "system", "content": [{"type": "text", "text": system_prompt}]}] if system_prompt else []
    messages.append({"role": "user", "content": [{"type": "image"}] * num_images + [{"type": "text", "text": user}]})
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
