"""Learned rewards (grpo_cli/rewards/model.py): a sequence classifier as one more weighted reward, its checks
before any model loads, and its scores against transformers' own forward pass."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_cli.config import ConfigError, RewardSpec, TrainConfig, check_reward_spec
from grpo_cli.errors import UsageError
from grpo_cli.rewards import RewardFailures, SampleContext, load_rewards, score
from grpo_cli.rewards.model import RewardModel
from grpo_cli.weights.model_files import resolve_model_path

PROMPTS = ["A bike costs $12 an hour. What do 3 hours cost?", "What is 2 + 2?", "Price of a day?"]
COMPLETIONS = ["3 x 12 = 36\nAnswer: $36", "Answer: 5", "It depends."]


def classifier(tmp_path, labels: list[str] | None = None, seed: int = 0) -> str:
    """A sequence classifier on the shipped bike model's backbone (a fresh head of len(labels) logits), saved."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    base = resolve_model_path("builtin:bike_base")
    labels = labels or ["LABEL_0"]
    config = AutoConfig.from_pretrained(base, num_labels=len(labels), id2label=dict(enumerate(labels)),
                                        label2id={name: i for i, name in enumerate(labels)})
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(base, config=config)
    out = tmp_path / f"rm_{len(labels)}_{seed}"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return str(out)


def reference_logits(path: str, texts: list[str], index: int = 0) -> list[float]:
    """transformers' own forward pass, one text at a time (no padding): the numbers a batch must give."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        return [float(model(**tokenizer(t, return_tensors="pt")).logits[0, index]) for t in texts]


def test_a_reward_model_scores_prompt_and_completion_as_transformers_does_in_batches(tmp_path):
    path = classifier(tmp_path)
    (rm,) = load_rewards([RewardSpec(name="rm", model=path, batch_size=2)])
    assert isinstance(rm.fn, RewardModel) and rm.worker is None and rm.timeout_s is None  # in this process
    texts = [f"{p}\n{c}" for p, c in zip(PROMPTS, COMPLETIONS)]  # template auto: no chat template -> plain
    want = reference_logits(path, texts)
    got = rm.fn(COMPLETIONS, prompt=PROMPTS)  # padded batches of 2 and 1
    assert got == pytest.approx(want, abs=1e-5) and len(set(got)) == 3
    (squashed,) = load_rewards([RewardSpec(name="rm", model=path, transform="sigmoid", clip=0.5)])
    assert squashed.fn(COMPLETIONS, prompt=PROMPTS) == pytest.approx(
        [min(1 / (1 + math.exp(-x)), 0.5) for x in want], abs=1e-6)


def test_a_reward_model_mixes_with_functions_by_weight_and_fails_without_a_prompt(tmp_path):
    path = classifier(tmp_path)
    rewards = load_rewards([RewardSpec(name="correct", weight=0.0, correctness=True),
                            RewardSpec(name="reward_model", model=path, weight=2.0)])
    columns = {"answer": ["36", "4", "240"]}
    scored = score(rewards, COMPLETIONS, columns, "answer_line", context=SampleContext(prompts=PROMPTS))
    logits = rewards[1].fn(COMPLETIONS, prompt=PROMPTS)
    assert scored.per_function["correct"] == [1.0, 0.0, 0.0]
    assert scored.total == pytest.approx([2.0 * x for x in logits])  # the gold reward logged, weighed 0
    failures = RewardFailures()
    blind = score(rewards, COMPLETIONS, columns, "answer_line", failures)  # no prompts known
    assert failures.counts["reward_model"] == 3 and blind.per_function["reward_model"] == [0.0] * 3
    assert "no prompt was given" in failures.last_error["reward_model"]


def test_a_reward_model_picks_a_named_label_and_refuses_what_it_cannot_score(tmp_path):
    three = classifier(tmp_path, ["bad", "ok", "good"])
    (good,) = load_rewards([RewardSpec(name="rm", model=three, label="good")])
    texts = [f"{p}\n{c}" for p, c in zip(PROMPTS, COMPLETIONS)]
    assert good.fn(COMPLETIONS, prompt=PROMPTS) == pytest.approx(reference_logits(three, texts, 2), abs=1e-5)
    refused = {
        "rewards[0].label: the reward model has 3 labels (bad, ok, good); choose the one whose logit is the reward":
            RewardSpec(name="rm", model=three),
        "rewards[0].label: 'great' is not one of the reward model's labels (bad, ok, good)":
            RewardSpec(name="rm", model=three, label="great"),
        "rewards[0].model: builtin:bike_base is not a sequence classifier (Qwen2ForCausalLM)":
            RewardSpec(name="rm", model="builtin:bike_base"),
        f"rewards[0].model: model '{tmp_path / 'none'}' does not exist":
            RewardSpec(name="rm", model=str(tmp_path / "none")),
        "rewards[0].template: chat, and": RewardSpec(name="rm", model=three, label="ok", template="chat"),
        "rewards[0].server: http://127.0.0.1:9 does not answer as a vLLM server (URLError":
            RewardSpec(name="rm", model=three, label="ok", server="http://127.0.0.1:9"),
    }
    for message, spec in refused.items():
        with pytest.raises(UsageError) as err:
            load_rewards([spec])
        assert str(err.value).startswith(message), str(err.value)


def test_a_reward_model_s_settings_are_checked_with_their_key():
    spec = RewardSpec(model="some/rm")
    check_reward_spec(spec, "rewards[0]")
    assert spec.name == "reward_model"  # the metric's name when none is given
    refused = {
        "rewards[1].name: missing": RewardSpec(),
        "rewards[1].label: is a learned reward's setting; this reward is the function 'correct'":
            RewardSpec(name="correct", label="good"),
        "rewards[1].transform: 'exp' is not one of raw, sigmoid": RewardSpec(model="x", transform="exp"),
        "rewards[1].template: 'html' is not one of auto, chat, plain": RewardSpec(model="x", template="html"),
        "rewards[1].clip: 0.0 must be > 0": RewardSpec(model="x", clip=0.0),
        "rewards[1].batch_size: must be >= 1": RewardSpec(model="x", batch_size=0),
        "rewards[1].server: 'localhost:8000' is not start or an http(s):// URL": RewardSpec(model="x", server="localhost:8000"),
        "rewards[1].server: is a learned reward's setting": RewardSpec(name="format", server="start"),
    }
    for message, bad in refused.items():
        with pytest.raises(ConfigError) as err:
            TrainConfig(task="t", rewards=[RewardSpec(name="correct", correctness=True), bad])
        assert str(err.value).startswith(message), str(err.value)


def test_a_placed_reward_model_loads_in_the_run_s_dtype_once(tmp_path):
    path = classifier(tmp_path)
    (rm,) = load_rewards([RewardSpec(name="rm", model=path)])
    assert rm.fn.model is None  # nothing loads with the recipe's rewards
    rm.fn.place("cpu", "bfloat16")
    loaded = rm.fn.model
    assert next(loaded.parameters()).dtype == torch.bfloat16 and not any(p.requires_grad for p in loaded.parameters())
    rm.fn(COMPLETIONS[:1], prompt=PROMPTS[:1])
    assert rm.fn.model is loaded


def test_a_reward_model_input_past_its_context_loses_the_middle_of_its_completion_not_the_question(tmp_path):
    """A completion that would push the question out of the model's 512 tokens (the tokenizer truncates on the
    left) is cut in its middle instead, counted with the model's tokenizer; a short one is read whole; a question
    too long by itself keeps the text's end, as before."""
    from grpo_cli.rewards.model import render_plain

    path = classifier(tmp_path)
    (rm,) = load_rewards([RewardSpec(name="rm", model=path)])
    question, long = PROMPTS[0], "city bike: 2 x 9 = 18.00\n" * 80 + "Answer: 18.00"
    cut, whole = rm.fn.texts([long, COMPLETIONS[0]], [question, question])
    assert whole == render_plain(question, COMPLETIONS[0], None)
    assert cut.startswith(question + "\ncity bike: 2 x 9 = 18.00\n") and cut.endswith("\nAnswer: 18.00")
    assert " tokens cut to fit the reward model's context ...]\n" in cut
    tokens = len(rm.fn.tokenizer(cut)["input_ids"])
    assert rm.fn.max_tokens - 80 <= tokens <= rm.fn.max_tokens < len(rm.fn.tokenizer(render_plain(question, long, None))["input_ids"])
    assert rm.fn([long], prompt=[question]) == pytest.approx(reference_logits(path, [cut]), abs=1e-5)
    huge = "Price? " * 600
    assert rm.fn.texts(["Answer: 1"], [huge]) == [render_plain(huge, "Answer: 1", None)]


class Ranks:
    """What place_reward_models asks of the job's Dist: rank `rank` of 2, rank 0's broadcast recorded."""

    def __init__(self, rank: int, sent: list) -> None:
        self.rank, self.world_size, self.sent = rank, 2, sent

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def broadcast(self, obj):
        if self.is_main:
            self.sent.append(obj)
        return self.sent[-1]


def test_at_two_ranks_rank_0_starts_the_one_reward_server_and_both_ranks_use_it(tmp_path, monkeypatch):
    import grpo_cli.engines.served as served
    from grpo_cli.rewards.load import close_reward_models, place_reward_models

    path = classifier(tmp_path)
    started, stopped = [], []

    class Started:
        url = "http://127.0.0.1:8123"

        def stop(self):
            stopped.append(self.url)

    def start_server(model_path, name, args, log, timeout_s, key, where):
        started.append((model_path, key, str(log.parent)))
        return Started()

    monkeypatch.setattr(served, "start_server", start_server)
    sent: list = []
    specs = [RewardSpec(name="served", model=path, server="start"), RewardSpec(name="here", model=path),
             RewardSpec(name="correct", weight=0.0, correctness=True)]
    on_rank = {rank: load_rewards(specs) for rank in (0, 1)}
    place_reward_models(on_rank[0], "cpu", "float32", tmp_path, Ranks(0, sent))
    place_reward_models(on_rank[1], "cpu", "float32", tmp_path, Ranks(1, sent))
    assert started == [(path, "rewards[0].server", str(tmp_path))] and sent == [Started.url]  # one server, rank 0's
    assert [r[0].fn.server.url for r in on_rank.values()] == [Started.url] * 2
    assert all(r[1].fn.model is not None for r in on_rank.values())  # in process: every rank loads its own copy
    close_reward_models(on_rank[1])
    assert stopped == []  # rank 1 does not stop rank 0's server
    close_reward_models(on_rank[0])
    assert stopped == [Started.url]


def test_grpo_reward_checks_a_reward_model_s_scores_against_ranges(tmp_path, capsys):
    """A case's expected score of a reward model is a range [low, high] (null: open), which grpo reward checks;
    a score outside it fails the case, and a malformed range is refused with the case's line."""
    import json

    from grpo_cli.cli import main
    from grpo_cli.rewards.cases import expected_scores, meets

    path = classifier(tmp_path)
    (rm,) = load_rewards([RewardSpec(name="rm", model=path)])
    logit = rm.fn([COMPLETIONS[0]], prompt=[PROMPTS[0]])[0]
    cases = tmp_path / "cases.jsonl"
    rows = [{"completion": COMPLETIONS[0], "question": PROMPTS[0], "answer": "36",
             "expected": {"correct": 1, "rm": [logit - 0.01, None]}},
            {"completion": COMPLETIONS[0], "question": PROMPTS[0], "answer": "36",
             "expected": {"rm": [None, logit - 0.01]}}]
    cases.write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    try:
        code = main(["reward", "recipe=bike_pricing", f"cases={cases}", f"rewards.1.model={path}",
                     "rewards.1.name=rm"])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr().out
    assert code == 1 and "2 cases: 1 passed, 1 failed" in out, out[-2000:]
    assert meets(0.5, (0.0, None)) and not meets(0.5, (None, 0.4)) and meets(1.0, 1.0)
    with pytest.raises(UsageError, match=r"must be a number or a range \[low, high\]"):
        expected_scores({"expected": {"rm": [None, None]}}, ["rm"], "correct", "cases.jsonl:1")


def test_a_judge_s_parsers_read_scores_and_leave_the_rest_unread():
    from grpo_cli.rewards.judge import parse_score_10, parse_yes_no, regex_parser

    assert [parse_score_10(r) for r in ("7/10", "I'd say 8 out of 10.", "Score: 3", "score is 10", "11/10",
                                        "great", "")] == [0.7, 0.8, 0.3, 1.0, None, None, None]
    assert [parse_yes_no(r) for r in ("Yes.", " no, because", "maybe yes", "")] == [1.0, 0.0, None, None]
    grade = regex_parser("rewards[0]", r"Grade: ([A-F])|(\d+) points")
    assert grade("12 points") is None and grade("Grade: B") is None  # a group that is not a number: unread
    assert regex_parser("rewards[0]", r"(\d+) points")("it gets 12 points") == 12.0


def test_a_judge_s_settings_are_checked_before_any_model_loads(tmp_path):
    from grpo_cli.rewards import validate_columns

    judge = dict(name="judge", judge="Q: {prompt}\nA: {completion}\nGold: {answer}\nScore:", server="http://127.0.0.1:9")
    refused = {
        "rewards[0].server: http://127.0.0.1:9 does not answer as a vLLM server": RewardSpec(**judge),
        "rewards[0].judge: the template has no {completion}": RewardSpec(**{**judge, "judge": "Rate {prompt}"}),
        "rewards[0].judge: {completion.upper} is not a name": RewardSpec(**{**judge, "judge": "{completion.upper}"}),
        "rewards[0].judge: the template does not parse": RewardSpec(**{**judge, "judge": "{completion"}),
        "rewards[0].parser: '(' is neither a parser": RewardSpec(**{**judge, "parser": "("}),
        "rewards[0].parser: 'Score: \\d+' has no group": RewardSpec(**{**judge, "parser": r"Score: \d+"}),
        "rewards[0].server: a judge is served": RewardSpec(**{**judge, "server": None}),
        "rewards[0].model: server=start needs the judge's model": RewardSpec(**{**judge, "server": "start"}),
    }
    for message, spec in refused.items():
        with pytest.raises(UsageError) as err:
            load_rewards([spec])
        assert str(err.value).startswith(message), str(err.value)
    (started,) = load_rewards([RewardSpec(**{**judge, "server": "start", "model": "builtin:bike_base"})])
    assert started.fn.server.url is None  # nothing starts until the run places it (or the first call)
    with pytest.raises(UsageError, match=r"^row 0: no 'answer' column, which the rewards need"):
        validate_columns([{"question": "q"}], [started])  # a column the template names, checked on the rows
    spec = RewardSpec(judge="{completion}", server="start", model="x")
    check_reward_spec(spec, "rewards[0]")
    assert spec.name == "judge"


class CharServer:
    """What JudgeContext asks of a judge server, with one token per character, a context of `max_model_len`, a BOS
    token, and a log of the requests."""

    def __init__(self, max_model_len: int) -> None:
        self.max_model_len, self.asked = max_model_len, []

    def post(self, path: str, body: dict) -> dict:
        self.asked.append(path)
        if path == "/detokenize":
            return {"prompt": "".join(map(chr, body["tokens"]))}
        bos = [0] if body.get("add_special_tokens", True) else []
        ids = bos + [ord(ch) for ch in body["prompt"]]
        return {"count": len(ids), "tokens": ids, "max_model_len": self.max_model_len}


def test_a_judge_prompt_too_long_for_its_context_loses_the_middle_of_its_completion():
    """The policy writes the completion: one too long for the judge's context is cut in its middle (the template's
    instructions and the completion's end kept) rather than failing every sample of its request; a prompt that
    cannot fit at all fails its own sample (None); a short one costs one /tokenize per run, no more."""
    from grpo_cli.rewards.judge import JudgeContext

    server = CharServer(max_model_len=170)
    context = JudgeContext(server, chat=False, max_tokens=20)  # prompts of at most 150 tokens (BOS included)
    template = "Rate this answer.\n{completion}\nScore:"
    short = context.fitted(template, {"completion": "Answer: 4"})
    assert short == "Rate this answer.\nAnswer: 4\nScore:" and server.asked == ["/tokenize"]
    long = "step " * 60 + "Answer: 300"  # 311 characters
    cut = context.fitted(template, {"completion": long})
    # counted once before the cut, the completion and the marker tokenized, two halves back to text (the cut's bytes
    # fit: no further count)
    assert server.asked[1:] == ["/tokenize"] * 3 + ["/detokenize"] * 2
    assert cut.startswith("Rate this answer.\nstep step") and cut.endswith("Answer: 300\nScore:")
    assert "tokens cut to fit the judge's context ...]" in cut and 140 <= 1 + len(cut) <= 150  # the room is used
    assert context.fitted("{prompt}" * 2 + "{completion}", {"prompt": "x" * 75, "completion": "y"}) is None
    chat = JudgeContext(CharServer(max_model_len=170), chat=True, max_tokens=20)
    chat.server.post = lambda path, body, inner=chat.server.post: inner(path, {  # a chat turn: 10 tokens around it
        "prompt": "<|user|>" + body["messages"][0]["content"] + "<|a|>"} if "messages" in body else body)
    fitted = chat.fitted(template, {"completion": long})
    assert fitted.endswith("Answer: 300\nScore:") and "tokens cut" in fitted
    assert 1 + len("<|user|><|a|>") + len(fitted) <= 150


@pytest.mark.slow
def test_a_judge_on_a_real_vllm_server_scores_its_parsed_replies_and_fails_the_unreadable(tmp_path):
    """rewards[i].judge with server=start: a real vLLM server on the shipped bike model given a chat template (no
    chat model is shipped), read two ways. template=plain: the prompt as it is through /v1/completions, 3 prompts
    a request; template=chat: the prompt as the user's turn of its chat template through /v1/chat/completions. The
    greedy replies, asked again from the server directly, parsed by the recipe's regex, are the scores; with the
    yes_no parser none of its replies reads, and every sample fails (on_failure); `close` stops the server. A
    completion longer than the judge's 512-token context is cut in its middle to fit (the template whole around
    it) instead of failing its request of 3, in a chat turn too; a prompt too long for any completion fails its
    own sample only."""
    import shutil

    from conftest import CHATML_TEMPLATE
    from transformers import AutoTokenizer

    from grpo_cli.engines.served import post_json
    from grpo_cli.rewards.judge import CUT_MARKER

    chat_model = tmp_path / "bike_chat"  # the shipped bike model with ChatML: a chat model's files
    shutil.copytree(resolve_model_path("builtin:bike_base"), chat_model)
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(chat_model)
    template = "{prompt} The bill is {answer}.\n{completion}\nsubtotal:"
    spec = dict(name="judge", judge=template, server="start", model=str(chat_model), parser=r"(\d+)\.",
                max_tokens=12, batch_size=3, timeout_s=30.0, template="plain")
    (judge,) = load_rewards([RewardSpec(**spec)])
    long_answer = "city bike: 2 x 9 = 18.00\n" * 40 + "Answer: 18.00"  # ~1,000 characters, one token each
    answers = ["36", "4", "240", "12", "9", "18", "1"]
    completions = COMPLETIONS + ["e-bike: 3 x 4 = 12.00", "Answer: 9", long_answer, "Answer: 1"]
    prompts = PROMPTS + ["An e-bike costs 4 an hour. What do 3 hours cost?", "Price?", "Two days of city bike at 9?",
                         "Price? " * 100]
    try:
        scores = judge.fn(completions, prompt=prompts, answer=answers)
        assert not judge.fn.chat and judge.fn.server.started is not None
        texts = judge.fn.prompts(completions, prompts, {"answer": answers})
        assert texts[:5] == [template.format(prompt=p, answer=a, completion=c)
                             for p, a, c in zip(prompts[:5], answers[:5], completions[:5])]
        assert texts[6] is None and scores[6] is None  # its prompt alone outgrows the context: that sample fails
        cut = texts[5]
        head, tail = cut.split("[... ")[0], cut.split(" tokens cut to fit the judge's context ...]\n")[1]
        assert head.startswith(prompts[5] + " The bill is 18.\ncity bike: 2 x 9 = 18.00\n")  # the template's start
        assert tail.endswith("Answer: 18.00\nsubtotal:") and CUT_MARKER.split("{")[0] in cut
        counted = post_json(f"{judge.fn.server.url}/tokenize", {"model": "judge", "prompt": cut}, 60)
        assert counted["count"] <= 512 - 12 < len(template.format(prompt=prompts[5], answer="18",
                                                                    completion=long_answer))
        texts = texts[:6]
        raw = post_json(f"{judge.fn.server.url}/v1/completions", {"model": "judge", "prompt": texts, "max_tokens": 12,
                                                                  "temperature": 0.0}, 60)
        replies = [c["text"] for c in sorted(raw["choices"], key=lambda c: c["index"])]
        import re

        want = [float(m.group(1)) if (m := re.search(r"(\d+)\.", r)) else None for r in replies]
        assert scores[:6] == want and any(s is not None for s in scores), (replies, scores)
        (chat,) = load_rewards([RewardSpec(**{**spec, "name": "judge_chat", "template": "chat",
                                              "server": judge.fn.server.url})])
        chat_scores = chat.fn(completions, prompt=prompts, answer=answers)
        chat_texts = chat.fn.prompts(completions, prompts, {"answer": answers})
        assert chat.fn.chat and chat_texts[:5] == texts[:5] and chat_texts[6] is None and chat_scores[6] is None
        assert CUT_MARKER.split("{")[0] in chat_texts[5]  # cut to fit the chat turn
        counted = post_json(f"{judge.fn.server.url}/tokenize", {"model": "judge", "add_generation_prompt": True,
                                                                "messages": [{"role": "user", "content": chat_texts[5]}]}, 60)
        assert counted["count"] <= 512 - 12
        chat_replies = [post_json(f"{judge.fn.server.url}/v1/chat/completions",
                                  {"model": "judge", "messages": [{"role": "user", "content": t}], "max_tokens": 12,
                                   "temperature": 0.0}, 60)["choices"][0]["message"]["content"] for t in chat_texts[:6]]
        want = [float(m.group(1)) if (m := re.search(r"(\d+)\.", r)) else None for r in chat_replies]
        assert chat_scores[:6] == want and any(s is not None for s in chat_scores), (chat_replies, chat_scores)
        assert chat_replies != replies  # the turn's markup reached the model: not the plain prompts' replies
        completions, prompts, answers = completions[:5], prompts[:5], answers[:5]
        for name, template_kind in (("judge_yes_no", "plain"), ("judge_chat_yes_no", "chat")):
            (strict,) = load_rewards([RewardSpec(**{**spec, "name": name, "parser": "yes_no", "template": template_kind,
                                                    "server": judge.fn.server.url})])
            failures = RewardFailures()
            scored = score([strict], completions, {"answer": answers}, "answer_line", failures,
                           context=SampleContext(prompts=prompts))
            assert failures.counts[name] == 5 and scored.per_function[name] == [0.0] * 5
            assert "not a finite number" in failures.last_error[name]
    finally:
        process = judge.fn.server.started.process if judge.fn.server.started else None
        judge.fn.close()
    assert process is not None and process.poll() is not None and judge.fn.server.started is None
@pytest.mark.slow
def test_a_served_reward_model_scores_as_in_process_and_a_run_whose_server_dies_ends_with_one_line(tmp_path):
    """rewards[i].server=start: a real vLLM pooling server on the shipped bike_rm, started on first use (as in grpo
    reward), gives the in-process scores to 1e-4 through /classify. A training run given that server's URL: the
    server SIGKILLed once the run trains, the run ends (exit 1) with one line naming the reward, the step and the
    server, its finished steps kept. Against the dead server each call fails at once and all its samples count as
    failed (on_failure); `close` leaves no process."""
    import json
    import os
    import re
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from grpo_cli.cli import load_config
    from grpo_cli.prompts.rows import load_splits

    cfg = load_config("train", ["recipe=bike_pricing_rm"])
    rows = load_splits(cfg.data)[1][:6]
    prompts = [row["question"] for row in rows for _ in range(2)]
    completions = [text for row in rows for text in (row["solution"], "Answer: 1.00")]
    (here,) = load_rewards([RewardSpec(name="reward_model", model="builtin:bike_rm", batch_size=5)])
    (there,) = load_rewards([RewardSpec(name="reward_model", model="builtin:bike_rm", batch_size=5, server="start",
                                        timeout_s=5.0)])
    try:
        want = here.fn(completions, prompt=prompts)
        got = there.fn(completions, prompt=prompts)  # 3 requests of <= 5 texts, 4 in flight
        assert there.fn.server.started is not None and there.fn.server.url.startswith("http://127.0.0.1:")
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4, (got, want)
        assert len(set(round(x, 3) for x in want)) > 4  # the texts score apart
        url, process = there.fn.server.url, there.fn.server.started.process
        run = subprocess.Popen([sys.executable, "-m", "grpo_cli", "train", "recipe=bike_pricing_rm", "trainer.steps=40",
                                "rollout.prompts_per_step=4", "rollout.group_size=4", "eval.every=0",
                                "checkpoint.every=0", "rollout.enforce_eager=true", f"rewards.0.server={url}",
                                "rewards.0.timeout_s=5", f"output_dir={tmp_path / 'out'}"],
                               cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
        deadline, metrics = time.time() + 300, None
        while time.time() < deadline and run.poll() is None:
            metrics = next(iter((tmp_path / "out").glob("bike_pricing_rm/*/metrics.jsonl")), None)
            if metrics is not None and len(metrics.read_text().splitlines()) >= 3:  # steps 0-2 logged
                break
            time.sleep(0.2)
        assert metrics is not None and run.poll() is None, "the run never trained"
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        _, err = run.communicate(timeout=300)
        assert run.returncode == 1, err[-3000:]
        (line,) = [e for e in err.splitlines() if e.startswith("grpo train: error:")]
        assert re.search(r"reward function 'reward_model' failed on \d+ of 16 samples at step \d+: ", line), line
        assert f"rewards[0].server at {url} failed" in line and "Traceback" not in err
        assert [json.loads(row)["step"] for row in metrics.read_text().splitlines()][:3] == [0, 1, 2]

        failures = RewardFailures()
        scored = score([there], completions[:4], {}, "answer_line", failures, group_size=2,
                       context=SampleContext(prompts=prompts[:4]))
        assert failures.counts["reward_model"] == 4 and scored.per_function["reward_model"] == [0.0] * 4
        assert f"rewards[0].server at {url}" in failures.last_error["reward_model"]
        assert there.fn.server.failing  # the next request gets one try, until the server answers
    finally:
        there.fn.close()
    assert there.fn.server.started is None


def test_grpo_check_prints_each_learned_reward_and_counts_one_in_process_on_the_gpu(capsys):
    from grpo_cli.cli import main

    def check(*args: str) -> str:
        capsys.readouterr()
        assert main(["check", *args]) == 0
        return capsys.readouterr().out

    here = check("recipe=bike_pricing_rm")
    assert "reward model rewards[0] reward_model (weight 1): builtin:bike_rm, the only logit (raw) of prompt + " \
           "completion (template auto), 32 samples a pass; 1.1M parameters, 0.004 GiB per trainer rank" in here
    served = check("recipe=bike_pricing_rm", "rewards.0.server=start")
    assert "served by a vLLM server grpo starts for the run (4 requests at once, 10 s each)" in served
    gpu = check("recipe=bike_pricing_rm", "model.dtype=bfloat16", "rollout.push_check_tol=0.05")
    started = check("recipe=bike_pricing_rm", "model.dtype=bfloat16", "rollout.push_check_tol=0.05",
                    "rewards.0.server=start", "rewards.0.server_kv_cache_gib=3")
    assert "reference + reward models" in gpu and "reference + reward models" not in started
    # a started server is counted on rank 0's GPU: it was counted nowhere (issue 66, defect 6)
    assert ("rewards[0].server=start: a vLLM server on rank 0's GPU, 5.0 GiB throughout (weights 0.0, KV cache 3 "
            "(rewards[0].server_kv_cache_gib), workspace 2)") in started
    assert "rank 0's GPU: the peak above + 5.0 GiB of started servers" in started


class ExitedServer:
    """What subprocess.Popen gives start_server here: a server process that exited at once (no GPU here)."""
    pid, returncode = 0, 1

    def poll(self):
        return 1


@pytest.mark.parametrize("device, visible, expected_env, expected_args", [
    ("cpu", None, {"VLLM_CPU_KVCACHE_SPACE": "3"}, []),
    ("cuda:1", None, {"CUDA_VISIBLE_DEVICES": "1"},
     ["--kv-cache-memory-bytes", str(3 * 2**30), "--gpu-memory-utilization", "0.2500"]),
    ("cuda:1", "4,6", {"CUDA_VISIBLE_DEVICES": "6"},  # the trainer's cuda:1 is the machine's GPU 6
     ["--kv-cache-memory-bytes", str(3 * 2**30), "--gpu-memory-utilization", "0.2500"]),
])
def test_a_started_server_runs_on_the_trainers_device_with_its_memory_named(tmp_path, monkeypatch, device, visible,
                                                                              expected_env, expected_args):
    """server=start gave vLLM neither a device nor a memory fraction: on a GPU it took 0.9 of the GPU the trainer
    holds (issue 66, defect 6). Its command line and environment, with CUDA's answers mocked (no GPU here)."""
    import contextlib

    import torch

    import grpo_cli.engines.options
    from grpo_cli.engines import served
    from grpo_cli.errors import RunFailure

    started = []
    monkeypatch.setattr(served.subprocess, "Popen", lambda command, **kw: started.append((command, kw["env"]))
                        or ExitedServer())
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(grpo_cli.engines.options, "cuda_engine_memory", lambda path, dtype, kv_gib: {
        "kv_cache_memory_bytes": int(kv_gib * 2**30), "gpu_memory_utilization": 0.25})
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with pytest.raises(RunFailure, match="rewards.0.server=start: the vLLM server on /m exited with 1"):
        served.start_server("/m", "rm", ["--dtype", "bfloat16"], tmp_path / "log", 5.0, "rewards.0.server",
                            served.Placement(device, "bfloat16", 3.0))
    [(command, env)] = started
    assert command[command.index("--dtype"):] == ["--dtype", "bfloat16", *expected_args]
    assert {k: env[k] for k in expected_env} == expected_env


def test_every_served_model_retries_by_one_rule_and_a_teacher_stops_the_run(tmp_path):
    """One retry loop for every served model (issue 66): a refused try, an HTTP error and an unreadable answer
    each cost a try; a reward's server then fails its samples (Unreachable), a teacher's stops the run."""
    import http.server
    import json
    import threading

    from grpo_cli.engines.served import ask
    from grpo_cli.errors import RunFailure, Unreachable
    from grpo_cli.rewards.teacher import ServedTeacher

    answers = []  # what the server says next: an HTTP status, or a JSON body

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            reply = answers.pop(0)
            if isinstance(reply, int):
                self.send_error(reply)
                return
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        answers[:] = [500, {"not": "it"}, {"score": 1}]
        assert ask(url, {}, 5.0, 3, "x", read=lambda a: a["score"]) == 1  # two failed tries, then an answer
        answers[:] = [503, 503]
        with pytest.raises(Unreachable, match=r"^rewards\[0\].server failed 2 times \(HTTPError: HTTP Error 503"):
            ask(url, {}, 5.0, 2, "rewards[0].server")
        answers[:] = [{"choices": []}] * 3  # readable JSON the teacher cannot read grades from
        with pytest.raises(RunFailure, match=rf"^distill.server: the teacher at {url}, on one sample, failed 3 times "
                                             r"\(IndexError"):
            ServedTeacher(url, "teacher", 5.0, 1).grade([1, 2, 3], 1)
    finally:
        server.shutdown()
