"""The ``sparsecorr`` command.

Subcommands live one per module in `sparsecorr.commands`; each module exposes
``add_parser(subparsers)`` (cheap: builds the argparse parser only) and ``run(args) -> int``
(imports the heavy machinery). ``sparsecorr --help`` therefore starts fast. Other
distributions add subcommands through the ``sparsecorr.commands`` entry-point group (the TRL
glue provides ``demo``); a known one that is not installed prints what to install.

Every subcommand's ``--help`` shows the default of every option (`DefaultsHelpFormatter`,
applied here to all subcommands). Bad input is one line on stderr naming the option, exit
status 2; an operating-system error (a full disk, a permission) is one line, exit status 1;
neither prints a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from . import __version__

#: subcommand name -> module under sparsecorr.commands implementing it
SUBCOMMANDS: dict[str, str] = {
    "decode": "sparsecorr.commands.decode",
    "calibrate": "sparsecorr.commands.calibrate",
    "schedule": "sparsecorr.commands.schedule",
    "cost": "sparsecorr.commands.cost",
}

#: entry-point group through which other distributions add subcommands (same module protocol)
PLUGIN_GROUP = "sparsecorr.commands"
#: plug-in subcommands the docs describe -> (help, what to install when it is missing)
KNOWN_PLUGINS: dict[str, tuple[str, str]] = {
    "demo": ("run the end-to-end demo (needs the TRL glue)", "pip install 'sparsecorr[demo]'"),
}


def _plugin_modules() -> dict[str, str]:
    from importlib.metadata import entry_points

    return {ep.name: ep.value for ep in entry_points(group=PLUGIN_GROUP)
            if ep.name not in SUBCOMMANDS}


def _add_missing(sub: argparse._SubParsersAction, name: str, why: str) -> None:
    help_text, install = KNOWN_PLUGINS.get(name, (f"provided by a plug-in ({why})", why))
    sub.add_parser(name, help=help_text, add_help=False).set_defaults(
        _missing=f"not installed: {install}" + (f" ({why})" if why != install else ""), _name=name)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to every optional argument's help, also when it has no help
    text; skipped for required options, for help/version actions, and when the help already
    states its default. Flags read ``(default: off)``."""

    def _format_action(self, action: argparse.Action) -> str:
        help_text = action.help
        if help_text is not argparse.SUPPRESS and _shows_default(action):
            help_text = (help_text or "").rstrip()
            if "default" not in help_text.lower():
                value = "off" if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)) \
                    and action.default is False else "%(default)s"
                help_text = f"{help_text} (default: {value})".lstrip()
        original, action.help = action.help, help_text
        try:
            return super()._format_action(action)
        finally:
            action.help = original


def _shows_default(action: argparse.Action) -> bool:
    skipped = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)
    return bool(action.option_strings) and not action.required and not isinstance(action, skipped)


def _option_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommand parsers of ``parser``, by name."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparsecorr",
        description=(
            "Measure, correct and plan sparse rollouts for LLM reinforcement learning "
            "with verifiable rewards."
        ),
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"sparsecorr {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    plugins = _plugin_modules()
    for name, module_name in {**SUBCOMMANDS, **plugins}.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:  # a plug-in whose dependencies are missing
            if name in SUBCOMMANDS:
                raise
            _add_missing(sub, name, str(exc))
            continue
        p = module.add_parser(sub)
        p.set_defaults(_module=module_name, _name=name)
    for name in KNOWN_PLUGINS.keys() - plugins.keys():
        _add_missing(sub, name, KNOWN_PLUGINS[name][1])
    for p in _option_parsers(parser).values():
        p.formatter_class = DefaultsHelpFormatter
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "_missing", None):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if getattr(args, "_missing", None):
        print(f"sparsecorr {args._name}: {args._missing}", file=sys.stderr)
        return 2
    if getattr(args, "_module", None) is None:
        parser.print_help()
        return 0
    module = importlib.import_module(args._module)
    try:
        return int(module.run(args) or 0)
    except ValueError as exc:  # bad input: one clear line, no traceback
        print(f"sparsecorr {args._name}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the system refused (disk full, permissions): one line, no traceback
        print(f"sparsecorr {args._name}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
