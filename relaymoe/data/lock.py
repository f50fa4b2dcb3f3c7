"""One ``relaymoe data`` run per output prefix: an exclusive lock on ``PREFIX.lock``.

Two runs on one prefix would make the same parts under the same names and remove each other's
temporaries and parts folder (one of them then failed on a missing ``PREFIX.parts/*.tmp*.idx``).
The second run is refused at once, naming the first one's process id; the lock is the kernel's
(``fcntl.flock``), so it goes with its holder, however that process ends, and a later run takes
it over. The holder removes the file when it is done.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from relaymoe.data.errors import DataError


class PrefixLock:
    """The exclusive lock of one output prefix, held from ``acquire`` to ``release``."""

    def __init__(self, prefix: str):
        self.path = Path(f"{prefix}.lock")
        self.fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise ``DataError`` naming the run that holds it."""
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise DataError(
                    f"--output-prefix: cannot write {self.path} ({e.strerror}); fix: an output "
                    "prefix in a folder you can write"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise DataError(
                    f"another relaymoe data run (process {holder}) is writing this output "
                    f"prefix (it holds {self.path}); fix: wait for it to finish (then rerun: "
                    "a completed output is kept), or give another --output-prefix"
                ) from None
            # the holder before us removes the file when done: a lock on that removed file
            # locks nothing, so take the one the path names now
            if _same_file(fd, self.path):
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd

    def release(self) -> None:
        """Remove the lock file and drop the lock (the file first: a run waiting on this one
        then takes a new file, never this removed one)."""
        if self.fd is None:
            return
        self.path.unlink(missing_ok=True)
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> PrefixLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)
