"""`ToolEngine`: multi-turn rollouts: the model writes, calls a tool, reads its result, writes on, until it answers.

`ToolEngine` wraps a rollout engine (vLLM or transformers) and has its interface, so the training
step, held-out evaluation and `grpo eval` run the same loop. Its `generate` advances every sample of
the call together, with no barrier per turn on vLLM:

    every sample is a request (n = 1; sample g of prompt p seeded seeds[p] + g, as inside an n = G
    request), stopping at any tool's close string; as each request stops, its call goes to the tool
    pool (grpo_cli.tools.pool) while the others decode on; the reply is tokenized once and appended, and
    the continuation (prompt + its ids so far, seeded per (prompt seed, sample, request number)) joins
    the running batch (Engine.generate_each) at the engine step the pool's rejoin rule fixes, never at
    whatever moment the call returned

The transformers engine runs the same requests in rounds (HFEngine.generate_each).

Token in, token out: the model's sampled ids are kept as sampled and never re-tokenized; the
environment's reply is tokenized once and appended; the next call continues from those exact ids.
A trajectory is one token sequence after the prompt, with `model_mask` 1 on the model's tokens and
0 on the environment's, and the engine's sampling logprob of each model token (0 on the
environment's). Sampling is a pure function of (seed, step, prompt, sample, request number), so a
resumed run samples the same trajectories, and a sample that never calls a tool is the single-turn
sample. `Rollouts.texts` are the model's own words (what the rewards read), `Rollouts.trajectories`
the whole conversations.

Caps (rollout.*): `max_new_tokens` per model turn, `max_turns` model turns, `max_tool_calls` calls,
`max_tool_result_tokens` per result, `max_trajectory_tokens` for the whole sequence after the prompt,
`max_tool_timeouts` calls that ran out of time. A trajectory stopped by a cap is `truncated` (and counted
by the cap that stopped it). Tool calls run off the engine loop, on a pool, under a tool-time budget per
generate call (`tool_workers`, `tool_budget_s`; grpo_cli.tools.pool).
"""

from __future__ import annotations

from collections.abc import Collection, Hashable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from grpo_cli.config import RolloutConfig
from grpo_cli.engines.base import (
    NO_LOGPROBS,
    Completion,
    DelegatingEngine,
    Engine,
    Request,
    Rollouts,
    Sampling,
    wants_logprobs,
)
from grpo_cli.tools.chat import ChatFormat
from grpo_cli.tools.environment import EnvironmentEnd
from grpo_cli.tools.load import LoadedTool, environment_of
from grpo_cli.tools.pool import CallDone, StepCalls, ToolPool
from grpo_cli.tools.result import MAX_RESULT_CHARS
from grpo_cli.tools.result import timeouts as result_timeouts
from grpo_cli.tools.tags import Call, TagFormat


class ToolCaps(NamedTuple):
    max_turns: int  # model turns in a trajectory (tool calls are at most max_turns - 1)
    max_tool_calls: int  # tool calls in a trajectory
    max_tool_result_tokens: int  # tokens of one tool result (cut beyond)
    max_trajectory_tokens: int  # tokens after the prompt, the model's and the environment's together
    max_tool_timeouts: int = 2  # calls of a trajectory that time out (or meet the spent budget) before it is cut
    tool_workers: int = 16  # calls run at once (tools.pool)
    tool_budget_s: float | None = None  # seconds of tool time per generate call; None = no budget
    tool_rejoin: str = "wave"  # when a reply rejoins decoding (tools.pool.REJOIN_RULES)


@dataclass
class Trajectory:
    """One sample's conversation so far, after its prompt."""

    ids: list[int] = field(default_factory=list)  # every token after the prompt, as sampled / as tokenized
    model_mask: list[int] = field(default_factory=list)  # 1 on the model's tokens, 0 on the environment's
    logprobs: list[float] = field(default_factory=list)  # the engine's sampling logprob (0 on the environment's)
    segments: list[dict[str, Any]] = field(default_factory=list)  # the turns: {"role": "model"|"tool", "text", ...}
    turn_text: str = ""  # the model's text since the environment last spoke (a turn may take several calls)
    turn_tokens: int = 0  # the model's tokens since the environment last spoke (rollout.max_new_tokens caps them)
    turns: int = 1  # model turns begun
    calls: int = 0  # tool calls made
    engine_calls: int = 0  # engine requests made for it (the next one's seed is call_seed(..., engine_calls))
    done: bool = False
    capped: str | None = None  # the cap that stopped it: "turn_tokens" | "trajectory_tokens" | "turns" | "tool_calls"
    row: dict[str, Any] | None = None  # with an environment: the prompt's dataset row, which builds its instance
    env_key: tuple[int, int] = (-1, -1)  # with an environment: its instance's key in the environment's process
    env_calls: list[tuple[str, Any]] = field(default_factory=list)  # the calls an instance rebuilt must replay
    pending_calls: list[Call] = field(default_factory=list)  # the calls its last turn made, run in order on the pool
    call_results: list[CallDone] = field(default_factory=list)  # those of them that have finished (tools.pool)
    tool_timeouts: int = 0  # its calls that timed out or met the step's spent tool budget

    def add_model(self, ids: list[int], logprobs: list[float], text: str) -> None:
        self.ids += ids
        self.model_mask += [1] * len(ids)
        self.logprobs += logprobs
        self.turn_text += text
        self.turn_tokens += len(ids)
        if self.segments and self.segments[-1]["role"] == "model":
            self.segments[-1]["text"] += text
        else:
            self.segments.append({"role": "model", "text": text})

    def add_environment(self, ids: list[int], segments: list[dict[str, Any]]) -> None:
        self.ids += ids
        self.model_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.segments += segments  # one per call of the turn
        self.turn_text, self.turn_tokens = "", 0


# Continuation seeds of the streams above 2**31 (evaluation, dynamic-sampling rounds: rollout.sample_seeds) lie
# above every stream's slots, in [CONTINUATION_BASE, 2**63): folded below 2**31 as training's are, evaluation's
# turns after a tool reply drew from training's seeds again (issue 66).
CONTINUATION_BASE = 2**62 + 2**32


def call_seed(prompt_seed: int, sample: int, call: int) -> int:
    """The seed of engine call `call` >= 1 of sample `sample` of a prompt (call 0 samples the whole group
    from the prompt's own seed). Training's (a prompt seed below 2**31) stay below 2**31, where the shipped tool
    curves were sampled; every other stream's go to a region no stream's first turns use."""
    mixed = prompt_seed * 1_000_003 + sample * 7_919 + call * 104_729 + 1
    if prompt_seed < 2**31:
        return mixed % (2**31 - 1)
    return CONTINUATION_BASE + mixed % (2**63 - CONTINUATION_BASE)


def cut_at_stop(ids: list[int], text: str, stops: list[str], decode: Any) -> tuple[int, str, int] | None:
    """(k, text of ids[:k], end) for the shortest prefix of `ids` whose text holds one of `stops`, `end` being
    where the first stop string ends in that text (the last token may run past it: `</calc>` and a newline
    can be one token); None when `text` (the text of all of `ids`) holds none. vLLM stops there itself
    (k = len(ids)); transformers' generate does not, so its ids are cut here."""
    if not any(s in text for s in stops):
        return None
    lo, hi = 1, len(ids)  # the smallest k whose text holds a stop string
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in decode(ids[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    prefix = decode(ids[:lo])
    return lo, prefix, min(prefix.find(s) + len(s) for s in stops if s in prefix)


def plain_ids(tokenizer: Any, text: str, added: list[str]) -> list[int]:
    """`text` as ordinary characters: no added or special token of the tokenizer (`added`: their strings) is
    matched in it, so an `<|endoftext|>` or `<|im_end|><|im_start|>system` that a tool prints stays characters
    (issue 36). Each occurrence is cut after its first character before tokenizing; a text holding none is
    tokenized whole, as before."""
    cuts = sorted({i + 1 for token in added for i in _occurrences(text, token)})
    bounds = [0, *cuts, len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
    return [i for piece in pieces for i in tokenizer(piece, add_special_tokens=False)["input_ids"]]


def _occurrences(text: str, token: str) -> list[int]:
    found, at = [], text.find(token)
    while at >= 0:
        found.append(at)
        at = text.find(token, at + 1)
    return found


def reply_ids(tokenizer: Any, fmt: TagFormat | ChatFormat, results: list[str], max_result_tokens: int,
              added: list[str], model_end: str = "") -> tuple[list[int], list[str], list[str]]:
    """The environment's reply to a turn's calls as tokens, the result texts it holds (each cut to
    max_result_tokens), and the reply's text piece by piece (the format's text before each result, the result,
    and after the last one the format's closing text): joined, the whole reply. Each result is plain text; the
    format's own strings keep their tokens: tokenized apart from the results where they hold an added or special
    token (a chat template's), else with them in one string (tag formats: the ids of a benign reply are those of
    the whole string). `model_end`: the model's own end-of-turn token, which the template's reply does not repeat."""
    kept, kept_ids = [], []
    for result in results:
        ids = plain_ids(tokenizer, result, added)
        if len(ids) > max_result_tokens:
            ids = ids[:max_result_tokens]
            result = tokenizer.decode(ids)  # the characters kept (plain ids: no special token to skip)
        kept.append(result)
        kept_ids.append(ids)
    parts = fmt.reply_parts(len(results), model_end)
    encoded = [fmt.encode(r) for r in kept]  # JSON-escaped where the template writes a result as a JSON string
    pieces = [part + r for part, r in zip(parts, encoded)]
    pieces[-1] += parts[-1]
    if not any(token in part for part in parts for token in added):
        return plain_ids(tokenizer, "".join(pieces), added), kept, pieces

    def own(part: str) -> list[int]:
        return tokenizer(part, add_special_tokens=False)["input_ids"]

    ids = own(parts[0])
    for r, r_ids, e, part in zip(kept, kept_ids, encoded, parts[1:]):
        ids += (r_ids if e == r else plain_ids(tokenizer, e, added)) + own(part)
    return ids, kept, pieces


class ToolEngine(DelegatingEngine):
    """A rollout engine whose samples are conversations with tools (module docstring); pushes, scoring and
    sleep are the inner engine's."""

    def __init__(self, engine: Engine, tools: list[LoadedTool], fmt: TagFormat | ChatFormat, caps: ToolCaps) -> None:
        super().__init__(engine)
        self.tools, self.fmt, self.caps = {t.name: t for t in tools}, fmt, caps
        self.environment = environment_of(tools)
        self.added = [t for t in self.tokenizer.get_added_vocab() if t]  # token strings a result must not become
        self.special_ids = set(self.tokenizer.all_special_ids)
        self.pool = ToolPool(caps.tool_workers)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling, seeds: list[int],
                 rows: list[dict] | None = None) -> Rollouts:
        G, caps, stops, env = sampling.n, self.caps, self.fmt.stops, self.environment
        if env is not None and (rows is None or len(rows) != len(prompt_ids)):
            raise ValueError("an environment is built from each prompt's dataset row: pass generate(..., rows=)")
        trajectories = [[Trajectory() for _ in range(G)] for _ in prompt_ids]  # [P][G]
        if env is not None:
            for row, group in zip(rows, trajectories):
                for t in group:
                    t.row, t.env_key = row, env.new_key()  # a fresh instance per sample
        turn = sampling._replace(stop=tuple(stops),
                                 max_new_tokens=min(sampling.max_new_tokens, caps.max_trajectory_tokens))
        calls = StepCalls(self.pool, self.caps.tool_budget_s, self.caps.tool_rejoin)
        try:
            self._generate_each(prompt_ids, trajectories, turn, seeds, calls)
        except BaseException:
            if env is not None:  # no instance may outlive its trajectory
                env.forget([t.env_key for group in trajectories for t in group])
            raise
        ends = [[env.end(t.env_key, t.row, t.env_calls) for t in group] for group in trajectories] if env else []
        return self._rollouts(prompt_ids, trajectories, ends, calls.tool_seconds, calls.late_s)

    def _generate_each(self, prompt_ids: list[list[int]], trajectories: list[list[Trajectory]], turn: Sampling,
                       seeds: list[int], calls: StepCalls) -> None:
        """Every turn of every trajectory in one engine loop (`Engine.generate_each`): a trajectory whose turn
        ends is absorbed, its tool call runs on the pool while the others decode, and it continues with the reply
        appended at the engine step (a round, on transformers) that tools.pool's rejoin rule gives.
        Sample g of prompt p starts from seed seeds[p] + g, the seed vLLM gives it inside an n = G request, so
        a sample that never calls a tool is the single-turn sample."""
        cap = turn.max_new_tokens

        def request(p: int, g: int) -> Request:
            t = trajectories[p][g]
            seed = seeds[p] + g if t.engine_calls == 0 else call_seed(seeds[p], g, t.engine_calls)
            t.engine_calls += 1
            asked = None if wants_logprobs(turn, seeds[p]) else NO_LOGPROBS  # by the group's seed, not this turn's
            return Request((p, g), prompt_ids[p] + t.ids,
                           turn._replace(n=1, max_new_tokens=self._room(t, cap), logprob_seeds=asked), seed)

        def submit(key: tuple[int, int], t: Trajectory) -> None:  # the next of its turn's calls, on the pool
            found = t.pending_calls[len(t.call_results)]
            tool = self.tools.get(found.tool)
            if tool is None:  # a call the model wrote badly (tool ""): the reason is its error
                calls.submit(key, None, found.argument)
            else:
                calls.submit(key, tool, found.argument,
                             (t.env_key, t.row, t.env_calls) if tool.environment is not None else None)

        def on_finish(key: tuple[int, int], out: Completion) -> None:
            t = trajectories[key[0]][key[1]]
            found = self._absorb(t, out.ids, out.logprobs, out.truncated, cap)
            if not found:
                if not t.done:
                    calls.resume(key)  # its turn goes on: it rejoins with the replies, in order
                return
            t.pending_calls, t.call_results = found, []
            submit(key, t)

        class Continuations:  # what generate_each takes back between engine steps (engines.base.Replies)
            @staticmethod
            def waiting() -> int:
                return calls.waiting

            @staticmethod
            def take(running: Collection[Hashable]) -> list[Request]:
                follow = []
                for done in calls.take(running):
                    t = trajectories[done.key[0]][done.key[1]]
                    if done.result is not None:
                        if done.replay == "replay":  # an environment method that ran: a rebuilt instance replays it
                            t.env_calls.append(tuple(t.pending_calls[len(t.call_results)]))
                        t.call_results.append(done)
                        timeouts = t.tool_timeouts + result_timeouts(d.result for d in t.call_results)
                        if len(t.call_results) < len(t.pending_calls) and timeouts < self.caps.max_tool_timeouts:
                            submit(done.key, t)  # the turn's next call: one after another, in the order written
                            continue
                        self._reply(t)
                    if not t.done:
                        follow.append(request(*done.key))
                return follow

        self.engine.generate_each([request(p, g) for p, group in enumerate(trajectories) for g in range(len(group))],
                                  on_finish, Continuations())

    def _room(self, t: Trajectory, turn_cap: int) -> int:
        """The tokens the model may still write in this turn: its turn's cap and the trajectory's."""
        return min(turn_cap - t.turn_tokens, self.caps.max_trajectory_tokens - len(t.ids))

    def _absorb(self, t: Trajectory, ids: list[int], logprobs: list[float], truncated: bool,
                turn_cap: int) -> list[Call]:
        """One engine call's output into its trajectory: the model's tokens (cut at a stop string, and to the
        turn's and the trajectory's room); the calls its turn ended in, or [] (the trajectory is done, or its
        turn goes on: a close string without an open string). A tag turn ends at a tool's close string, in one
        call; a chat turn where the model ends its message, in as many as it wrote."""
        text = self._decode(ids)
        stop_end = None
        if cut := cut_at_stop(ids, text, self.fmt.stops, self._decode):
            (k, text, stop_end), truncated = cut, False
            ids, logprobs = ids[:k], logprobs[:k]
        room = self._room(t, turn_cap)
        if len(ids) > room:  # the call was sized for the longest room of its batch
            ids, logprobs, text, truncated = ids[:room], logprobs[:room], self._decode(ids[:room]), True
        t.add_model(ids, logprobs, text)
        if truncated:  # a cap cut the turn
            t.done = True
            t.capped = "trajectory_tokens" if len(t.ids) >= self.caps.max_trajectory_tokens else "turn_tokens"
            return []
        if isinstance(self.fmt, ChatFormat):  # the message is over: its calls, in its family's syntax
            found = self.fmt.find_calls(self.tokenizer.decode(ids, skip_special_tokens=False))
            if not found:
                t.done = True  # an answer
                return []
        elif stop_end is None:  # it ended (end of sequence) without a call
            t.done = True
            return []
        if len(t.ids) >= self.caps.max_trajectory_tokens:
            t.done, t.capped = True, "trajectory_tokens"
            return []
        if not isinstance(self.fmt, ChatFormat):
            call = self.fmt.find_call(t.turn_text[: len(t.turn_text) - len(text) + stop_end])  # up to the stop string
            if call is None:  # a close string with no open string before it: not a call, the turn goes on
                if t.turn_tokens >= turn_cap:
                    t.done, t.capped = True, "turn_tokens"
                return []
            found = [call]
        if t.turns >= self.caps.max_turns or t.calls + len(found) > self.caps.max_tool_calls:
            t.done, t.capped = True, "turns" if t.turns >= self.caps.max_turns else "tool_calls"
            return []
        return found

    def _reply(self, t: Trajectory) -> None:
        """Append the reply to a turn's finished calls, tokenized once (each result cut to max_tool_result_tokens).
        Calls that timed out or met the spent budget count against rollout.max_tool_timeouts: the trajectory is cut
        at that many (the turn's remaining calls do not run)."""
        done_calls = list(zip(t.pending_calls, t.call_results))
        results = [d.result._replace(text=d.result.text[:MAX_RESULT_CHARS]) for _, d in done_calls]
        last = t.ids[-1] if t.ids else None
        model_end = self.tokenizer.convert_ids_to_tokens(last) if last in self.special_ids else ""
        ids, texts, pieces = reply_ids(self.tokenizer, self.fmt, [r.text for r in results],
                                       self.caps.max_tool_result_tokens, self.added, model_end)
        room = self.caps.max_trajectory_tokens - len(t.ids)
        t.calls += len(done_calls)
        t.add_environment(ids[:room], [
            {"role": "tool", "tool": call.tool, "argument": call.argument, "result": text, "ok": result.ok,
             "text": piece, "seconds": round(done.seconds, 4), "failure": result.failure}
            for (call, done), result, text, piece in zip(done_calls, results, texts, pieces)])
        t.tool_timeouts += result_timeouts(results)
        t.pending_calls, t.call_results = [], []
        if len(ids) >= room:  # the reply filled the budget: no room for the model to read and answer
            t.done, t.capped = True, "trajectory_tokens"
        elif t.tool_timeouts >= self.caps.max_tool_timeouts:  # its calls keep running out of time: cut
            t.done, t.capped = True, "tool_timeouts"
        else:
            t.turns += 1

    def _rollouts(self, prompt_ids: list[list[int]], trajectories: list[list[Trajectory]],
                  ends: list[list[EnvironmentEnd]], tool_seconds: float, late_s: float) -> Rollouts:
        # [P][G] the model's own words (what the rewards read as `completions`), and the whole trajectory
        texts = [["".join(s["text"] for s in t.segments if s["role"] == "model") for t in group] for group in trajectories]
        whole = [[self._decode(t.ids) for t in group] for group in trajectories]
        return Rollouts(prompt_ids, [[t.ids for t in group] for group in trajectories],
                        [[t.logprobs for t in group] for group in trajectories], texts,
                        [[t.capped is not None for t in group] for group in trajectories],
                        model_mask=[[t.model_mask for t in group] for group in trajectories],
                        segments=[[t.segments for t in group] for group in trajectories],
                        capped=[[t.capped for t in group] for group in trajectories], environments=ends,
                        tool_seconds=[tool_seconds], tool_late_s=[late_s], trajectories=whole)


def with_tools(engine: Engine, tools: list[LoadedTool], rollout: RolloutConfig) -> Engine:
    """`engine` itself without tools; with them, a ToolEngine over it with the recipe's format and caps."""
    if not tools:
        return engine
    fmt: TagFormat | ChatFormat
    if rollout.tool_format == "chat":
        fmt = ChatFormat.from_tokenizer(engine.tokenizer, {t.schema["function"]["name"]: t.name for t in tools},
                                        rollout.tool_call_syntax, rollout.max_tool_calls)
    else:
        fmt = TagFormat(tuple((t.name, t.open, t.close) for t in tools), *rollout.tool_result_tags)
    caps = ToolCaps(rollout.max_turns, rollout.max_tool_calls, rollout.max_tool_result_tokens,
                    rollout.trajectory_tokens, rollout.max_tool_timeouts, rollout.tool_workers, rollout.tool_budget_s,
                    rollout.tool_rejoin)
    return ToolEngine(engine, tools, fmt, caps)
