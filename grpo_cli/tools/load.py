"""From a recipe's `rollout.tools` list to loaded, checked tools; calling one so that it cannot hurt the run.

A tool is a built-in name (grpo_cli.tools.builtin) or a custom `package.module:function` taking one
string (the text between its call tags) and returning text. With `timeout_s` (the default) every call
runs in the tool's killable worker process (the reward workers' machinery, grpo_cli.tools.worker):
a call that raises, overruns or returns something other than text becomes a short `error: ...`
result for the model, and is counted; the run goes on.
"""

from __future__ import annotations

import inspect
import math
import sys
from dataclasses import dataclass, field
from typing import Any

import grpo_cli.tools.sandbox as sandbox
from grpo_cli.errors import UsageError
from grpo_cli.tools.builtin import BUILTIN_TOOLS, UNSANDBOXED_TOOLS, ToolFn, runs_untrusted_code
from grpo_cli.tools.chat import tool_schema
from grpo_cli.tools.environment import load_environment
from grpo_cli.tools.result import ToolResult, result_of
from grpo_cli.tools.sandbox_worker import SandboxedWorker
from grpo_cli.tools.worker import RewardWorker, call_in_process, import_function


@dataclass(frozen=True)
class LoadedTool:
    name: str  # as written in the recipe: a built-in name or "module:function"
    fn: ToolFn
    open: str  # the model writes open + argument + close to call it
    close: str
    timeout_s: float | None  # per call, in the worker; None = in the trainer's process, no limit
    worker: Any = field(default=None, compare=False, repr=False)  # a RewardWorker when timeout_s is set
    schema: dict | None = field(default=None, compare=False)  # chat format: the JSON schema the model is shown
    environment: Any = field(default=None, compare=False, repr=False)  # a method of this LoadedEnvironment
    # With a worker: those idle now (the pool takes one per call, tools.pool) and the ones started beside it
    idle: list = field(default_factory=list, compare=False, repr=False)
    spares: list = field(default_factory=list, compare=False, repr=False)


def _load_function(name: str, where: str) -> ToolFn:
    if name in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[name]
    if ":" not in name:
        raise UsageError(f"{where}: unknown tool '{name}'; built-in: {', '.join(BUILTIN_TOOLS)}, or a custom one "
                         "as package.module:function")

    try:
        return import_function(name, "tool")
    except UsageError as e:
        raise UsageError(f"{where}: {e}") from None


def _sandboxed(fn: ToolFn, spec: Any, where: str) -> ToolFn:
    """A tool that runs model-written code (it says so with `untrusted_code = True`, as the built-in python does)
    runs it in the sandbox, which must be makeable here; `sandbox: none` is the built-in's unsandboxed twin,
    with a warning. Another tool with `sandbox: bwrap` gets its worker in a sandbox (load_tools). Fails
    closed, naming the key."""
    if not runs_untrusted_code(fn):
        if spec.sandbox == "none":
            raise UsageError(f"{where}.sandbox: none applies to a tool that runs model-written code (the built-in "
                             f"python); '{spec.function}' declares none")
        if spec.sandbox == "bwrap":
            if spec.timeout_s is None:
                raise UsageError(f"{where}.sandbox: bwrap runs the tool in a worker process inside the sandbox; give "
                                 f"it a {where}.timeout_s (it is null)")
            require_sandbox(where, opt_out="auto")
        return fn
    if spec.sandbox == "none":
        if spec.function not in UNSANDBOXED_TOOLS:
            raise UsageError(f"{where}.sandbox: none; '{spec.function}' has no unsandboxed form (only the built-in "
                             "python does)")
        print(f"warning: {where} ({spec.function}) runs model-written code without a sandbox ({where}.sandbox=none): "
              "it can read, write and signal what the trainer's user can, and reach the network", file=sys.stderr)
        return UNSANDBOXED_TOOLS[spec.function]
    require_sandbox(where)
    return fn


def require_sandbox(where: str, opt_out: str = "none") -> None:
    """Fail closed, at the edge: the sandbox cannot be made on this machine (the line names the opt-out key:
    `none` for model-written code, `auto` for another tool's worker)."""
    if (why := sandbox.problem()) is not None:
        what = "the sandbox for model-written code" if opt_out == "none" else "the sandbox for this tool's worker"
        raise UsageError(f"{where}.sandbox: {what} cannot be made here: {why}; set {where}.sandbox={opt_out} to run "
                         "it unsandboxed (docs/sandbox.md)")


def _check_signature(fn: ToolFn, where: str) -> None:
    """A tag-format tool takes exactly one required argument, the text between its tags."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # some builtins have no signature; let them through
        return
    P = inspect.Parameter
    positional = (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)
    required = [p for p in params if p.default is P.empty and p.kind in positional]
    takes_one = bool(params) and params[0].kind in (*positional, P.VAR_POSITIONAL)
    required_keyword = any(p.kind is P.KEYWORD_ONLY and p.default is P.empty for p in params)
    if len(required) > 1 or not takes_one or required_keyword:
        shown = ", ".join(p.name for p in params) or "nothing"
        raise UsageError(f"{where}: a tool is called with one argument, the text between its tags; this one takes "
                         f"({shown})")


def call_strings(spec: Any) -> tuple[str, str]:
    """A tag-format tool's (open, close) strings: the recipe's, or "<NAME>" and "</NAME>" after its function."""
    short = spec.function.rpartition(":")[2]
    return spec.open or f"<{short}>", spec.close or f"</{short}>"


def tool_schemas(tools: list[LoadedTool]) -> list[dict] | None:
    """The chat-format tools' JSON schemas, which every prompt shows; None for tag-format tools (or none)."""
    return [t.schema for t in tools if t.schema is not None] or None


def load_tools(specs: list, tool_format: str = "tags", environment: Any = None) -> list[LoadedTool]:
    """The recipe's `rollout.tools` (ToolSpec) and `rollout.environment` (EnvironmentSpec: its methods) ->
    loaded tools, for `rollout.tool_format`. Fails at the edge, naming the key."""
    candidates = []  # (where, name, fn, open, close, timeout_s, environment, its worker in a sandbox)
    for i, spec in enumerate(specs):
        fn = _sandboxed(_load_function(spec.function, f"rollout.tools[{i}].function"), spec, f"rollout.tools[{i}]")
        boxed = spec.sandbox == "bwrap" and not runs_untrusted_code(fn)
        candidates.append((f"rollout.tools[{i}]", spec.function, fn, *call_strings(spec), spec.timeout_s, None, boxed))
    env, methods = load_environment(environment, tool_format) if environment is not None else (None, [])
    for method, stand_in, open_, close in methods:
        candidates.append((f"rollout.environment ({method})", method, stand_in, open_, close, None, env, False))
    loaded, seen, names = [], set(), set()
    for where, name, fn, open_, close, timeout_s, env, boxed in candidates:
        schema = None
        if tool_format == "chat":
            schema = tool_schema(fn, f"{where}.function" if env is None else where)
        else:
            _check_signature(fn, f"{where}.function" if env is None else where)
        short = name.rpartition(":")[2]
        if not close.strip() or any(close in other or other in close for other in seen):
            key = f"{where}.close" if env is None else f"rollout.environment.tags.{name}"
            raise UsageError(f"{key}: '{close}' must be non-blank and hold no other tool's close string, nor "
                             "be held in one (the engine stops at the first it meets)")
        seen.add(close)
        called = schema["function"]["name"] if schema is not None else name  # chat calls a tool by its function's name
        if called in names:
            raise UsageError(f"{where}: a second tool named '{called}'; tools are told apart by name")
        names.add(called)
        if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s > 0):
            raise UsageError(f"{where}.timeout_s: {timeout_s} must be > 0 seconds, or null for no limit")
        worker = None
        if timeout_s is not None:
            import functools

            kind = SandboxedWorker if boxed else RewardWorker
            worker = kind(f"tool-{short}", functools.partial(call_each, tool=fn), float(timeout_s))
        loaded.append(LoadedTool(name, fn, open_, close, timeout_s, worker, schema, env,
                                 idle=[worker] if worker is not None else []))
    return loaded


def environment_of(tools: list[LoadedTool]) -> Any:
    """The LoadedEnvironment whose methods are among `tools`, or None."""
    return next((t.environment for t in tools if t.environment is not None), None)


def call_each(arguments: list[str | dict], tool: ToolFn) -> list[Any]:
    """A worker's call: the tool on each argument (a list, as the reward worker's protocol has it): the
    text between a tag-format call's tags, or a chat-format call's JSON arguments by name."""
    results = [tool(argument) if isinstance(argument, str) else tool(**argument) for argument in arguments]
    # numbers become text here, where a failure (a 5,000-digit int) is the call's own, not the trainer's
    return [str(r) if isinstance(r, int | float) and not isinstance(r, bool) else r for r in results]


def call_tool(tool: LoadedTool, argument: str | dict, worker: RewardWorker | None = None,
              timeout_s: float | None = None, within_s: float | None = None) -> ToolResult:
    """One call, in a worker of the tool (`worker`, or its own) within `timeout_s` (its own limit unless given)
    and `within_s` its worker's start included, or in process without a limit; never raises."""
    worker = worker or tool.worker
    if worker is not None:
        tag, out = worker.call([argument], {}, timeout_s, within_s)
    else:
        tag, out = call_in_process(call_each, [argument], {"tool": tool.fn})
    return result_of(tag, out)


def close_tools(tools: list[LoadedTool]) -> None:
    """End the tools' workers (at the end of a run; a killed trainer's workers exit on their own)."""
    for tool in tools:
        for worker in [tool.worker, *tool.spares] if tool.worker is not None else []:
            worker.close()
    if (env := environment_of(tools)) is not None:
        env.close()
    sandbox.settle()  # the last sandboxed calls' cgroups, removed off the calls' path
