"""Images in prompt rows: what a row may hold, reading every one before any model loads, and their names.

A row of a vision-language recipe holds its pictures in `data.image_column` (default `image`): one image or a
list of them, each
  - a path to an image file, relative to the data file's directory (or absolute),
  - the file's bytes,
  - a PIL image (a built-in task's rows; a `datasets` Image column decoded),
  - a `datasets` Image column as stored: {"bytes": ..., "path": ...}.
`attach_images` reads them all once, at load, into RGB PIL images (an unreadable or missing one fails its row
in one line), and names each: its path when it came from one, else `sha1:` and 12 hex digits of its pixels
(a built-in task may name its own). completions.jsonl records the names, not the pixels.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

from grpo_cli.errors import UsageError, one_line

NAME_KEY = "name"  # where an image's name lives: its PIL `info` dict


class ImageProblem(ValueError):
    """An image that cannot be read; the message says why (attach_images adds the row)."""


def is_image(value: Any) -> bool:
    """A PIL image (without importing PIL)."""
    return type(value).__module__.startswith("PIL.")


def image_name(image: Any) -> str:
    """The name an image was given at load (`attach_images`), or the hash of its pixels."""
    name = image.info.get(NAME_KEY) if hasattr(image, "info") else None
    return name or "sha1:" + hashlib.sha1(image.mode.encode() + repr(image.size).encode() + image.tobytes()).hexdigest()[:12]


def _open(data: bytes | Path, what: str) -> Any:
    """`what` names the source in a message: "image file 'x.png'" or "the image's bytes"."""
    from PIL import Image, UnidentifiedImageError

    verb = "are" if isinstance(data, bytes) else "is"
    try:
        image = Image.open(io.BytesIO(data) if isinstance(data, bytes) else data)
        image.load()
    except FileNotFoundError:
        raise ImageProblem(f"{what} not found") from None
    except UnidentifiedImageError:  # its message quotes an object's address: not worth a line
        raise ImageProblem(f"{what} {verb} not in an image format PIL reads") from None
    except Image.DecompressionBombError:  # a header that claims more pixels than PIL will decode
        raise ImageProblem(f"{what} claim{'' if verb == 'are' else 's'} more than PIL's limit of "
                           f"{2 * Image.MAX_IMAGE_PIXELS:,} pixels") from None
    except (OSError, ValueError) as e:  # a truncated file, a damaged stream
        raise ImageProblem(f"{what} {verb} not a readable image ({one_line(e)})") from None
    return image


def load_image(value: Any, base_dir: Path | None) -> Any:
    """One image of a row as an RGB PIL image, its name in `info`."""
    from PIL import Image

    name = None
    if isinstance(value, dict) and ("bytes" in value or "path" in value):  # a datasets Image column, undecoded
        value, name = (value["bytes"], value.get("path")) if value.get("bytes") else (value.get("path"), None)
    if isinstance(value, Image.Image):
        image, name = value, value.info.get(NAME_KEY)
    elif isinstance(value, (bytes, bytearray)):
        image = _open(bytes(value), "the image's bytes")
    elif isinstance(value, str) and value.strip():
        path = Path(value)
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        image, name = _open(path, f"image file '{value}'"), value
    else:
        kind = "nothing" if value in (None, "", b"") else f"a value of type {type(value).__name__}"
        raise ImageProblem(f"{kind} where an image goes (a path, bytes, a PIL image or a datasets Image)")
    if image.width < 1 or image.height < 1:
        raise ImageProblem("an image of no pixels")
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    rgb.info[NAME_KEY] = name or image_name(rgb)
    return rgb


def attach_images(rows: list[dict], column: str | None, source: str, key: str = "data.source") -> bool:
    """Read every row's images (`column`) into RGB PIL images, in place; True when the rows carry images.

    A column that no row has: text rows (False). A row without images among rows with them, or one whose image
    cannot be read, fails in one line naming the row. Paths are relative to the data file's directory."""
    if not column or not rows or not any(column in row and row[column] is not None for row in rows):
        return False
    base_dir = Path(source).parent if not source.startswith(("builtin:", "hub:")) else None
    for i, row in enumerate(rows):
        value = row.get(column)
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        where = f"{key}: '{source}' row {i} (counting from 0): column '{column}'"
        if not values or value is None:
            raise UsageError(f"{where} has no image, and other rows have; give every row its images (or set "
                             "data.image_column=null for text rows)")
        try:
            row[column] = [load_image(v, base_dir) for v in values]
        except ImageProblem as e:
            raise UsageError(f"{where}: {e}") from None
    return True


def row_images(row: dict, column: str | None) -> list[Any]:
    """The images `attach_images` read into a row ([] for a text row)."""
    return list(row.get(column) or []) if column else []


class Vision:
    """A vision-language model's processor, as a run uses it: the token a template writes where an image goes,
    the tokens each image becomes (`expand`, as the processor and vLLM expand it), and the pixel values the
    trainer's passes feed (`pixels`). Only the processor's image half is used here: the prompt's text is
    tokenized by the run's tokenizer, as for a text model."""

    def __init__(self, processor: Any, image_column: str) -> None:
        self.processor = processor
        self.image_column = image_column  # data.image_column: where a row's images are
        self.image_token = processor.image_token  # e.g. "<image>" (Idefics3, SmolVLM)
        self.image_token_id = processor.tokenizer.convert_tokens_to_ids(self.image_token)

    def images(self, row: dict) -> list[Any]:
        """A row's images, as `attach_images` read them."""
        return row_images(row, self.image_column)

    def image_tokens(self, image: Any) -> list[int]:
        """The ids one image stands for in a prompt: its markers and its image tokens."""
        return [int(t) for t in self.processor(text=[self.image_token], images=[[image]])["input_ids"][0]]

    def expand(self, prompt_ids: list[int], images: list[Any]) -> list[int]:
        """A prompt's ids with each image token replaced by what its image stands for: the trainer's prompt, the
        same ids vLLM builds from the unexpanded prompt and the images (tests/test_vision.py checks it)."""
        places = [i for i, t in enumerate(prompt_ids) if t == self.image_token_id]
        if len(places) != len(images):
            raise ValueError(f"a prompt holds {len(places)} image tokens for {len(images)} images")
        out, start = [], 0
        for place, image in zip(places, images):
            out += prompt_ids[start:place] + self.image_tokens(image)
            start = place + 1
        return out + prompt_ids[start:]

    def pixels(self, images: list[list[Any]]) -> dict[str, Any]:
        """The image processor's tensors for P prompts' images: pixel_values [P, N, C, H, W] (and what else the
        architecture takes, e.g. pixel_attention_mask [P, N, H, W]), N the most images of a prompt."""
        return dict(self.processor.image_processor(images, return_tensors="pt"))
