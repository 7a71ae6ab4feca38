"""The chart-reading family (rlvr.tasks.charts): the rendered pixels encode the values the answer is
computed from, the reference answer scores 1, the audit's wrong readings score 0, tasks re-pose exactly."""

import base64
import io

import numpy as np
from PIL import Image

from rlvr.tasks.charts import ChartReadingFamily, size_px


def _bar_heights(task, level: int) -> list[int]:
    """Pixel height of each bar, measured in the PNG by its colour (bars are drawn without antialiasing)."""
    data = task.messages[0]["content"][0]["image"].split(",", 1)[1]
    pixels = np.asarray(Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB")).astype(int)
    assert pixels.shape[:2] == size_px(level)[::-1]
    heights = []
    for color in task.metadata["colors"]:
        rgb = np.array([int(color[i:i + 2], 16) for i in (1, 3, 5)])
        rows = np.nonzero((np.abs(pixels - rgb).sum(-1) == 0).any(axis=1))[0]
        heights.append(int(rows.max() - rows.min() + 1))
    return heights


def test_charts_show_their_values_and_score_only_the_right_reading():
    family = ChartReadingFamily(seed=0)
    for level in family.levels():
        for index in range(3):
            task = family.task(index, level=level)
            values = np.array(task.metadata["values"])
            heights = np.array(_bar_heights(task, level))
            # heights proportional to values (a pixel of rounding at each end)
            slope, offset = np.polyfit(values, heights, 1) if len(set(values)) > 1 else (heights[0] / values[0], 0)
            assert abs(offset) <= 2 and np.abs(heights - slope * values - offset).max() <= 1.5, (values, heights)
            assert int(task.answer) == sum(values[i] for i in task.metadata["asked"])
            assert family.score(task, family.reference_completion(task), False)["correct"] == 1.0
            for kind, completion in family.audit_probes(task):
                assert family.score(task, completion, False)["reward"] == 0.0, (kind, completion, task.answer)
    again = ChartReadingFamily(seed=0).task(1, level=2)
    assert again.messages == family.task(1, level=2).messages
    record = family.chat_record(again)
    assert record["messages"][-1] == {"role": "assistant", "content": f"<answer>{again.answer}</answer>"}
