"""The ``sparsecorr`` command.

Subcommands live one per module in :mod:`sparsecorr.commands`; each module exposes
``add_parser(subparsers)`` (cheap: builds the argparse parser only) and ``run(args) -> int``
(imports the heavy machinery). ``sparsecorr --help`` therefore starts fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from . import __version__

#: subcommand name -> module under sparsecorr.commands implementing it
SUBCOMMANDS: dict[str, str] = {
    "demo": "sparsecorr.commands.demo",
    "decode": "sparsecorr.commands.decode",
    "calibrate": "sparsecorr.commands.calibrate",
    "schedule": "sparsecorr.commands.schedule",
    "cost": "sparsecorr.commands.cost",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparsecorr",
        description=(
            "Measure, correct and plan sparse rollouts for LLM reinforcement learning "
            "with verifiable rewards."
        ),
    )
    parser.add_argument("--version", action="version", version=f"sparsecorr {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = module.add_parser(sub)
        p.set_defaults(_module=module_name, _name=name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_module", None) is None:
        parser.print_help()
        return 0
    module = importlib.import_module(args._module)
    try:
        return int(module.run(args) or 0)
    except ValueError as exc:  # bad input: one clear line, no traceback
        print(f"sparsecorr {args._name}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
