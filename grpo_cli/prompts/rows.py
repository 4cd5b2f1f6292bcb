"""Prompt sources -> (train rows, held-out rows), and the `grpo export` command.

`data.source` is one of:
  builtin:NAME          a generator in grpo_cli.tasks (makes num_train + num_heldout problems)
  path/to/file.jsonl    local rows, one JSON object per line (also .json)
  path/to/file.parquet  local rows
  hub:owner/name[@split] a dataset on the Hugging Face hub (split defaults to data.split)

A row is a dict; `data.prompt_column` holds the question (text, or a conversation: a list of chat messages,
rendered by the chat template; prompts.py) and every other column (e.g. `answer`) is kept, so reward
functions receive it by name.

Held-out rows for file and hub sources: the last `num_heldout` rows after a
shuffle seeded by `data.seed`, or the first `num_heldout` rows of
`data.heldout_source` when set (e.g. the heldout.jsonl that `grpo export` wrote).
Train rows whose question also appears in the held-out set are dropped, so the
two never share a question.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from grpo_cli import hub
from grpo_cli.errors import UsageError, one_line
from grpo_cli.prompts.images import attach_images, image_name, row_images
from grpo_cli.prompts.templates import conversation_problem, is_conversation, prompt_key
from grpo_cli.tasks import BUILTIN_TASKS

FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


# ---------------------------------------------------------------------------
# reading rows


def _first_bad_json_line(path: Path) -> str | None:
    """datasets' JSON errors do not name the line; find it ourselves."""
    rows = 0
    try:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                rows += 1
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    return f"line {lineno} is not valid JSON ({e.msg} at column {e.colno})"
                if not isinstance(row, dict):
                    return f"line {lineno} is not a JSON object"
    except (OSError, UnicodeDecodeError) as e:
        return one_line(e)
    return None if rows else "it has no rows"


def _quiet_datasets() -> Any:
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def read_file_rows(path_text: str, key: str = "data.source") -> list[dict]:
    """Rows of a local .jsonl/.json/.parquet file, in file order."""
    path = Path(path_text)
    if path.suffix not in FILE_SUFFIXES:
        raise UsageError(f"{key}: '{path_text}' is not a .jsonl, .json or .parquet file "
                         "(or use builtin:NAME, hub:owner/name)")
    if not path.is_file():
        raise UsageError(f"{key}: file '{path_text}' not found")
    if path.stat().st_size == 0:
        raise UsageError(f"{key}: '{path_text}' is empty")
    datasets = _quiet_datasets()
    builder = "parquet" if path.suffix == ".parquet" else "json"
    try:
        dataset = datasets.load_dataset(builder, data_files=str(path.resolve()), split="train")
    except Exception as e:
        why = (_first_bad_json_line(path) if path.suffix == ".jsonl" else None) or one_line(e)
        raise UsageError(f"{key}: cannot read '{path_text}': {why}") from None
    return dataset.to_list()


def read_hub_rows(spec: str, default_split: str, key: str = "data.source", hub_config: str | None = None) -> list[dict]:
    """Rows of `hub:owner/name[@split]` (configuration `hub_config`) through datasets.load_dataset."""
    name, _, split = spec.removeprefix("hub:").partition("@")
    split = split or default_split
    if not name:
        raise UsageError(f"{key}: '{spec}' names no dataset; write hub:owner/name")
    hub.settle()  # an unreachable hub: the cache only, and a quick failure instead of half a minute of retries
    datasets = _quiet_datasets()
    try:
        dataset = datasets.load_dataset(name, hub_config, split=split)
    except Exception as e:
        raise UsageError(f"{key}: cannot load hub dataset '{name}' (split '{split}'): {one_line(e)}"
                         f"{hub.offline_note()}") from None
    return dataset.to_list()


def read_rows(source: str, default_split: str, key: str = "data.source", hub_config: str | None = None) -> list[dict]:
    if source.startswith("hub:"):
        return read_hub_rows(source, default_split, key, hub_config)
    return read_file_rows(source, key)


def rename_columns(rows: list[dict], renames: dict[str, str], source: str) -> list[dict]:
    """Rows with columns renamed {old: new} (data.rename_columns); a missing old name is an error."""
    if not renames or not rows:
        return rows
    for old, new in renames.items():
        if old not in rows[0]:
            raise UsageError(f"data.rename_columns: '{source}' has no column '{old}' (columns: {', '.join(rows[0])})")
        if new in rows[0] and new not in renames:
            raise UsageError(f"data.rename_columns: renaming '{old}' to '{new}' would overwrite the column '{new}'")
    return [{renames.get(k, k): v for k, v in row.items()} for row in rows]


def check_rows(rows: list[dict], prompt_column: str, source: str, key: str = "data.source", *,
               template: str) -> None:
    """Fail at the edge: no rows, no prompt column, or a row whose prompt is neither text nor a well-formed
    conversation (chat messages, which need data.template=chat)."""
    if not rows:
        raise UsageError(f"{key}: '{source}' has no rows")
    if prompt_column not in rows[0]:
        raise UsageError(f"data.prompt_column: '{source}' has no column '{prompt_column}' "
                         f"(columns: {', '.join(rows[0])}); set data.prompt_column=NAME")
    for i, row in enumerate(rows):
        prompt = row.get(prompt_column)
        where = f"{key}: '{source}' row {i} (counting from 0): column '{prompt_column}'"
        if is_conversation(prompt):
            if problem := conversation_problem(prompt):
                raise UsageError(f"{where} holds chat messages, but {problem}")
            if template != "chat":
                raise UsageError(f"{where} holds chat messages, which go through the model's chat template; set "
                                 "data.template=chat")
        elif not isinstance(prompt, str) or not prompt.strip():
            what = "missing" if prompt is None else "empty" if isinstance(prompt, str) else "not text"
            raise UsageError(f"{where} is {what} (a prompt is text or a list of chat messages)")


# ---------------------------------------------------------------------------
# splitting


def builtin_splits(data: Any) -> tuple[list[dict], list[dict]]:
    name = data.source.removeprefix("builtin:")
    if name not in BUILTIN_TASKS:
        raise UsageError(f"data.source: unknown builtin task '{name}'; available: "
                         + ", ".join(f"builtin:{n}" for n in BUILTIN_TASKS))
    if data.heldout_source:
        raise UsageError("data.heldout_source: a builtin generator makes its own held-out set; "
                         "set data.heldout_source=null or use a file source")
    try:
        train, heldout = BUILTIN_TASKS[name](data.num_train, data.num_heldout, data.seed, tuple(data.tiers))
    except ValueError as e:
        raise UsageError(f"data: {e}") from None
    return [p.to_row() for p in train], [p.to_row() for p in heldout]


def split_rows(rows: list[dict], heldout: list[dict] | None, data: Any) -> tuple[list[dict], list[dict]]:
    """Train and held-out rows that share no question; held-out has exactly data.num_heldout rows."""
    n = data.num_heldout
    if heldout is None:
        if len(rows) <= n:
            raise UsageError(f"data.source: '{data.source}' has {len(rows)} rows, but data.num_heldout={n} "
                             "leaves none to train on; lower data.num_heldout")
        order = list(range(len(rows)))
        random.Random(data.seed).shuffle(order)
        heldout = [rows[i] for i in order[-n:]]
        rows = [rows[i] for i in order[:-n]]
    elif len(heldout) < n:
        raise UsageError(f"data.heldout_source: '{data.heldout_source}' has {len(heldout)} rows, "
                         f"fewer than data.num_heldout={n}; lower data.num_heldout")
    else:
        heldout = heldout[:n]
    held_questions = {problem_key(row, data) for row in heldout}
    train = [row for row in rows if problem_key(row, data) not in held_questions]
    if not train:
        raise UsageError(f"data.source: every row of '{data.source}' repeats a held-out question; nothing to train on")
    return train, heldout


def problem_key(row: dict, data: Any) -> tuple:
    """What makes two rows the same problem: the question and, in rows with images, the images (by name: a
    path, or a hash of the pixels), so one question asked of two pictures is two problems."""
    return prompt_key(row[data.prompt_column]), tuple(map(image_name, row_images(row, data.image_column)))


def hub_sources(data: Any) -> list[str]:
    """The recipe's data sources on the hub (`grpo check` leaves them to the run: no hub is needed to check)."""
    return [s for s in (data.source, data.heldout_source) if s and s.startswith("hub:")]


def load_splits(data: Any) -> tuple[list[dict], list[dict]]:
    """DataConfig -> (train rows, held-out rows); every check happens here, before any model loads."""
    if data.source.startswith("builtin:"):
        train, heldout = builtin_splits(data)
        check_rows(train, data.prompt_column, data.source, template=data.template)
        attach_images(train, data.image_column, data.source)
        attach_images(heldout, data.image_column, data.source)
        return train, heldout
    rows = rename_columns(read_rows(data.source, data.split, hub_config=data.hub_config), data.rename_columns,
                          data.source)
    check_rows(rows, data.prompt_column, data.source, template=data.template)
    attach_images(rows, data.image_column, data.source)
    heldout = None
    if data.heldout_source:
        heldout = rename_columns(read_rows(data.heldout_source, data.split, key="data.heldout_source",
                                           hub_config=data.hub_config), data.rename_columns, data.heldout_source)
        check_rows(heldout, data.prompt_column, data.heldout_source, key="data.heldout_source",
                   template=data.template)
        attach_images(heldout, data.image_column, data.heldout_source, key="data.heldout_source")
    return split_rows(rows, heldout, data)


# ---------------------------------------------------------------------------
# `grpo export`


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")


def images_as_files(rows: list[dict], column: str | None, out: Path) -> list[dict]:
    """Rows whose images are written as PNG files under out/images/ (named as completions.jsonl names them),
    the column holding their paths relative to `out`, which is how a data file gives them back."""
    if not rows or not any(row_images(row, column) for row in rows[:1]):
        return rows
    (out / "images").mkdir(exist_ok=True)
    written: set[str] = set()
    exported = []
    for row in rows:
        paths = []
        for image in row_images(row, column):
            stem = image_name(image).removesuffix(".png").replace("/", "_").replace(":", "_")
            path = f"images/{stem}.png"
            if path not in written:
                image.save(out / path)
                written.add(path)
            paths.append(path)
        exported.append({**row, column: paths[0] if len(paths) == 1 else paths})
    return exported


def run_export(config: Any, run_dir: Any) -> int:
    """`grpo export recipe=NAME out=DIR`: write DIR/train.jsonl and DIR/heldout.jsonl."""
    train, heldout = load_splits(config.data)
    out = Path(config.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"out: '{config.out}' exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        train, heldout = (images_as_files(rows, config.data.image_column, out) for rows in (train, heldout))
        write_jsonl(out / "train.jsonl", train)
        write_jsonl(out / "heldout.jsonl", heldout)
    except OSError as e:
        raise UsageError(f"out: cannot write into '{config.out}': {one_line(e)}") from None
    print(f"wrote {len(train)} train rows to {out / 'train.jsonl'}")
    print(f"wrote {len(heldout)} held-out rows to {out / 'heldout.jsonl'}")
    print(f"train on them with: data.source={out / 'train.jsonl'} data.heldout_source={out / 'heldout.jsonl'}")
    return 0


class PromptCursor:
    """The train rows in a seeded order, reshuffled (seed + step) at each new epoch."""

    def __init__(self, num_rows: int, seed: int) -> None:
        self.num_rows, self.seed = num_rows, seed
        self.order = random.Random(seed).sample(range(num_rows), num_rows)  # row indices, this epoch's order
        self.position = 0  # index into `order` of the next prompt

    def take(self, count: int, step: int) -> list[int]:
        """The next `count` row indices; an epoch that runs out mid-step continues in a new order."""
        rows = []
        for _ in range(count):
            if self.position == len(self.order):  # a new epoch, in a new seeded order
                self.order = random.Random(self.seed + step).sample(range(self.num_rows), self.num_rows)
                self.position = 0
            rows.append(self.order[self.position])
            self.position += 1
        return rows

    def state_dict(self) -> dict[str, Any]:
        import torch  # here, not at the top: data.py is on the torch-free config path (grpo check reads it)

        return {"order": torch.tensor(self.order), "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.order, self.position = state["order"].tolist(), state["position"]
