"""Atomic file writes and up-front checks of output paths.

A write goes to a temporary file in the same directory, is flushed and fsynced, gets the
permissions a plain ``open(path, "w")`` would give (``0o666`` minus the process umask, or the
mode of the file it replaces), and is renamed over the target; the directory entry is then
fsynced. Readers see the old file or the new one, never half of one.

``check_writable_dir`` / ``check_writable_file`` let a command refuse an unusable output path
*before* any expensive work starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
import threading
from pathlib import Path
from typing import Any

__all__ = [
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "check_writable_dir",
    "check_writable_file",
    "current_umask",
]

_UMASK_LOCK = threading.Lock()


def current_umask() -> int:
    """The process umask (read without changing it where the OS allows, else set and restore)."""
    try:  # Linux: no window where the umask is 0
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def _target_mode(path: Path) -> int:
    """Mode for a new file at ``path``: the replaced file's mode, else ``0o666 & ~umask``."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return 0o666 & ~current_umask()


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (readers see the old file or the new, never half).

    The file gets the mode of the file it replaces, or ``0o666 & ~umask`` when new (as
    ``open(path, "w")`` would), not ``mkstemp``'s private ``0o600``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = _target_mode(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return path


def _fsync_dir(directory: Path) -> None:
    """Persist the rename (best effort: some platforms cannot open a directory)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """`atomic_write_bytes` of UTF-8 text."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike[str], obj: Any, *, indent: int = 2) -> Path:
    """`atomic_write_text` of ``obj`` as JSON."""
    return atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=False) + "\n")


def check_writable_dir(name: str, path: str | os.PathLike[str]) -> Path:
    """Raise ``ValueError`` naming ``name`` unless ``path`` is (or can be made) a writable directory.

    Creates the directory (and parents) if needed, and proves it writable by creating and
    removing a temporary file in it.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{name}: expected a directory, got an existing file {path}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path, prefix=".write-check.", suffix=".tmp")
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        raise ValueError(f"{name}: cannot write to the directory {path} ({exc.strerror or exc})") from None
    return path


def check_writable_file(name: str, path: str | os.PathLike[str]) -> Path:
    """Raise ``ValueError`` naming ``name`` unless a file can be written at ``path``.

    ``path`` must not be a directory; its parent is created if needed and must be writable.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{name}: expected a file path, got the directory {path}")
    if path.parent.exists() and not path.parent.is_dir():
        raise ValueError(f"{name}: the parent {path.parent} of {path} is a file, not a directory")
    check_writable_dir(name, path.parent)
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{name}: {path} exists and is not writable")
    return path
