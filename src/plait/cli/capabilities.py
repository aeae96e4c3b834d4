"""`plait capabilities`: which features combine, generated from the refusals in the code."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "capabilities",
        help="which features combine (the refused pairs, with their reasons)",
        description="Every pair of features (parallelism degrees, ZeRO stages, schedules, "
        "recomputation, compile, dtypes, compression, offload, WSP) that the plan's checks "
        "or the model transform passes refuse, with the reason; every other pair combines.",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from plait.train.capabilities import FEATURES, matrix, render

    if args.json:
        refused = [{"feature": a, "with": b, "reason": why} for a, b, why in matrix()]
        json.dump({"features": [f.name for f in FEATURES], "refused": refused}, sys.stdout)
        print()
    else:
        sys.stdout.write(render())
    return 0
