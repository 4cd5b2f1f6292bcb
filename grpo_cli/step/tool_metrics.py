"""What a step's (or held-out set's) trajectories did with their tools: the metrics of a tool run."""

from __future__ import annotations

from collections import Counter
from typing import Any

from grpo_cli.engines.base import Rollouts


def calls_a_tool(segments: list[dict[str, Any]]) -> bool:
    """Whether a trajectory (its `segments`) holds a tool call."""
    return any(s["role"] == "tool" for s in segments)


def tool_metrics(rollouts: Rollouts) -> dict[str, float]:
    """Per-sample means of a step's (or held-out set's) trajectories: tool calls (all, per tool that was
    called, failed), the share of samples that call one, model turns, model and environment tokens, and
    the share stopped by each cap; and the step's tool time (time/tools: wall seconds with a call running, the
    slowest engine share's; time/tool_late: the seconds its engine stopped for results late at their rejoin
    point (tools.pool); time/tool_calls: the calls' seconds summed; time/tool_wait_max: the most one
    trajectory waited on its own calls, a floor under the step's sampling time however many calls overlap)."""
    samples = [(segments, mask, capped) for seg_group, mask_group, cap_group in
               zip(rollouts.segments, rollouts.model_mask, rollouts.capped)
               for segments, mask, capped in zip(seg_group, mask_group, cap_group)]
    n = max(len(samples), 1)
    calls = [s for segments, _, _ in samples for s in segments if s["role"] == "tool"]
    per_tool = Counter(s["tool"] for s in calls if s["tool"])  # "": a call written badly, of no tool
    caps = Counter(capped for _, _, capped in samples if capped)
    metrics = {
        "tools/calls_per_sample": len(calls) / n,
        "tools/failed_per_sample": sum(not s["ok"] for s in calls) / n,
        "tools/call_share": sum(calls_a_tool(segments) for segments, _, _ in samples) / n,
        "tools/turns_per_sample": sum(sum(s["role"] == "model" for s in segments) for segments, _, _ in samples) / n,
        "tools/model_tokens": sum(sum(mask) for _, mask, _ in samples) / n,
        "tools/env_tokens": sum(len(mask) - sum(mask) for _, mask, _ in samples) / n,
        **{f"tools/calls/{name}": count / n for name, count in sorted(per_tool.items())},
        "tools/timeouts_per_sample": sum(s.get("failure") == "timeout" for s in calls) / n,
        "tools/budget_cuts_per_sample": sum(s.get("failure") == "budget" for s in calls) / n,
        **{f"tools/capped/{cap}": caps[cap] / n
           for cap in ("turn_tokens", "trajectory_tokens", "turns", "tool_calls", "tool_timeouts")},
        "time/tools": max(rollouts.tool_seconds, default=0.0),
        "time/tool_late": max(rollouts.tool_late_s, default=0.0),
        "time/tool_calls": sum(s.get("seconds", 0.0) for s in calls),
        "time/tool_wait_max": max((sum(s.get("seconds", 0.0) for s in segments if s["role"] == "tool")
                                   for segments, _, _ in samples), default=0.0),
    }
    if rollouts.environments:  # an environment: the share whose instance failed (raised, timed out at the end)
        ends = [end for group in rollouts.environments for end in group]
        metrics["tools/environment_failed"] = sum(end.error is not None for end in ends) / n
    return metrics
