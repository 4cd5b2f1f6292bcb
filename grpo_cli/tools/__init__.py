"""Tools: functions the model calls in the middle of a rollout, and the multi-turn loop that runs them.

- builtin.py: the built-in tools (`calculator`; `python`, code in a fresh process under limits).
- load.py: a recipe's `rollout.tools` list -> loaded, checked tools, each in a killable worker when it
  has a time limit; a call that raises, overruns or returns junk becomes a short error result.
- environment.py: `rollout.environment`, a class with one instance per sample whose methods are tools
  and whose `reward()` can score the trajectory; the instances live in a killable worker.
- tags.py: the tag call format of small plain-text models (`<calc>3*18</calc>` -> `<result>54</result>`).
- chat.py: the chat call format (the tokenizer's template, native `<tool_call>{...}</tool_call>`).
- worker.py: the one worker protocol: user code (a tool, an environment, a reward with `timeout_s`) in a
  killable child process, with its start and call limits and its failure kinds.
- sandbox.py, sandbox_worker.py, cgroups.py, uids.py, seccomp.py: model-written code in a bwrap sandbox
  (docs/sandbox.md): the call, a worker inside it, its cgroup, its leased host uid, the seccomp filters.
- pool.py, result.py: where a step's calls run, its tool budget and when a reply rejoins; what a result reads as.
- arithmetic.py: the exact arithmetic parser (never `eval`) of the calculator and the countdown reward.

The multi-turn loop itself is an engine wrapper, `grpo_cli.engines.tools.ToolEngine`: every sample's turns
in one engine loop, the tools, the reply tokenized once and appended, and a mask that is 1 on the model's
tokens and 0 on the environment's (docs/tools.md).

A custom tool is `(argument: str) -> str` (the text between the call tags in, the result text out).
"""

from grpo_cli.tools.builtin import BUILTIN_TOOLS, ToolFailed, calculator, python
from grpo_cli.tools.load import LoadedTool, load_tools
from grpo_cli.tools.tags import TagFormat

__all__ = ["BUILTIN_TOOLS", "LoadedTool", "TagFormat", "ToolFailed", "calculator", "load_tools", "python"]
