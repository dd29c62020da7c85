"""Atomic writes honour the umask (not mkstemp's 0600), keep a replaced file's mode, leave no
temporary behind on failure; output paths are checked before any work."""

import os

import pytest

from sparsecorr._io import (
    atomic_write_bytes,
    atomic_write_json,
    check_writable_dir,
    check_writable_file,
    current_umask,
)


@pytest.fixture
def umask():
    old = os.umask(0o022)
    os.umask(old)

    def set_mask(mask):
        os.umask(mask)

    yield set_mask
    os.umask(old)


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002, 0o027])
def test_new_files_get_0666_minus_umask(tmp_path, umask, mask):
    umask(mask)
    assert current_umask() == mask
    path = atomic_write_json(tmp_path / "sub" / "a.json", {"x": 1})
    assert (path.stat().st_mode & 0o777) == 0o666 & ~mask
    with open(tmp_path / "plain", "w"):  # what a plain open gives
        pass
    assert (path.stat().st_mode & 0o777) == ((tmp_path / "plain").stat().st_mode & 0o777)


def test_replacing_keeps_the_files_mode(tmp_path, umask):
    umask(0o022)
    path = tmp_path / "a.bin"
    path.write_bytes(b"old")
    path.chmod(0o640)
    atomic_write_bytes(path, b"new")
    assert path.read_bytes() == b"new" and (path.stat().st_mode & 0o777) == 0o640


def test_a_failed_write_keeps_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "a.bin"
    path.write_bytes(b"old")

    def boom(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        atomic_write_bytes(path, b"new")
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["a.bin"]


def test_writable_checks(tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    assert check_writable_dir("--out", tmp_path / "new" / "dir").is_dir()
    with pytest.raises(ValueError, match=r"--out: expected a directory, got an existing file"):
        check_writable_dir("--out", a_file)
    with pytest.raises(ValueError, match=r"--out: cannot write to the directory"):
        check_writable_dir("--out", a_file / "sub")
    assert check_writable_file("out", tmp_path / "d" / "s.json") == tmp_path / "d" / "s.json"
    with pytest.raises(ValueError, match=r"out: expected a file path, got the directory"):
        check_writable_file("out", tmp_path)
    with pytest.raises(ValueError, match=r"out: the parent .* is a file"):
        check_writable_file("out", a_file / "s.json")
    assert not [p for p in tmp_path.rglob(".write-check*")]


def test_calibration_plot_is_written_atomically(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import torch

    from sparsecorr.commands.schedule_cmds import plot_table
    from sparsecorr.schedules import CalibrationTable

    table = CalibrationTable(budgets=[8], bin_size=10, n_bins=2)
    table.add(8, torch.full((1, 20), 0.9), torch.ones(1, 20, dtype=torch.bool))
    path = plot_table(table, tau=0.86, path=tmp_path / "calibration.png")
    first = path.read_bytes()
    assert first[:8] == b"\x89PNG\r\n\x1a\n"

    def crash(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        plot_table(table, tau=0.5, path=path)
    assert path.read_bytes() == first and sorted(p.name for p in tmp_path.iterdir()) == ["calibration.png"]
