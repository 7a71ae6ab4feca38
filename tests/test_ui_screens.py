"""The UI-screenshot families (rlvr.tasks.ui_screens): the screenshot shows the cells and buttons the answer is
computed from, in the boxes the layout says; the right reading scores 1, wrong cells, rows, buttons and
malformed answers score 0."""

import numpy as np

from rlvr.tasks.base import HELD_OUT
from rlvr.tasks.rendered import image_of
from rlvr.tasks.ui_screens import (
    FIELD_VALUES,
    FORMS,
    MONTHS,
    PRIMARY,
    UIFormFamily,
    UITableFamily,
    button_boxes,
    cell_box,
    render_table,
)


def _scores(family, task, answers):
    return [family.score(task, text, False)["correct"] for text in answers]


def _changed_inside(image, changed, box) -> bool:
    """`changed` differs from `image`, and only strictly inside `box` (the text fits its cell)."""
    rows, cols = np.nonzero(np.abs(np.asarray(image, int) - np.asarray(changed, int)).sum(-1))
    left, top, right, bottom = box
    return rows.size > 0 and left < cols.min() and cols.max() < right and top < rows.min() and rows.max() < bottom


def test_ui_table_shows_its_cells_and_scores_only_the_right_reading():
    family = UITableFamily(seed=0)
    for level in family.levels():
        for index in range(2):
            task = family.task(index, HELD_OUT, level)
            meta = task.metadata
            values, row, column, total = np.array(meta["values"]), meta["row"], meta["column"], meta["total_column"]
            want = {"row_total": values[row].sum(), "cell": values[row, column],
                    "column_total": values[:, column].sum()}[meta["kind"]]
            assert task.answer == str(want)
            # the screenshot is the table of the metadata's values, and each cell is drawn inside its box
            header = ["#", "Item", *MONTHS[:values.shape[1]], *(["Total"] if total else [])]
            rows = [[r + 1, item, *v, *([sum(v)] if total else [])] for r, (item, v) in
                    enumerate(zip(meta["items"], values.tolist(), strict=True))]
            assert np.array_equal(np.asarray(image_of(task)), np.asarray(render_table("Fruit sold", header, rows)))
            shown = len(header) - 1 if meta["kind"] == "row_total" and total else 2 + column
            changed = [list(r) for r in rows]
            changed[row][shown] = 888
            box = cell_box(row + 1, shown, values.shape[1], total)
            assert _changed_inside(image_of(task), render_table("Fruit sold", header, changed), box)
            wrong = [f"<answer>{want + 1}</answer>", f"<answer>{want - 1}</answer>", str(want), "<answer></answer>",
                     f"<answer>{want} apples</answer>", *(text for _, text in family.audit_probes(task))]
            assert _scores(family, task, [f"<answer>{want}</answer>", f"so <answer> {want} </answer>"]) == [1, 1]
            assert _scores(family, task, wrong) == [0] * len(wrong), (task.prompt, wrong)
    assert family.task(1, level=0).answer == "7"  # hand-checked: row 3 of its table is Grapes 6 + 1 = 7


def test_ui_form_submit_button_is_the_only_action_and_scores_only_its_label():
    family = UIFormFamily(seed=0)
    actions = {label for _, _, labels in FORMS for label in labels}
    for level in family.levels():
        for index in range(3):
            task = family.task(index, HELD_OUT, level)
            meta = task.metadata
            labels, submit = meta["labels"], meta["submit"]
            assert [label in actions for label in labels] == [i == submit for i in range(len(labels))]
            submits = next(s for title, _, s in FORMS if title == meta["title"])
            assert labels[submit] in submits
            if meta["kind"] == "field":
                field = meta["fields"][meta["asked"]]
                assert task.answer == meta["values"][meta["asked"]] and task.answer in FIELD_VALUES[field]
            else:
                assert task.answer == labels[submit]
            # the primary (blue) colour is drawn inside the submit button only, and only when the level draws it
            pixels = np.asarray(image_of(task)).astype(int)
            blue = np.abs(pixels - [int(PRIMARY[i:i + 2], 16) for i in (1, 3, 5)]).sum(-1) == 0
            left, top, right, bottom = button_boxes(labels)[submit]
            inside = blue[top:bottom + 1, left:right + 1].sum()
            assert (inside > 0, blue.sum() == inside) == (meta["primary_drawn"], True)
            right_answers = [f"<answer>{task.answer}</answer>", f"<answer>{task.answer.upper()}</answer>"]
            wrong = [task.answer, f"<answer>{task.answer}!</answer>", *(text for _, text in family.audit_probes(task))]
            assert _scores(family, task, right_answers) == [1, 1]
            assert _scores(family, task, wrong) == [0] * len(wrong), (task.prompt, wrong)
    probes = dict(family.audit_probes(family.task(0, level=0)))
    assert {"hack:other_button", "hack:all_labels", "hack:title"} <= set(probes)


def test_preview_of_a_vlm_config_counts_each_image_as_the_model_sees_it(capsys):
    """`python -m rlvr.tasks.preview --config=configs/vlm.py` renders image prompts with the VLM's vision config
    (it failed with "needs a VLM policy"): a 224x168 screenshot is 16x12 patches of 14 px, merged 2x2 into 48
    placeholder tokens, shown as one run with its count; the printed length is the prompt's true length."""
    import pathlib
    import re

    from rlvr.models.tokenizer import Tokenizer
    from rlvr.tasks import preview

    configs = pathlib.Path(__file__).resolve().parent.parent / "configs"
    assert preview.main([f"--config={configs / 'vlm.py'}", "--task=ui_table", "--count=1", "--per_level=1"]) == 0
    shown = capsys.readouterr().out
    header, text = re.search(r"--- ui_table level 0 #0: (\d+) tokens ---\n(.*?)\n\|", shown, re.S).groups()
    assert "<|image_pad|>x48<|vision_end|>" in text
    expanded = text.replace("<|image_pad|>x48", "<|image_pad|>" * 48).rstrip("\n") + "\n"
    tokenizer = Tokenizer.from_dir(str(configs / "data" / "vlm_tokenizer"))
    assert len(tokenizer.encode(expanded)) == int(header)
