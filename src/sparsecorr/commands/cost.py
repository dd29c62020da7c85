"""``sparsecorr cost``: see `sparsecorr.commands.schedule_cmds`."""

from .schedule_cmds import add_cost as add_parser
from .schedule_cmds import run_cost as run

__all__ = ["add_parser", "run"]
