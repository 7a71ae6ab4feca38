"""UI screenshots: procedurally rendered tables and forms (PIL) with verifiable answers.

Two families; each task's user message holds the screenshot as an image content part (rlvr.tasks.rendered).

`ui_table`: a table of fruit sold per month, its rows numbered in a "#" column (numeric verifier, exact):
  0  3 rows, 2 months and a Total column (values 1-9): "what is the total in row k?" (read the Total cell)
  1  4 rows, 3 months (values 1-20): the value in a named column for a named item (a cell lookup)
  2  4 rows, 3 months (values 1-20), no Total column: "what is the total in row k?" (add the row)
  3  5 rows, 4 months (values 10-99): the total of a named month's column

`ui_form`: a form with labelled input boxes and a row of buttons (exact verifier, case-insensitive):
  0  2 buttons, the submitting one drawn as the primary (filled) button: "which button submits?"
  1  3 buttons in a random order, the primary one submits
  2  3-4 buttons drawn alike: only the label (an action such as "Sign up" among "Cancel", "Reset",
     "Back", ...) tells which submits
  3  the fields filled in: "what is entered in the <field> field?"
The answer to "which button submits" is the button's label. `audit_probes` are the answers a reader
of the wrong cell, row or button (or of the question alone) would give.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rlvr.tasks.base import Task, pick
from rlvr.tasks.rendered import SIZE_PX, RenderedFamily, canvas, exact_number, font, image_task

ITEMS = ("Apples", "Pears", "Plums", "Figs", "Limes", "Kiwis", "Dates", "Grapes")
MONTHS = ("Jan", "Feb", "Mar", "Apr")
# level: (rows, months, value range, Total column shown, question kind)
TABLE_LEVELS = {
    0: (3, 2, (1, 9), True, "row_total"),
    1: (4, 3, (1, 20), False, "cell"),
    2: (4, 3, (1, 20), False, "row_total"),
    3: (5, 4, (10, 99), False, "column_total"),
}
TABLE_TOP, ROW_PX, NUMBER_PX, ITEM_PX, MARGIN = 22, 20, 18, 50, 4
GRID, HEADER_FILL, TEXT = "#999999", "#e6e6e6", "#000000"


def table_columns(months: int, total: bool) -> list[tuple[int, int]]:
    """The (left, right) pixel bounds of the table's columns: #, Item, the months, [Total]."""
    numeric = months + int(total)
    width = (SIZE_PX[0] - 2 * MARGIN - NUMBER_PX - ITEM_PX) // numeric
    edges = [MARGIN, MARGIN + NUMBER_PX, MARGIN + NUMBER_PX + ITEM_PX]
    edges += [edges[-1] + width * (i + 1) for i in range(numeric)]
    return list(zip(edges[:-1], edges[1:], strict=True))


def cell_box(row: int, column: int, months: int, total: bool) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of a cell; row 0 is the header, column 0 the "#" column."""
    left, right = table_columns(months, total)[column]
    top = TABLE_TOP + row * ROW_PX
    return left, top, right, top + ROW_PX


def render_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]):
    """A screenshot of a titled table: a grey header row, then `rows` (each: #, item, numbers...)."""
    image, draw = canvas()
    small, bold = font(11), font(12)
    draw.text((MARGIN, 4), title, fill=TEXT, font=bold)
    months = sum(h in MONTHS for h in header)
    total = "Total" in header
    for r, cells in enumerate([header, *rows]):
        for c, cell in enumerate(cells):
            left, top, right, bottom = cell_box(r, c, months, total)
            draw.rectangle((left, top, right, bottom), fill=HEADER_FILL if r == 0 else "white", outline=GRID)
            text = str(cell)
            x = left + 4 if c == 1 else right - 4 - draw.textlength(text, font=small)  # numbers right-aligned
            draw.text((x, top + 4), text, fill=TEXT, font=small)
    return image


class UITableFamily(RenderedFamily):
    name = "ui_table"
    LEVELS = TABLE_LEVELS

    def sample(self, rng: np.random.Generator, level: int) -> Task:
        count, months, (low, high), total, kind = TABLE_LEVELS[level]
        items = [ITEMS[i] for i in sorted(rng.choice(len(ITEMS), count, replace=False))]
        values = rng.integers(low, high + 1, (count, months)).tolist()
        header = ["#", "Item", *MONTHS[:months], *(["Total"] if total else [])]
        rows = [[r + 1, items[r], *values[r], *([sum(values[r])] if total else [])] for r in range(count)]
        row, column = int(rng.integers(count)), int(rng.integers(months))
        if kind == "row_total":
            question, answer = f"What is the total in row {row + 1}?", sum(values[row])
        elif kind == "cell":
            question, answer = f"What is the {MONTHS[column]} value for {items[row]}?", values[row][column]
        else:
            question, answer = f"What is the total of the {MONTHS[column]} column?", sum(v[column] for v in values)
        image = render_table("Fruit sold", header, rows)
        return image_task(image, f"Read the table. {question}", str(answer), exact_number(str(answer)),
                          {"items": items, "values": values, "total_column": total, "kind": kind,
                           "row": row, "column": column})

    def audit_probes(self, task: Task) -> list[tuple[str, str]]:
        """Wrong readings that must score 0: the row number, the asked row's cells listed, the same
        question about the next row (or column), the first cell of the asked row."""
        meta: dict[str, Any] = dict(task.metadata)
        values, row, column, kind = meta["values"], meta["row"], meta["column"], meta["kind"]
        after, beside = (row + 1) % len(values), (column + 1) % len(values[0])
        wrong = {"hack:row_number": row + 1, "hack:first_cell": values[row][0],
                 "hack:next_row": sum(values[after]) if kind == "row_total" else values[after][column]}
        if kind == "column_total":
            wrong["hack:next_column"] = sum(v[beside] for v in values)
        probes = [(k, f"<answer>{v}</answer>") for k, v in wrong.items() if str(v) != task.answer]
        return [("hack:all_cells", f"<answer>{', '.join(map(str, values[row]))}</answer>"), *probes]


# form: (title, fields, labels of the button that submits it)
FORMS = (
    ("Create account", ("Name", "Email"), ("Sign up", "Register", "Create")),
    ("Contact us", ("Name", "Email", "Topic"), ("Send", "Submit")),
    ("Log in", ("Email", "Code"), ("Log in", "Sign in")),
    ("Checkout", ("Name", "City", "Zip"), ("Pay", "Buy now", "Order")),
    ("Find flights", ("From", "To"), ("Search", "Find")),
    ("Profile", ("Name", "City"), ("Save", "Update")),
    ("Newsletter", ("Email",), ("Subscribe", "Join")),
    ("Book a table", ("Name", "Guests", "Date"), ("Book", "Reserve")),
)
OTHER_BUTTONS = ("Cancel", "Reset", "Back", "Clear", "Close", "Help", "Skip")
FIELD_VALUES = {
    "Name": ("Ada Lee", "Sam Hill", "Mia Chen", "Tom Ford", "Eva Ruiz"),
    "Email": ("ada@mail.com", "sam@web.org", "mia@post.net", "tom@box.io"),
    "Topic": ("Billing", "Refund", "Delivery", "Account"),
    "Code": ("4821", "7390", "1456", "9023"),
    "City": ("Lyon", "Oslo", "Porto", "Kyoto", "Lima"),
    "Zip": ("10115", "75001", "02139", "94103"),
    "From": ("Paris", "Rome", "Delhi", "Austin"),
    "To": ("Tokyo", "Cairo", "Quito", "Dublin"),
    "Guests": ("2", "3", "4", "6"),
    "Date": ("12 May", "3 June", "21 July", "8 Aug"),
}
# level: (button counts, the submit button drawn as the primary one, fields filled, question kind)
FORM_LEVELS = {0: ((2,), True, False, "submit"), 1: ((3,), True, False, "submit"),
               2: ((3, 4), False, False, "submit"), 3: ((3,), False, True, "field")}
FIELD_TOP, FIELD_STEP, BOX_LEFT, BUTTON_TOP, BUTTON_PX = 26, 24, 62, 112, 20
PRIMARY, PLAIN, BORDER = "#1a73e8", "#f2f2f2", "#7f7f7f"


def button_boxes(labels: Sequence[str]) -> list[tuple[int, int, int, int]]:
    """(left, top, right, bottom) of each button, laid out left to right, wrapping to a second row."""
    small, boxes, x, top = font(11), [], MARGIN + 4, BUTTON_TOP
    for label in labels:
        width = int(small.getlength(label)) + 16
        if x + width > SIZE_PX[0] - MARGIN:
            x, top = MARGIN + 4, top + BUTTON_PX + 6
        boxes.append((x, top, x + width, top + BUTTON_PX))
        x += width + 8
    return boxes


def render_form(title: str, fields: Sequence[str], values: Sequence[str], labels: Sequence[str],
                primary: int | None):
    """A screenshot of a form: the title, one labelled input box per field (showing `values`), and the
    buttons (button `primary` filled blue, the others grey; None: all grey)."""
    image, draw = canvas()
    small = font(11)
    draw.text((MARGIN, 4), title, fill=TEXT, font=font(13))
    for i, (field, value) in enumerate(zip(fields, values, strict=True)):
        top = FIELD_TOP + i * FIELD_STEP
        draw.text((MARGIN + 4, top + 4), field, fill=TEXT, font=small)
        draw.rectangle((BOX_LEFT, top, SIZE_PX[0] - MARGIN - 4, top + 19), fill="white", outline=BORDER)
        draw.text((BOX_LEFT + 4, top + 4), value, fill=TEXT, font=small)
    for i, (label, box) in enumerate(zip(labels, button_boxes(labels), strict=True)):
        main = i == primary
        draw.rectangle(box, fill=PRIMARY if main else PLAIN, outline=PRIMARY if main else BORDER)
        draw.text((box[0] + 8, box[1] + 4), label, fill="white" if main else TEXT, font=small)
    return image


class UIFormFamily(RenderedFamily):
    name = "ui_form"
    LEVELS = FORM_LEVELS

    def sample(self, rng: np.random.Generator, level: int) -> Task:
        counts, primary_drawn, filled, kind = FORM_LEVELS[level]
        title, fields, submits = pick(rng, FORMS)
        count = int(pick(rng, counts))
        others = [OTHER_BUTTONS[i] for i in rng.choice(len(OTHER_BUTTONS), count - 1, replace=False)]
        labels = [str(pick(rng, submits)), *others]
        order = [int(i) for i in rng.permutation(count)]
        labels = [labels[i] for i in order]
        submit = order.index(0)
        values = [str(pick(rng, FIELD_VALUES[f])) for f in fields] if filled else [""] * len(fields)
        asked = int(rng.integers(len(fields)))
        if kind == "submit":
            question, answer = "Which button submits it? Give its label.", labels[submit]
        else:
            question, answer = f"What is entered in the {fields[asked]} field?", values[asked]
        image = render_form(title, fields, values, labels, submit if primary_drawn else None)
        return image_task(image, f"Look at the form. {question}", answer,
                          {"kind": "exact", "answer": answer, "case_sensitive": False},
                          {"title": title, "fields": list(fields), "values": values, "labels": labels,
                           "submit": submit, "primary_drawn": primary_drawn, "kind": kind, "asked": asked})

    def audit_probes(self, task: Task) -> list[tuple[str, str]]:
        """Wrong readings that must score 0: every other button's label, all labels at once, the form's
        title, the generic "Submit", the asked field's name and the other fields' values."""
        meta: dict[str, Any] = dict(task.metadata)
        labels, want = meta["labels"], task.answer.casefold()
        wrong = [("hack:other_button", label) for label in labels] + [
            ("hack:all_labels", ", ".join(labels)), ("hack:title", meta["title"]), ("hack:generic", "Submit")]
        if meta["kind"] == "field":
            wrong += [("hack:field_name", meta["fields"][meta["asked"]])]
            wrong += [("hack:other_field", value) for value in meta["values"]]
        return [(kind, f"<answer>{text}</answer>") for kind, text in wrong if text.casefold() != want]


UI_FAMILIES = {f.name: f for f in (UITableFamily, UIFormFamily)}
