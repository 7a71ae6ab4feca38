"""What the PIL-rendered multimodal families share (rlvr.tasks.ui_screens, rlvr.tasks.geometry_drawings):
a white canvas of the chart families' size (rlvr.tasks.charts.SIZE_PX: 192 patches of 14x14, what
configs/vlm.py budgets), Pillow's bundled FreeType font (so a render does not depend on the fonts a
machine has), and the Task whose user message holds the image as a PNG data-URL content part. SFT
records of a family: `python -m rlvr.tasks.rendering` (which looks the family up in the registry, so it
is a command above the families, not part of what they share).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping
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
