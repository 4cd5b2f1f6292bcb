"""data.*: where prompts come from, how they are rendered and which a step draws."""

from __future__ import annotations

from dataclasses import dataclass, field

from grpo_cli.config.errors import require

# How a completion marks its final answer (data.answer_format); grpo_cli/rewards/answers.py reads each.
ANSWER_FORMATS = ("answer_line", "answer_tag", "boxed", "hash")
# data.instruction's default. No worked example in it: a model that copies an example answer must not score with it.
CHAT_INSTRUCTION = "Solve the problem step by step. Put only the final answer in <answer></answer> tags."



# Names of the prompt samplers' table in grpo_cli/prompts/pool.py (KEEP), spelled out so validation imports no pool code.
SAMPLER_NAMES = ("uniform", "skip_settled", "signal_by_column")


@dataclass
class SamplerConfig:
    """Which training prompts a step draws (docs/sampling.md). Every sampler walks the same seeded order; one that
    is not uniform passes over some prompts at their turn, judged on their groups already scored."""

    name: str = "uniform"  # "uniform" (every prompt at its turn) | "skip_settled" (GRESO: pass over a prompt whose last `visits` groups were settled) | "signal_by_column" (SEC: favour the values of `column` whose recent groups carried signal)
    visits: int = 1  # skip_settled: the prompt's last visits that must all be settled before it is passed over
    band: list[float] = field(default_factory=lambda: [0.0, 1.0])  # [low, high]: a group whose pass rate is <= low or >= high is settled (no signal); the default is all wrong or all right
    floor: float = 0.1  # the probability that a prompt the sampler would pass over is taken anyway (a settled prompt comes back)
    max_skips: int = 4  # a prompt passed over this many times in a row is taken at its next turn (none starves)
    column: str = "tier"  # signal_by_column: the dataset column whose values are tracked (bike pricing and Countdown: tier)
    decay: float = 0.95  # signal_by_column: per recorded group, the weight of a value's old signal share (EMA)

    def __post_init__(self) -> None:
        require(self.name in SAMPLER_NAMES, "data.sampler.name",
                f"'{self.name}' is not one of {', '.join(SAMPLER_NAMES)}")
        require(self.visits >= 1, "data.sampler.visits", "must be >= 1")
        require(len(self.band) == 2 and 0.0 <= self.band[0] < self.band[1] <= 1.0, "data.sampler.band",
                f"{list(self.band)} must be [low, high] with 0 <= low < high <= 1")
        require(0.0 < self.floor <= 1.0, "data.sampler.floor", "must be in (0, 1]: 0 would let a prompt starve")
        require(self.max_skips >= 0, "data.sampler.max_skips", "must be >= 0")
        require(0.0 <= self.decay < 1.0, "data.sampler.decay", "must be in [0, 1)")


@dataclass
class DataConfig:
    source: str = "builtin:bike_pricing"  # builtin:NAME (generator) | path/to/file.jsonl | path/to/file.parquet | hub:owner/dataset
    split: str = "train"  # split name when source is a hub dataset
    hub_config: str | None = None  # the hub dataset's configuration (subset), e.g. "main" for openai/gsm8k; None = its default
    prompt_column: str = "question"  # column holding the question: text given to the template, or chat messages (data.template=chat only)
    rename_columns: dict[str, str] = field(default_factory=dict)  # file/hub rows: {old: new} column names, e.g. {solution: answer}, applied first
    num_train: int = 20000  # problems generated for training (builtin sources only)
    num_heldout: int = 200  # fixed-size held-out set used for evaluation (never shares a question with train)
    heldout_source: str | None = None  # file or hub:owner/name[@split] with the held-out rows (e.g. an exported heldout.jsonl); None = carve them out of source
    template: str = "plain"  # prompt rendering: "plain" (shipped model) | "chat" (tokenizer chat template + <answer> instruction)
    system_prompt: str | None = None  # chat template only: the system message; None = none
    instruction: str | None = CHAT_INSTRUCTION  # chat template only: appended to the question in the user message; None = none
    answer_format: str = "answer_line"  # how the final answer is marked: "answer_line" (Answer: X) | "answer_tag" (<answer>X</answer>) | "boxed" (\\boxed{X}) | "hash" (#### X)
    image_column: str | None = "image"  # rows with this column carry images (a path, bytes, a PIL or datasets image, or a list of them) for a vision-language model; rows without it are text; None = never read images
    tiers: list[int] = field(default_factory=lambda: [1, 2, 3])  # difficulty tiers to draw (builtin bike_pricing)
    seed: int = 1234  # generator seed; fixes the problems and the train/held-out split
    sampler: SamplerConfig = field(default_factory=SamplerConfig)  # which training prompts a step draws (held-out evaluation always uses all)

    def __post_init__(self) -> None:
        require(self.template in ("plain", "chat"), "data.template",
                f"'{self.template}' is not one of plain, chat")
        require(self.answer_format in ANSWER_FORMATS, "data.answer_format",
                f"'{self.answer_format}' is not one of {', '.join(ANSWER_FORMATS)}")
        require(self.num_train > 0, "data.num_train", "must be > 0")
        require(self.num_heldout > 0, "data.num_heldout", "must be > 0")
