"""What the PIL-rendered multimodal families share (rlvr.tasks.ui_screens, rlvr.tasks.geometry_drawings):
a white canvas of the chart families' size (rlvr.tasks.charts.SIZE_PX: 192 patches of 14x14, what
configs/vlm.py budgets), Pillow's bundled FreeType font (so a render does not depend on the fonts a
machine has), and the Task whose user message holds the image as a PNG data-URL content part. SFT records of a family:

    python -m rlvr.tasks.rendering ui_table_train.jsonl --family=ui_table --level=0 --count=256 [--held_out]
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from rlvr.tasks.base import Family, Task
from rlvr.tasks.charts import SIZE_PX, ChartReadingFamily, exact_number, png_task

__all__ = ["SIZE_PX", "RenderedFamily", "canvas", "exact_number", "font", "image_of", "image_task", "png_bytes"]


def canvas() -> tuple[Image.Image, ImageDraw.ImageDraw]:
    """A white RGB image of SIZE_PX and its drawing context."""
    image = Image.new("RGB", SIZE_PX, "white")
    return image, ImageDraw.Draw(image)


def font(size: int) -> ImageFont.FreeTypeFont:
    """Pillow's bundled font (Aileron) at `size` pixels (Pillow >= 10.1 with FreeType)."""
    return ImageFont.load_default(size=size)


def image_task(image: Image.Image, question: str, answer: str, verifier: Mapping[str, Any],
               metadata: Mapping[str, Any]) -> Task:
    """`image` as a PNG before `question` (rlvr.tasks.charts.png_task)."""
    return png_task(png_bytes(image), question, answer, verifier, metadata)


def png_bytes(image: Image.Image) -> bytes:
    """`image` encoded as PNG."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def image_of(task: Task) -> Image.Image:
    """The RGB image a rendered task shows (decoded from its data URL)."""
    data = task.messages[0]["content"][0]["image"].split(",", 1)[1]
    return Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB")


class RenderedFamily(Family):
    """Base of the rendered families: domain "multimodal", levels from the subclass's `LEVELS` table,
    and SFT chat records with the image (as rlvr.tasks.charts writes them)."""

    domain = "multimodal"
    LEVELS: Mapping[int, Any] = {}

    def levels(self) -> list[int]:
        return sorted(self.LEVELS)

    chat_record = ChartReadingFamily.chat_record


def main(argv: Sequence[str] | None = None) -> None:
    """Write SFT chat records (JSONL, the image inline) of a multimodal family at one level."""
    import argparse
    import json

    from rlvr.tasks.base import HELD_OUT, TRAIN
    from rlvr.tasks.registry import FAMILIES

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("path")
    parser.add_argument("--family", required=True, help="ui_table, ui_form, geometry_drawings, chart_bars")
    parser.add_argument("--count", type=int, default=256)
    parser.add_argument("--level", type=int, default=0)
    parser.add_argument("--held_out", action="store_true", help="the held-out task stream")
    args = parser.parse_args(argv)
    if args.family not in FAMILIES or FAMILIES[args.family](seed=0).domain != "multimodal":
        parser.error(f"--family={args.family!r}: not a family with images; use ui_table, ui_form, geometry_drawings "
                     "or chart_bars")
    family = FAMILIES[args.family](seed=0)
    with open(args.path, "w") as f:
        for index in range(args.count):
            task = family.task(index, HELD_OUT if args.held_out else TRAIN, args.level)
            f.write(json.dumps(family.chat_record(task)) + "\n")


if __name__ == "__main__":
    main()
