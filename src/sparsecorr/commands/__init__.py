"""Subcommands of the ``sparsecorr`` CLI, one module each (see `sparsecorr.cli`)."""
