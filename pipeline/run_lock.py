"""One writer per run folder: an exclusive ``flock`` on ``run.lock``, held for the run's life.

Two runs writing one folder (say, a user resuming a run they believe died while it still runs)
interleave checkpoints and metrics rows, and each resume trims the other's history. The lock
belongs to the open file, so the OS drops it on any exit of the holder, ``kill -9`` included:
there is never a stale lock to clean up, and the file itself may stay. The holder writes its pid
into the file so that the refusal can name it.

Invariant: while a :class:`RunFolderLock` is held, no other process (and no other flow in this
one) holds one on the same folder.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from tandem.core.config import ConfigError

__all__ = ["LOCK_FILE", "RunFolderBusy", "RunFolderLock"]

LOCK_FILE = "run.lock"


class RunFolderBusy(ConfigError):
    """Another live run holds the run folder; the message names the folder and the holder's pid.

    A config error because nothing has run yet, and the way out is in the config (another
    ``run.name`` or ``run.output_dir``) or in waiting for the holder to finish.
    """


class RunFolderLock:
    """The exclusive lock on one run folder: :meth:`acquire` it, :meth:`release` it at the end."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, run_dir: Path) -> RunFolderLock:
        """Lock ``run_dir`` (which must exist) or raise :class:`RunFolderBusy` at once (no waiting)."""
        path = run_dir / LOCK_FILE
        # Not O_TRUNC: the holder's pid must survive a refused opener's open.
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            raise RunFolderBusy(
                f"run folder {run_dir} is in use by another run (pid {holder or 'unknown'}, holding {path}); "
                "wait for it or stop it, or choose another run.name or run.output_dir"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        """Drop the lock (closing the file drops it); idempotent."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
