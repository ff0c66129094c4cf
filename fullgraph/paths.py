"""Checks of the paths a run will write, made before the work that fills them.

A model file that cannot be written is found before training, not after it: each
output option is checked when the run starts, and the error names the option.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import secrets
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

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


def write_in_place(path: Path, save: Callable[[IO[bytes]], Any]) -> bool:
    """Where ``path`` is a pipe or a device, or a link under ``/dev`` or ``/proc`` (such
    as ``/dev/stdout`` redirected to a file), write what ``save`` writes into it, whole
    (it cannot seek), and return True: an atomic writer's temporary renamed over it
    would replace it by a regular file (or the system's link), and its reader would
    wait forever. False (and nothing written) for another regular file (``/dev/shm``'s
    too) or none.

    Raises:
        OSError: naming ``path``.
    """
    special = path.is_symlink() and path.absolute().parts[1:2] in (("dev",), ("proc",))
    if not path.exists() or path.is_file() and not special:
        return False
    data = io.BytesIO()
    save(data)
    try:
        with open(path, "wb") as f:
            f.write(data.getbuffer())
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from None
    return True


def check_distinct(outputs: Sequence[tuple[str, str | Path]],
                   inputs: Sequence[tuple[str, str | Path]] = ()) -> None:
    """Refuse two outputs, or an output and an input, that name one file (after ``~``,
    links and ``..``): one would silently replace the other (``predict --out`` over its
    own ``--model``, ``--save-model`` over the run's checkpoint or metrics).

    Args:
        outputs: (option, path) of every file the command writes.
        inputs: (option, path) of the files it reads.

    Raises:
        ConfigError: naming both options and the path.
    """
    def same(a: Path, b: Path) -> bool:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
        return a.resolve() == b.resolve()

    named = [(flag, Path(path).expanduser()) for flag, path in outputs]
    read = [(flag, Path(path).expanduser()) for flag, path in inputs]
    for i, (flag, path) in enumerate(named):
        for other, other_path in named[:i] + read:
            if same(path, other_path):
                what = "reads" if (other, other_path) in read else "writes"
                raise ConfigError(f"{flag} {path}: the file {other} {what}; give another "
                                  f"name (it would be replaced)")


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


def sibling_dir(path: Path, tag: str) -> Path:
    """Make and return a new, uniquely named directory beside ``path``
    (``.NAME.TAG-SPACE-PID-RANDOM``, ``SPACE`` from ``process_space``), with the mode
    a plain ``mkdir`` gives (0777 less the umask), not ``tempfile.mkdtemp``'s 0700: it
    becomes ``path`` when renamed into place, which others sharing a dataset root must
    be able to read.

    Such directories left by a process of this host (and pid namespace) that no longer
    runs (one killed with SIGKILL, which no clean-up survives) are removed first."""
    prefix = f".{path.name}.{tag}-{process_space()}-"
    _remove_orphans(path.parent, prefix)
    for _ in range(100):
        candidate = path.parent / f"{prefix}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            candidate.mkdir(mode=0o777)
        except FileExistsError:
            continue
        return candidate
    raise FileExistsError(f"no free temporary name beside {path}")


def process_space() -> str:
    """A short token naming where this process's pids mean what they mean: this host's
    name, its boot and its pid namespace (containers that share a host name, or hosts
    that share one on a shared file system, have others)."""
    parts = [socket.gethostname()]
    for source in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        try:
            parts.append(os.readlink(source) if source.endswith("/pid") else
                         Path(source).read_text().strip())
        except OSError:
            parts.append("?")
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:12]


def _remove_orphans(parent: Path, prefix: str) -> None:
    """Remove the directories ``PREFIX<pid>-<hex>`` in ``parent`` whose process is gone."""
    try:
        names = [e.name for e in os.scandir(parent) if e.name.startswith(prefix)]
    except OSError:  # (no parent yet: nothing left there)
        return
    for name in names:  # (exactly PID-HEX after the prefix)
        found = re.fullmatch(r"(\d+)-[0-9a-f]{8}", name[len(prefix):])
        if found and not process_alive(int(found.group(1))):
            shutil.rmtree(parent / name, ignore_errors=True)


def process_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def sibling_file(path: Path, tag: str) -> tuple[int, str]:
    """Open a new, uniquely named file beside ``path`` for writing, with the mode a
    plain ``open`` gives (0666 less the umask), not ``tempfile.mkstemp``'s 0600; returns
    its descriptor and name."""
    for _ in range(100):
        name = str(path.parent / f".{path.name}.{tag}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), name
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")


_UNFINISHED: set[Path] = set()
"""Temporary files being written now, for ``remove_unfinished``."""


@contextlib.contextmanager
def unfinished(tmp: Path) -> Iterator[Path]:
    """While the block runs, ``tmp`` is a file being written (to be renamed into place
    within the block): removed if the block fails, or by ``remove_unfinished``."""
    _UNFINISHED.add(tmp)
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        _UNFINISHED.discard(tmp)


def remove_unfinished() -> None:
    """Remove the temporary files of the writes under way, for a process that must end
    at once (``os._exit``, past the writers' own clean-up): a worker ended by SIGTERM."""
    for tmp in list(_UNFINISHED):
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
