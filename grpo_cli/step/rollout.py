"""A step's sampling: which prompts, from which seeds, with which settings, on the run's engine.

The engines themselves (vLLM, transformers, a split job's generator rank, the tool loop) are in
`grpo_cli.engines`; this module is what the loop asks of them each step: `draw_prompts` takes the step's
prompts from the prompt pool with one seed each (`sample_seeds`), `sample_groups` samples a group of
completions for every prompt, laid out [P][G].
"""

from __future__ import annotations

from typing import Any

from grpo_cli.config import TrainConfig
from grpo_cli.engines.base import Rollouts, Sampling
from grpo_cli.engines.options import logprob_groups
from grpo_cli.step.state import RunState

# Where a step's sampling seeds lie. Training (stream 0) keeps the layout the shipped curves were sampled with:
# below 2**31, step s's block TRAIN_STRIDE * s (widened to whole strides for a step of more samples) after the
# run's start, so steps share no seed for the first 2**31 / stride steps. Every other stream (held-out evaluation,
# dynamic-sampling rounds) has slots of its own above 2**31, one per (run seed, step, stream): a stream offset
# once made evaluation reuse training's seeds past 7,919 samples a step (issue 54).
TRAIN_STRIDE = 104_729  # a prime
SLOT_BITS, STREAM_BITS, STEP_BITS, RUN_BITS = 24, 6, 19, 13  # 2**62 seeds above 2**31: within torch's 64-bit seeds
MAX_STREAM = 2**STREAM_BITS  # streams 1..64 have slots: evaluation and 63 dynamic-sampling rounds


def sample_seeds(run_seed: int, step: int, num_prompts: int, stream: int = 0, group_size: int = 1) -> list[int]:
    """One sampling seed per prompt, a pure function of (run seed, step, prompt, stream).

    Per-request seeds make a step's samples reproducible on resume, whatever the engine sampled before,
    and the same at any world size (each rank's engine gets its prompts' seeds). vLLM seeds sample g of a
    request with seed + g (the tool loop does the same), so prompt i gets base + i * group_size: the G
    samples of every prompt draw from G streams no other sample of the step shares (seeds base + i gave
    sample g of prompt i and sample g-1 of prompt i+1 one stream).
    """
    span = num_prompts * group_size  # the seeds the step's samples use: base .. base + span - 1
    if stream == 0:
        stride = TRAIN_STRIDE * max(1, -(-span // TRAIN_STRIDE))  # whole strides: steps never overlap
        base = (run_seed * 1_000_003 + step * stride) % (2**31 - span - 1)
    else:
        if not 1 <= stream <= MAX_STREAM or span > 2**SLOT_BITS:
            raise ValueError(f"sample_seeds: stream {stream} (1..{MAX_STREAM}) of {span} samples (at most "
                             f"{2**SLOT_BITS}) has no slot")
        slot = ((run_seed % 2**RUN_BITS) << STEP_BITS | step % 2**STEP_BITS) << STREAM_BITS | (stream - 1)
        base = 2**31 + (slot << SLOT_BITS)
    return [base + i * group_size for i in range(num_prompts)]


def sample_groups(state: RunState, cfg: TrainConfig, step: int, round_index: int = 0
                  ) -> tuple[list[dict[str, Any]], list[list[int]], Rollouts]:
    """Draw the step's prompts and sample a group of completions for each: [P][G].

    Seeds are a pure function of (run seed, step, round, prompt): round 0 uses the training
    stream 0, a dynamic-sampling round r >= 1 the stream r + 1 (stream 1 is evaluation's).
    """
    rows, prompt_ids, sampling, seeds = draw_prompts(state, cfg, step, round_index)
    return rows, prompt_ids, state.engine.generate(prompt_ids, sampling, seeds, rows)


def draw_prompts(state: RunState, cfg: TrainConfig, step: int, round_index: int = 0
                 ) -> tuple[list[dict[str, Any]], list[list[int]], Sampling, list[int]]:
    """The step's prompts from the prompt pool: their rows, token ids, the sampling settings and one seed each."""
    r_cfg, task = cfg.rollout, state.task
    rows = [task.train_rows[i] for i in state.pool.take(r_cfg.prompts_per_step, step)]
    prompt_ids = [task.encode(row) for row in rows]
    stream = 0 if round_index == 0 else round_index + 1
    seeds = sample_seeds(cfg.trainer.seed, step, len(rows), stream, r_cfg.group_size)
    return rows, prompt_ids, training_sampling(cfg, seeds), seeds


def training_sampling(cfg: TrainConfig, seeds: list[int]) -> Sampling:
    """How a training step samples its prompts (`seeds`, one each, in the step's order): the prompts whose samples
    bring their sampling logprobs back are named by seed (`engines.options.logprob_groups`), so which ones they
    are does not depend on how the prompts are shared between ranks."""
    r_cfg, groups = cfg.rollout, logprob_groups(cfg)
    asked = None if groups is None else frozenset(seeds[:groups])
    return Sampling(r_cfg.group_size, r_cfg.temperature, r_cfg.top_p, r_cfg.max_new_tokens, logprob_seeds=asked)
