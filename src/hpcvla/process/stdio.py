"""A rank's standard streams as its launcher reads them.

mpiexec's proxies (Hydra, Open MPI's) and slurmstepd read a rank's stdout and stderr from pipes
and forward them. When a world aborts they stop, and what they have not yet read is lost (on a
loaded machine, all of what an aborting rank has just said). A rank about to abort first
waits, a bounded time, until its pipe is empty.
"""

from __future__ import annotations

import fcntl
import os
import stat
import struct
import termios
import time
from typing import TextIO


def until_forwarded(stream: TextIO, within_s: float = 2.0) -> None:
    """Flush `stream` and wait, at most `within_s`, until whoever reads its pipe has read all
    of it. Nothing to wait for where it is no pipe (a file, a terminal)."""
    try:
        stream.flush()
        fd = stream.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return
        deadline = time.monotonic() + within_s
        while _unread(fd) and time.monotonic() < deadline:
            time.sleep(0.01)
    except (OSError, ValueError):  # closed, or no descriptor (a test's capture): go on
        return


def _unread(fd: int) -> int:
    """The bytes in the pipe `fd` writes to that its reader has not read (FIONREAD, which
    Linux answers for a pipe's writing end too)."""
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]
