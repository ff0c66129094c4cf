"""Checks of the paths a run will write, made before the work that fills them.

A model file that cannot be written is found before training, not after it: each
output option is checked when the run starts, and the error names the option.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from fullgraph.errors import ConfigError


def check_output(path: str | Path, option: str, *, directory: bool = False) -> None:
    """Refuse ``path`` unless it can be written as a file (or made a directory).

    The path may not exist yet: its nearest existing ancestor must be a directory this
    process may write to (the missing ones are made when written).

    Args:
        path: where the output goes.
        option: the option that named it (``--save-model``), for the message.
        directory: the output is a directory (a file is refused), else a file (a
            directory is refused).

    Raises:
        ConfigError: naming the option, the path and what is wrong with it.
    """
    p = Path(path).expanduser()
    if not directory and str(path).endswith(("/", os.sep)):
        raise ConfigError(f"{option} {path}: names a directory; give a file name")
    if directory and p.exists() and not p.is_dir():
        raise ConfigError(f"{option} {path}: is a file, not a directory")
    if not directory and p.is_dir():
        raise ConfigError(f"{option} {path}: is a directory; give a file name")
    ancestor = p if directory else p.parent
    ancestor = ancestor.absolute()
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(f"{option} {path}: {ancestor} is a file, not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK) or not _can_create_in(ancestor):
        raise ConfigError(f"{option} {path}: {ancestor} is not writable")
    if not directory and p.exists() and not _can_append(p):
        raise ConfigError(f"{option} {path}: the file is not writable")


def _can_create_in(directory: Path) -> bool:
    """Whether a file can be made in ``directory``, tried (and removed): ``os.access``
    answers yes to root for any directory, /proc and /sys included."""
    try:
        fd, name = tempfile.mkstemp(prefix=".fullgraph-check-", dir=directory)
    except OSError:
        return False
    os.close(fd)
    os.unlink(name)
    return True


def _can_append(path: Path) -> bool:
    """Whether the existing file ``path`` opens for writing (a regular file is opened to
    append, nothing written: its contents and times stay as they are; a pipe or a device
    is only asked, as opening a pipe waits for a reader)."""
    if not os.access(path, os.W_OK):
        return False
    if not path.is_file():
        return True
    try:
        with open(path, "ab"):
            return True
    except OSError:
        return False
