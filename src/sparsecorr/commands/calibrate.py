"""``sparsecorr calibrate``: see `sparsecorr.commands.schedule_cmds`."""

from .schedule_cmds import add_calibrate as add_parser
from .schedule_cmds import run_calibrate as run

__all__ = ["add_parser", "run"]
