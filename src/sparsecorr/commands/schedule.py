"""``sparsecorr schedule``: see `sparsecorr.commands.schedule_cmds`."""

from .schedule_cmds import add_schedule as add_parser
from .schedule_cmds import run_schedule as run

__all__ = ["add_parser", "run"]
