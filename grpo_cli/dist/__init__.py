"""Several processes and nodes: who this process is (ranks.py), FSDP2 for the models (shard.py), and
`grpo train dist.nproc_per_node=N` starting itself under torchrun's agent (launch.py).

At world size 1 every piece hands its input back, so the training loop never branches on
"is this distributed".
"""

from grpo_cli.dist.ranks import COLLECTIVE_SECONDS, Dist, contiguous_share

__all__ = ["COLLECTIVE_SECONDS", "Dist", "contiguous_share"]
