"""The train batch: the kept groups `[P', G]` as padded tensors, in minibatches and micro-batches.

The kept groups are split into `trainer.minibatches` parts of whole groups, one optimizer
step each. In a minibatch each prompt is one row of `prompt_ids` `[p, Tp]` (it runs through
the model once); each completion is a row of a micro-batch `[b, Tc]`, with the row of its
prompt, its advantage and the engine's sampling logprobs. Padded once, on the run's device,
and used by the reference pass and every update alike. Each minibatch's loss normalizer is
computed here, once, from the whole minibatch (every rank holds the step's groups), so every
micro-batch on every rank divides by the same number and the gradients of all micro-batches of
all ranks add up to the minibatch's. At world size > 1 each rank trains on its share of each
minibatch's groups (`rank_share`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from grpo_cli.algorithm import grpo
from grpo_cli.algorithm.grpo import LossParams
from grpo_cli.config import TrainerConfig
from grpo_cli.dist import Dist, contiguous_share
from grpo_cli.step.collect import Groups

if TYPE_CHECKING:
    import torch

    from grpo_cli.prompts.images import Vision



def make_micro_batches(lengths: list[int], max_seqs: int, max_tokens: int = 0) -> list[list[int]]:
    """Sequence indices grouped into forward/backward passes, shortest first.

    Sorting by length puts similar lengths together, so little compute goes to padding.
    Each pass holds at most `max_seqs` sequences and, when `max_tokens > 0`, at most
    `max_tokens` padded tokens (rows x longest row); a single longer sequence gets a pass
    of its own. The order does not change the loss: every micro-batch is divided by the
    full batch's normalizer and the gradients add up.
    """
    batches: list[list[int]] = []
    for j in sorted(range(len(lengths)), key=lengths.__getitem__):  # ascending: lengths[j] is the batch's width
        fits = batches and len(batches[-1]) < max_seqs and (
            not max_tokens or (len(batches[-1]) + 1) * lengths[j] <= max_tokens)
        if fits:
            batches[-1].append(j)
        else:
            batches.append([j])
    return batches


def pad_rows(rows: list[list[int]], pad_id: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [n, T] and their float mask [n, T] (1 on real tokens); T is at least 1."""
    import torch

    width = max([1, *map(len, rows)])
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [n, T]
    mask = torch.zeros((len(rows), width), dtype=torch.float32)  # [n, T]
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(row)] = 1.0
    return ids.to(device), mask.to(device)


def pad_values(values: list[list[float]], mask: torch.Tensor) -> torch.Tensor:
    """Per-token values of each completion, right-padded with 0 like `mask` [b, Tc] (and on its device)."""
    import torch

    out = torch.zeros(mask.shape, dtype=mask.dtype)  # [b, Tc]
    for i, row in enumerate(values):
        out[i, : len(row)] = torch.tensor(row[: out.shape[1]], dtype=out.dtype)
    return out.to(mask.device)


@dataclass
class MicroBatch:
    """One forward/backward pass: b completions, length-sorted."""
    rows: list[int]  # the completions' indices in TrainBatch.completions
    prompt_index: torch.Tensor  # [b] row of each completion's prompt in its Minibatch.prompt_ids
    ids: torch.Tensor  # [b, Tc] completion token ids, right-padded
    mask: torch.Tensor  # [b, Tc] 1 on the tokens in the loss: the model's (0 on padding and on tool replies)
    advantages: torch.Tensor  # [b, 1] each completion's advantage
    sampling_logprobs: torch.Tensor  # [b, Tc] the rollout engine's logprob of each sampled token (0 on padding)
    ref_logprobs: torch.Tensor | None = None  # [b, Tc] the frozen reference's, filled in by update.fill_logprobs
    old_logprobs: torch.Tensor | None = None  # [b, Tc] the policy's before the first update (only when the ratio can move)
    teacher_logprobs: torch.Tensor | None = None  # [b, Tc] a distillation teacher's (distill.teacher), by fill_logprobs
    attention_mask: torch.Tensor | None = None  # [b, Tc] 1 on every real token, tool replies too; None = `mask`

    @property
    def attended(self) -> torch.Tensor:
        """[b, Tc] the tokens the passes attend to: the model's and the tools' (padding not)."""
        return self.mask if self.attention_mask is None else self.attention_mask


@dataclass
class Minibatch:
    """The completions of one optimizer step: some of the step's groups, their prompts padded once."""
    prompt_ids: torch.Tensor  # [p, Tp] this minibatch's prompts, right-padded
    prompt_mask: torch.Tensor  # [p, Tp]
    micro_batches: list[MicroBatch]  # its forward/backward passes
    normalizer: float  # its loss normalizer (grpo.NORMALIZERS over all its completions, on every rank)
    rows: list[int] = field(default_factory=list)  # its completions (every rank's) in TrainBatch.completions
    prompt_pixels: dict[str, torch.Tensor] | None = None  # its prompts' images (pixel_values [p, N, C, H, W], ...); None = text


@dataclass
class TrainBatch:
    """The kept groups of a step, ready for the reference pass and the update."""
    prompt_tokens: list[list[int]]  # [P'] the kept prompts' token ids
    completions: list[list[int]]  # [N] completion token ids that enter the loss, group by group
    group_of: list[tuple[int, int]]  # [N] each completion's (slot, g): its kept prompt and place in the group
    loss_masks: list[list[int]] = field(default_factory=list)  # [N][T_i] 1 on the model's tokens (0 on tool replies)
    minibatches: list[Minibatch] = field(default_factory=list)  # trainer.minibatches parts; empty: nothing kept
    train_tokens: int = 0  # prompt tokens x G + completion tokens of the kept groups (each prompt runs once)
    advantages: list[float] = field(default_factory=list)  # [N] each completion's advantage
    sampling_logprobs: list[list[float]] = field(default_factory=list)  # [N][T_i] the engine's, per token
    prompt_images: list[list[Any]] = field(default_factory=list)  # [P'] the kept prompts' images (empty: text rows)

    @property
    def prompt_index(self) -> list[int]:
        """[N] each completion's kept prompt (index into prompt_tokens)."""
        return [slot for slot, _ in self.group_of]

    @property
    def micro_batches(self) -> list[MicroBatch]:
        """Every pass of every minibatch."""
        return [mb for part in self.minibatches for mb in part.micro_batches]

    @classmethod
    def build(cls, groups: Groups, pad_id: int, cfg: TrainerConfig, dist: Dist, loss_params: LossParams,
              vision: Vision | None = None) -> TrainBatch:
        """Kept groups -> completions (truncated ones dropped with trainer.mask_truncated, and those a
        reward with on_failure=drop failed on) -> minibatches of whole groups -> length-sorted
        micro-batches, each padded on the run's device. With images (`vision`), each kept prompt is its ids
        with every image token expanded into the image's tokens, and its minibatch carries the pixel values."""
        kept, G = groups.kept(), groups.group_size
        rollouts = groups.rollouts
        dropped = groups.dropped.tolist()  # [P][G]
        group_of = [(slot, g) for slot, p in enumerate(kept) for g in range(G)
                    if not (cfg.mask_truncated and rollouts.truncated[p][g]) and not dropped[p][g]]
        completions = [rollouts.completion_ids[kept[slot]][g] for slot, g in group_of]  # [N]
        prompt_tokens = [groups.prompt_ids[p] for p in kept]
        images = [vision.images(groups.rows[p]) for p in kept] if vision is not None else []
        if vision is not None:
            prompt_tokens = [vision.expand(ids, imgs) for ids, imgs in zip(prompt_tokens, images)]
        batch = cls(prompt_tokens, completions, group_of, [rollouts.loss_mask(kept[slot], g) for slot, g in group_of],
                    prompt_images=images)
        batch.train_tokens = sum(G * len(ids) for ids in prompt_tokens) + sum(
            len(rollouts.completion_ids[p][g]) for p in kept for g in range(G))
        if not completions:
            return batch
        advantages = groups.advantages.tolist()  # [P][G] python floats
        batch.advantages = [advantages[kept[slot]][g] for slot, g in group_of]  # [N]
        batch.sampling_logprobs = [rollouts.sampling_logprobs[kept[slot]][g] for slot, g in group_of]  # [N][Tc_i]

        parts = [contiguous_share(len(kept), i, cfg.minibatches) for i in range(cfg.minibatches)]
        for slots in [part for part in parts if len(part)]:  # whole groups, the first parts one longer
            rows = [j for j, (slot, _) in enumerate(group_of) if slot in slots]
            batch.minibatches.append(_minibatch(batch, rows, slots, pad_id, cfg, dist, loss_params, vision))
        return batch


def rank_share(slots: range, rank: int, world_size: int) -> range:
    """Rank `rank`'s contiguous part of a minibatch's groups (whole groups, so each prompt runs on one rank);
    empty for some ranks when there are fewer groups than ranks."""
    share = contiguous_share(len(slots), rank, world_size)
    return range(slots.start + share.start, slots.start + share.stop)


def _passes(batch: TrainBatch, rows: list[int], cfg: TrainerConfig) -> list[list[int]]:
    return make_micro_batches([len(batch.completions[j]) for j in rows], cfg.micro_batch_size, cfg.micro_batch_tokens)


def _minibatch(batch: TrainBatch, rows: list[int], slots: range, pad_id: int, cfg: TrainerConfig, dist: Dist,
               loss_params: LossParams, vision: Vision | None = None) -> Minibatch:
    """One optimizer step's completions `rows` (of prompts `slots`): this rank's share of its groups,
    their prompts padded once, micro-batches. Every rank holds the whole step's groups, so the
    normalizer is the whole minibatch's and every rank knows how many passes the others run: a
    rank with fewer pads with empty passes (mask 0), so all run the same forward/backward count
    and FSDP's collectives pair up."""
    import torch

    def rows_of(share: range) -> list[int]:
        return [j for j in rows if batch.group_of[j][0] in share]

    shares = [rank_share(slots, r, dist.world_size) for r in range(dist.world_size)]
    mine = shares[dist.rank]
    my_rows = rows_of(mine)
    num_passes = max(len(_passes(batch, rows_of(share), cfg)) for share in shares)
    prompts = [batch.prompt_tokens[s] for s in mine] or [[pad_id]]  # an idle rank still runs the prompt pass
    pixels = None
    if vision is not None:  # an idle rank runs the minibatch's first prompt, images and all: the same modules as
        # the others (FSDP's gathers pair up); its passes are empty, so nothing of it reaches the loss
        shown = list(mine) or [slots.start]
        prompts = [batch.prompt_tokens[s] for s in shown]
        pixels = {k: v.to(dist.device) for k, v in vision.pixels([batch.prompt_images[s] for s in shown]).items()}
    prompt_ids, prompt_mask = pad_rows(prompts, pad_id, dist.device)  # [p, Tp] x 2
    passes = []
    for local in _passes(batch, my_rows, cfg):
        mb_rows = [my_rows[i] for i in local]
        ids, attended = pad_rows([batch.completions[j] for j in mb_rows], pad_id, dist.device)  # [b, Tc] x 2
        mask = pad_values([batch.loss_masks[j] for j in mb_rows], attended)  # [b, Tc] the model's tokens
        passes.append(MicroBatch(
            rows=mb_rows,
            prompt_index=torch.tensor([batch.group_of[j][0] - mine.start for j in mb_rows], device=dist.device),
            ids=ids, mask=mask,
            advantages=torch.tensor([batch.advantages[j] for j in mb_rows], device=dist.device)[:, None],  # [b, 1]
            sampling_logprobs=pad_values([batch.sampling_logprobs[j] for j in mb_rows], mask),  # [b, Tc]
            attention_mask=None if bool(torch.equal(mask, attended)) else attended,  # [b, Tc] with tool replies
        ))
    while len(passes) < num_passes:  # an empty pass: one pad token, mask 0, so its loss and gradient are 0
        ids, _ = pad_rows([[pad_id]], pad_id, dist.device)  # [1, 1]
        mask = torch.zeros_like(ids, dtype=torch.float32)  # [1, 1]
        passes.append(MicroBatch(rows=[], prompt_index=torch.zeros(1, dtype=torch.long, device=dist.device),
                                 ids=ids, mask=mask, advantages=torch.zeros(1, 1, device=dist.device),
                                 sampling_logprobs=torch.zeros_like(mask)))
    normalizer = minibatch_normalizer([batch.loss_masks[j] for j in rows], cfg.loss, loss_params)
    return Minibatch(prompt_ids, prompt_mask, passes, normalizer, rows, pixels)


def minibatch_normalizer(loss_masks: list[list[int]], loss: str, loss_params: LossParams) -> float:
    """What every micro-batch of a minibatch divides its loss by: grpo.NORMALIZERS[loss] over the loss
    masks of the minibatch's completions in the loss (every rank's, so all ranks divide by the same
    number). A mask is 1 on the model's tokens: a tool run's replies count for no loss."""
    return grpo.NORMALIZERS[loss](pad_rows(loss_masks, 0)[0].float(), loss_params)  # [N, T] masks, 0-padded
