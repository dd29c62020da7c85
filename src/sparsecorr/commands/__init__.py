"""Subcommands of the ``sparsecorr`` CLI, one module each (see :mod:`sparsecorr.cli`)."""
