"""`ShardedEngine`: a rank's engine inside a multi-process job (docs/distributed.md)."""

from __future__ import annotations

from grpo_cli.dist.ranks import Dist, contiguous_share
from grpo_cli.engines.base import DelegatingEngine, Engine, Rollouts, Sampling


class ShardedEngine(DelegatingEngine):
    """`generate` samples this engine's share of the prompts (with their own seeds, so a prompt's samples do not
    depend on the world size) and returns every engine's, gathered in prompt order. With
    rollout.tensor_parallel_size = T, ranks T*e .. T*e+T-1 share engine e: they submit the same prompts and
    get the same outputs. Every rank pushes the full weights (each tensor-parallel rank loads its part) and
    runs the push check."""

    def __init__(self, engine: Engine, dist: Dist, tensor_parallel_size: int = 1) -> None:
        super().__init__(engine)
        self.dist, self.tp = dist, tensor_parallel_size

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling, seeds: list[int],
                 rows: list[dict] | None = None) -> Rollouts:
        return self.gather_shares(self.generate_share(prompt_ids, sampling, seeds, rows))

    def generate_share(self, prompt_ids: list[list[int]], sampling: Sampling, seeds: list[int],
                       rows: list[dict] | None = None) -> Rollouts:
        """This engine's share of the prompts, sampled; no collective of its own (an empty share still reaches
        the inner engine: the transformers engine's gather of a sharded policy pairs with the other ranks')."""
        mine = contiguous_share(len(prompt_ids), self.dist.rank // self.tp, self.dist.world_size // self.tp)
        return self.engine.generate(prompt_ids[mine.start:mine.stop], sampling, seeds[mine.start:mine.stop],
                                    rows[mine.start:mine.stop] if rows is not None else None)

    def gather_shares(self, part: Rollouts) -> Rollouts:
        """Every engine's share, in prompt order (a collective)."""
        return Rollouts.concat(self.dist.gather(part)[:: self.tp])  # one copy per engine (its TP ranks agree)
