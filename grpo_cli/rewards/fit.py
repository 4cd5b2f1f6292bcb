"""What a learned reward reads when a sample is too long for its model's context: the completion loses its
middle, never the question or the instructions around it (docs/rewards.md).

A policy is pushed toward whatever pays. Were the input cut at one end, a long completion would push the
question (a reward model's text, truncated on the left) or the judge's instructions out of view, or fail the
request (a judge server refuses a prompt past its context). So the completion's start and end stay, around a
marker saying how many tokens were cut, counted with the scoring model's own tokenizer. One rule for the
judge (rewards/judge.py, counted by its server) and the reward model (rewards/model.py, counted here).
"""

from __future__ import annotations

from collections.abc import Callable

CUT_SLACK_TOKENS = (4, 16, 64)  # tokens spared beyond the marker's for the re-tokenized seams, one try each


def cut_to_fit(fill: Callable[[str], str], over: Callable[[str], int], tokens: Callable[[str], list[int]],
               text_of: Callable[[list[int]], str], completion: str, marker: str) -> str | None:
    """`fill(completion)`, the whole input, when `over` (its tokens past the budget) is <= 0; else `fill` of the
    completion's first and last tokens around `marker` (a format with `{count}`, the tokens cut), as many as fit.
    None when even a completion of the marker alone would not fit. `tokens` and `text_of` are the model's
    tokenizer, without special tokens, and back."""
    text = fill(completion)
    excess = over(text)
    if excess <= 0:
        return text
    ids = tokens(completion)
    marker_tokens = len(tokens(marker.format(count=len(ids))))
    for slack in CUT_SLACK_TOKENS:
        keep = len(ids) - excess - marker_tokens - slack
        if keep <= 0:
            return None
        head, tail = text_of(ids[:keep // 2]), text_of(ids[len(ids) - (keep - keep // 2):])
        text = fill(head + marker.format(count=len(ids) - keep) + tail)
        if over(text) <= 0:
            return text
    return None
