"""``sparsecorr demo``: the end-to-end demo on an embedded tiny model."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("demo", help="run the end-to-end demo on the embedded tiny model")
    p.add_argument("--quick", action="store_true", help="a shorter run (under 2 minutes)")
    p.add_argument("--out", default="runs/demo", help="output directory (default: runs/demo)")
    return p


def run(args: argparse.Namespace) -> int:
    print("demo not built yet")
    return 0
