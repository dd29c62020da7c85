import subprocess
import sys

import sparsecorr
from sparsecorr.cli import main


def test_version_flag(capsys):
    try:
        main(["--version"])
    except SystemExit as exc:
        assert exc.code == 0
    assert sparsecorr.__version__ in capsys.readouterr().out


def test_help_lists_subcommands(capsys):
    try:
        main(["--help"])
    except SystemExit as exc:
        assert exc.code == 0
    out = capsys.readouterr().out
    assert "demo" in out


def test_console_script_runs():
    out = subprocess.run(
        [sys.executable, "-m", "sparsecorr.cli", "--version"], capture_output=True, text=True
    )
    assert out.returncode == 0
    assert out.stdout.startswith("sparsecorr ")
