"""SFT records of a PIL-rendered multimodal family (what they share: rlvr.tasks.rendered):

    python -m rlvr.tasks.rendering ui_table_train.jsonl --family=ui_table --level=0 --count=256 [--held_out]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from rlvr.tasks.base import HELD_OUT, TRAIN
from rlvr.tasks.registry import FAMILIES


def main(argv: Sequence[str] | None = None) -> None:
    """Write SFT chat records (JSONL, the image inline) of a multimodal family at one level."""
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
