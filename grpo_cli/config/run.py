"""The whole config of each command: `grpo train`'s sections put together, eval, checkpoints, logging, the
ranks, and the other commands' own keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from grpo_cli.config.data import DataConfig
from grpo_cli.config.errors import require
from grpo_cli.config.model import ModelConfig
from grpo_cli.config.rewards import RewardSpec, check_reward_spec
from grpo_cli.config.rollout import RolloutConfig
from grpo_cli.config.trainer import DistillConfig, TrainerConfig


@dataclass
class EvalConfig:
    every: int = 10  # held-out evaluation every N steps (and at the end); 0 = only at the end
    num_problems: int = 200  # held-out problems used (<= data.num_heldout)
    samples_per_problem: int = 1  # k samples per problem (pass@1 is the mean correctness)
    temperature: float | None = None  # sampling temperature for evaluation; None: rollout.temperature, the training one
    greedy: bool = False  # also measure greedy (temperature 0) accuracy: in grpo eval, and at every held-out evaluation of grpo train (eval/greedy_accuracy)

    def __post_init__(self) -> None:
        require(self.temperature is None or self.temperature >= 0, "eval.temperature",
                "must be >= 0, or null for rollout.temperature")
        require(self.every >= 0, "eval.every", "must be >= 0 (0 = only at the end)")
        require(self.num_problems >= 1, "eval.num_problems", "must be >= 1")
        require(self.samples_per_problem >= 1, "eval.samples_per_problem", "must be >= 1")


@dataclass
class CheckpointConfig:
    every: int = 10  # save a resumable checkpoint every N steps (and at the end); 0 = only at the end
    keep_last: int = 2  # periodic checkpoints kept; older ones are deleted (best and final are kept too)

    def __post_init__(self) -> None:
        require(self.every >= 0, "checkpoint.every", "must be >= 0")
        require(self.keep_last >= 1, "checkpoint.keep_last", "must be >= 1")


@dataclass
class LoggingConfig:
    every: int = 1  # print a metrics line every N steps when stdout is not a terminal
    samples_every: int = 10  # show and save a few sample completions every N steps; 0 = never
    wandb: bool = False  # also log to Weights & Biases (honours WANDB_MODE; offline without a key)
    wandb_project: str = "grpo_cli"  # wandb project name
    zero_variance_threshold: float = 0.9  # warn when at least this fraction of groups is all right or all wrong (no signal)...
    zero_variance_patience: int = 10  # ...for this many consecutive steps (or every reward is 0); one warning per case
    verbose_libraries: bool = False  # show vLLM/datasets/transformers progress bars and log chatter (silenced by default)


@dataclass
class DistConfig:
    """Several processes and nodes (torchrun). With nproc_per_node = nnodes = 1 a run is one process."""

    nproc_per_node: int = 1  # processes on this node; > 1 makes `grpo train` start itself under torchrun
    nnodes: int = 1  # nodes in the job; run the same command on each with its dist.node_rank
    node_rank: int = 0  # this node's index, 0..nnodes-1 (multi-node only)
    rdzv_endpoint: str = "127.0.0.1:29500"  # host:port of node 0, where the nodes meet (multi-node only)
    timeout_s: int = 600  # a collective that waits longer than this fails the job (a rank died or hangs)
    reshard_layers: bool = True  # FSDP2 frees each layer's gathered parameters after its forward and backward (a rank holds its shard + a layer or two: a model larger than one device trains); false keeps the model gathered through each optimizer step (fewer all-gathers); the same numbers either way

    def __post_init__(self) -> None:
        require(self.nproc_per_node >= 1, "dist.nproc_per_node", "must be >= 1")
        require(self.nnodes >= 1, "dist.nnodes", "must be >= 1")
        require(0 <= self.node_rank < self.nnodes, "dist.node_rank",
                f"is {self.node_rank}; it must be in 0..dist.nnodes-1 ({self.nnodes - 1})")
        host, _, port = self.rdzv_endpoint.rpartition(":")
        require(bool(host) and port.isdigit(), "dist.rdzv_endpoint", f"'{self.rdzv_endpoint}' is not HOST:PORT")
        require(self.timeout_s >= 10, "dist.timeout_s", "must be >= 10 seconds")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


@dataclass
class TrainConfig:
    """`grpo train`: everything a run needs. A recipe fills these in; overrides refine them."""

    task: str = MISSING  # task name, used for the run directory and logs (recipes set it)
    output_dir: str = "runs"  # run directories are created under here as TASK/TIMESTAMP-ID
    resume: str | None = None  # continue a run: its directory, or "auto" for the newest resumable run of the task
    model: ModelConfig = field(default_factory=ModelConfig)  # the policy (and the frozen reference's start)
    data: DataConfig = field(default_factory=DataConfig)  # where prompts come from and how they are rendered
    rewards: list[RewardSpec] = field(default_factory=list)  # reward functions, summed with their weights
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # sampling groups of completions
    trainer: TrainerConfig = field(default_factory=TrainerConfig)  # the GRPO update
    distill: DistillConfig = field(default_factory=DistillConfig)  # a teacher that grades each sampled token (on-policy distillation)
    eval: EvalConfig = field(default_factory=EvalConfig)  # held-out evaluation during training
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # what is saved and when
    logging: LoggingConfig = field(default_factory=LoggingConfig)  # console, metrics files, wandb
    dist: DistConfig = field(default_factory=DistConfig)  # processes and nodes (torchrun, FSDP2, a vLLM engine per rank)

    @property
    def trainer_ranks(self) -> int:
        """The ranks that train: every rank, or under rollout.placement=split the first ones, all but the last
        rollout.generator_ranks (docs/async.md)."""
        split = self.rollout.placement == "split"
        return self.dist.world_size - (self.rollout.generator_ranks if split else 0)

    def __post_init__(self) -> None:
        if self.eval.temperature is None:  # held-out samples drawn as the training samples are
            self.eval.temperature = self.rollout.temperature
        if self.trainer.mismatch_correction == "auto":  # samples from older weights: reweigh the gap (docs/async.md)
            self.trainer.mismatch_correction = "tis" if self.rollout.max_staleness else "none"
        require(len(self.rewards) > 0, "rewards", "no reward functions; add e.g. rewards=[{name:correct,weight:1.0}]")
        for i, spec in enumerate(self.rewards):
            require(spec.weight == spec.weight, f"rewards[{i}].weight", "is NaN")
            check_reward_spec(spec, f"rewards[{i}]")
        marked = [f"rewards[{i}] {spec.name}" for i, spec in enumerate(self.rewards) if spec.correctness]
        require(len(marked) == 1 or (len(self.rewards) == 1 and not marked), "rewards",
                f"{len(marked)} rewards are marked correctness: true ({', '.join(marked) or 'none'}); mark exactly one, "
                "the task's correctness check (it gives pass@1, the zero-variance groups and the best checkpoint), "
                "e.g. rewards=[{name:correct,weight:1.0,correctness:true},{name:format,weight:0.1}]")
        checks = [(i, spec) for i, spec in enumerate(self.rewards) if spec.correctness or len(self.rewards) == 1]
        require(self.data.sampler.name == "uniform" or checks[0][1].weight != 0, "data.sampler.name",
                f"{self.data.sampler.name} chooses prompts by their groups' pass rate under the correctness check, "
                f"rewards[{checks[0][0]}] {checks[0][1].name}, which has weight 0 here: the run would choose its prompts "
                "by a score it does not train on (a gold score logged beside a learned reward); use "
                "data.sampler.name=uniform, or give that reward a weight")
        require(self.model.dtype == "float32" or self.rollout.push_check_tol >= 0.02 or not self.rollout.push_check_every,
                "rollout.push_check_tol", f"{self.rollout.push_check_tol} is below {self.model.dtype}'s round-off, "
                "which alone moves the engine's and the trainer's logprobs further; set it to 0.05 (or turn the "
                "check off with rollout.push_check_every=0)")
        require(not (self.rollout.max_staleness and self.trainer.offload_optimizer), "trainer.offload_optimizer",
                "moves AdamW's state out while the engine samples, which with rollout.max_staleness > 0 is while "
                "the trainer steps; turn one of them off")
        require(self.distill.loss_objective != "distill" or not (self.trainer.filter_zero_variance
                                                                  or self.rollout.dynamic_sampling),
                 "distill.objective", "distill trains on every group, whatever its rewards: trainer.filter_zero_variance "
                 "and rollout.dynamic_sampling would drop groups a teacher still grades; turn them off (or use grpo+distill)")
        require(not self.distill.server or self.rollout.temperature == 1.0, "distill.server",
                f"a served teacher's logprobs are of its untempered distribution, and rollout.temperature is "
                f"{self.rollout.temperature:g}: load the teacher in the trainer's process (distill.server=null), "
                "which grades at the sampling temperature")
        for i, spec in enumerate(self.rewards):
            require(spec.server != "start" or self.dist.nnodes == 1, f"rewards[{i}].server",
                    "start runs the reward model's server on this node's loopback, which other nodes cannot reach: "
                    "start it yourself where every node reaches it and give its URL")
        require(self.distill.server != "start" or self.dist.nnodes == 1, "distill.server",
                "start runs the teacher's server on this node's loopback, which other nodes cannot reach: start it "
                "yourself where every node reaches it and give its URL")
        require(self.trainer.minibatches <= self.rollout.prompts_per_step, "trainer.minibatches",
                f"{self.trainer.minibatches} exceeds rollout.prompts_per_step={self.rollout.prompts_per_step}: "
                "minibatches split the step's groups")
        world = self.dist.world_size
        generators = self.rollout.generator_ranks
        require(self.rollout.placement == "colocated" or world > generators, "rollout.placement",
                f"split needs at least one trainer rank besides rollout.generator_ranks={generators}, and the job has "
                f"{world} processes (dist.nproc_per_node={self.dist.nproc_per_node} x dist.nnodes={self.dist.nnodes}); "
                f"e.g. dist.nproc_per_node={generators + 1}")
        world = self.trainer_ranks  # the prompts and the groups are shared between the ranks that train
        require(world % self.rollout.tensor_parallel_size == 0, "rollout.tensor_parallel_size",
                f"{self.rollout.tensor_parallel_size} does not divide the {world} processes (dist.nproc_per_node x "
                "dist.nnodes): each engine spans that many of them")
        require(self.rollout.prompts_per_step % world == 0, "rollout.prompts_per_step",
                f"{self.rollout.prompts_per_step} does not split over {world} processes (dist.nproc_per_node x "
                "dist.nnodes, less a split job's generator ranks); make it a multiple of that count")
        require(not (self.rollout.multi_turn and self.rollout.tool_format == "chat" and self.data.template != "chat"),
                "rollout.tool_format", "chat shows the tools through the chat template; set data.template=chat")
        require(not (self.rollout.multi_turn and self.rollout.engine == "hf" and world > 1),
                "rollout.tools" if self.rollout.tools else "rollout.environment.cls",
                "with rollout.engine=hf at several processes each rank's generate gathers the sharded policy, and "
                "ranks whose trajectories take different numbers of turns would not pair up; use rollout.engine=vllm")
        device = self.trainer.device
        require(not (device.startswith("cuda:") and device != "cuda:0" and self.rollout.engine == "vllm"),
                "trainer.device", f"{device}: the vLLM engine would still start on GPU 0; pick the GPU with "
                f"CUDA_VISIBLE_DEVICES={device.partition(':')[2]} and trainer.device=cuda")
        require(self.eval.num_problems <= self.data.num_heldout, "eval.num_problems",
                f"{self.eval.num_problems} exceeds data.num_heldout={self.data.num_heldout}")


@dataclass
class RewardCommandConfig(TrainConfig):
    """`grpo reward`: score hand-written completions with a recipe's reward functions."""

    cases: str = MISSING  # JSONL file; each line: completion, the dataset columns (e.g. answer), optional expected


@dataclass
class ExportCommandConfig(TrainConfig):
    """`grpo export`: write a recipe's generated problems to JSONL."""

    out: str = MISSING  # output directory; train.jsonl and heldout.jsonl are written inside


@dataclass
class EvalCommandConfig(TrainConfig):
    """`grpo eval`: held-out metrics of checkpoints, sampled the way they were trained.

    The recipe is the run's own RUN_DIR/config.yaml when the checkpoints come from a run
    (run=DIR, or a path RUN_DIR/checkpoints/NAME), else `recipe=NAME`; command-line
    overrides apply on top of either. Uses eval.num_problems, eval.samples_per_problem (k),
    eval.temperature and eval.greedy. Replaces train's `checkpoint` section, which eval
    has no use for, with the checkpoint to evaluate.
    """

    checkpoint: str | None = None  # a checkpoint or HF model directory, or latest | best | base (of run=DIR)
    checkpoints: list[str] = field(default_factory=list)  # several, compared side by side on one engine, e.g. [base,latest]
    run: str | None = None  # the run directory that latest/best/base refer to (default: the run of a checkpoint path)
    samples_jsonl: bool = False  # also write every sample (prompt, completion, rewards) as JSONL beside the JSON
    out: str | None = None  # the JSON file (or a directory for eval.json); None = CHECKPOINT/eval.json, see grpo_cli/evaluate.py

    def __post_init__(self) -> None:
        super().__post_init__()
        require(bool(self.checkpoint) or bool(self.checkpoints), "checkpoint",
                "no checkpoint given; set checkpoint=PATH (or latest|best|base with run=DIR) or checkpoints=[A,B]")
        require(not (self.checkpoint and self.checkpoints), "checkpoints",
                "both checkpoint and checkpoints are set; list every checkpoint in checkpoints=[...]")


@dataclass
class MergeCommandConfig:
    """`grpo merge`: a LoRA checkpoint's adapters merged into its base model, written as one whole Hugging Face
    model directory (needs no recipe)."""

    checkpoint: str = MISSING  # a LoRA checkpoint: adapter_config.json + adapter_model.safetensors (e.g. RUN_DIR/checkpoints/final)
    out: str = MISSING  # the directory to write: config.json, model.safetensors and the tokenizer
    base: str | None = None  # the base model; None = the one its checkpoint.json names (a run's base_model)


@dataclass
class PlotCommandConfig:
    """`grpo plot`: draw one run's metrics.jsonl, or several runs overlaid, into one PNG (needs no recipe)."""

    run: str | None = None  # a run directory holding metrics.jsonl
    runs: list[str] = field(default_factory=list)  # several run directories to overlay, e.g. runs=[A,B]
    out: str | None = None  # PNG path; None = RUN/metrics.png, or ./runs_comparison.png for several runs


# Primary config name of each sub-command in Hydra's ConfigStore.
COMMAND_SCHEMAS: dict[str, Any] = {
    "train": TrainConfig,
    "check": TrainConfig,
    "reward": RewardCommandConfig,
    "export": ExportCommandConfig,
    "eval": EvalCommandConfig,
    "plot": PlotCommandConfig,
    "merge": MergeCommandConfig,
}
