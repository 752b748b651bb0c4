"""Files other processes read while this one writes them, and files in directories another
user owns.

The embedded server's data directory (and its log directory) belong to the user that runs
Postgres; a root process that manages it must never follow a path another user controls
there. So every file this package writes is made afresh (``O_CREAT | O_EXCL``, which
never follows a symbolic link, under a random name) in a directory of the writer's own,
then renamed into place (a rename replaces the entry itself, link or not); every file it
reads in such a directory is opened with ``O_NOFOLLOW`` and must be a regular file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import secrets
import stat
from pathlib import Path

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
MAX_READ = 1 << 20  # what read_regular reads at most (a pid file, a config, a log's tail)


def _fresh(directory: Path, name: str, mode: int, *, dir_fd: int | None = None) -> tuple[int, str]:
    """A new file in ``directory`` (never an existing one, never through a link): its fd
    and its name."""
    for _ in range(100):
        temp = f".{name}.{secrets.token_hex(8)}"
        try:
            target: str | Path = temp if dir_fd is not None else directory / temp
            return os.open(target, _CREATE, mode, dir_fd=dir_fd), temp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(directory))


def replace_atomically(path: Path, text: str, *, mode: int = 0o666) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old file, no file, or the whole
    new text: never an empty or half-written one (a supervisor polls for a ready file and
    reads it as soon as it exists). A new temporary sibling (``mode``, less the umask) is
    renamed over ``path``."""
    fd, temp = _fresh(path.parent, path.name, mode)
    tmp = path.parent / temp
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def place(
    path: Path,
    text: str,
    *,
    staging: Path,
    owner: pwd.struct_passwd | None = None,
    mode: int = 0o600,
) -> None:
    """Put a file with ``text`` at ``path``, owned by ``owner`` (None: as made), whatever
    ``path``'s directory holds: for a root process writing into a directory another user
    owns (the embedded server's data directory).

    The file is made, written, given its owner and mode and synced in ``staging`` (a
    directory of this process's user), then renamed to ``path``: nothing is opened, and
    nothing changes owner, through a name the other user controls. On another file system
    than ``staging`` it is made in ``path``'s directory instead, under a fresh name opened
    with ``O_EXCL | O_NOFOLLOW`` through a descriptor of that directory (itself opened
    without following a link)."""
    fd, temp = _fresh(staging, path.name, 0o600)
    staged = staging / temp
    try:
        _fill(fd, text, owner, mode)
        os.rename(staged, path)
        return
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
    finally:
        staged.unlink(missing_ok=True)
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fd, temp = _fresh(path.parent, path.name, 0o600, dir_fd=directory)
        try:
            _fill(fd, text, owner, mode)
            os.rename(temp, path.name, src_dir_fd=directory, dst_dir_fd=directory)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp, dir_fd=directory)
    finally:
        os.close(directory)


def _fill(fd: int, text: str, owner: pwd.struct_passwd | None, mode: int) -> None:
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        if owner is not None:
            os.fchown(fh.fileno(), owner.pw_uid, owner.pw_gid)
        os.fchmod(fh.fileno(), mode)
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def read_regular(
    path: Path, *, offset: int = 0, limit: int = MAX_READ, owner: int | None = None
) -> str | None:
    """The text of the regular file ``path`` from ``offset`` (at most ``limit`` bytes), or
    None when it is missing, a link, not a regular file (a FIFO would block a reader for
    ever), unreadable, or not owned by ``owner`` (a uid) or linked elsewhere too."""
    try:
        fd = os.open(path, _READ)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None
        if owner is not None and (info.st_uid != owner or info.st_nlink != 1):
            return None
        if offset:
            os.lseek(fd, offset, os.SEEK_SET)
        chunks, left = [], limit
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 16))):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks).decode("utf-8", errors="replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def size_of(path: Path) -> int:
    """The size of the regular file ``path`` (0 when it is missing or not one), read
    without following a link."""
    try:
        info = os.lstat(path)
    except OSError:
        return 0
    return info.st_size if stat.S_ISREG(info.st_mode) else 0
