"""Files written atomically (layer 5), and what a killed writer leaves behind.

Every file ggtrain writes (models, adapters, checkpoints, token files, plots) is written under
a temporary name in the final file's folder and renamed over the final name once complete and
synced, so a crash, Ctrl-C or a full disk never leaves half a file under a final name: the
final name holds the previous file, or none.

A temporary is named `.<final name>.<host>-<pid>.<8 hex digits>.tmp` (host: 8 hex digits of
the machine's name and pid namespace). One left by a process that is gone is stale: `remove_stale_temporaries`
removes those of this machine whose process no longer runs, and those of other machines (a
shared folder) older than a day; a run calls it on the folders it writes into.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import socket
import time

OTHER_HOST_STALE_S = 24 * 3600
_TEMPORARY = re.compile(r"^\.(?P<final>.+)\.(?P<host>[0-9a-f]{8})-(?P<pid>\d+)\.[0-9a-f]{8}\.tmp$")


def _host() -> str:
    """The machine, and the pid namespace on it (containers sharing a host name and a folder
    see each other's pids only within one namespace)."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return hashlib.sha256(f"{socket.gethostname()}/{namespace}".encode()).hexdigest()[:8]


def open_temporary(path) -> tuple:
    """(fd, temporary path) of a new, empty file beside `path` (opened for writing, O_EXCL)."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    prefix = f".{os.path.basename(path)}.{_host()}-{os.getpid()}."
    while True:
        tmp = os.path.join(directory, f"{prefix}{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue


def commit(tmp: str, path) -> None:
    """Rename the (synced, closed) temporary `tmp` over `path`, durably."""
    os.replace(tmp, path)
    try:
        dfd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:  # pragma: no cover - some filesystems refuse a folder's fsync
        pass


def discard(tmp: str | None) -> None:
    """Remove a temporary (gone already: nothing to do)."""
    if tmp is not None:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


@contextlib.contextmanager
def atomic_file(path):
    """A binary file to write `path` through: a temporary, synced and committed when the block
    ends, discarded when it raises."""
    fd, tmp = open_temporary(path)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        commit(tmp, path)
    except BaseException:
        discard(tmp)
        raise


def write_atomic(path, data: bytes) -> None:
    """Write `data` to `path` through a temporary."""
    with atomic_file(path) as f:
        f.write(data)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True              # another user's process
    return True


def remove_stale_temporaries(directory) -> list:
    """Remove the temporaries in `directory` whose writer is gone (see the module docstring);
    returns their paths. Files not named like ours are left alone."""
    removed = []
    host, now = _host(), time.time()
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _TEMPORARY.match(name)
        if m is None:
            continue
        full = os.path.join(os.fspath(directory), name)
        try:
            stale = (not _running(int(m["pid"])) if m["host"] == host
                     else now - os.path.getmtime(full) > OTHER_HOST_STALE_S)
            if stale:
                os.unlink(full)
                removed.append(full)
        except OSError:
            pass                 # removed meanwhile, or not ours to remove
    return removed
