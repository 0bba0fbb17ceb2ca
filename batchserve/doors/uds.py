"""The --uds socket file: taken only when free, removed only while it is still ours.

A path that holds something other than a socket (a config file given by mistake), or a
socket another process still listens on (a second instance started on the same path), is
refused at start rather than replaced; a stale socket, left by a process that died without
removing it, is replaced. At exit the path is removed only if it is still the very socket
this process made (same device and inode): a failed start, or a path that another process
has taken over since, is left alone.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import stat

from ..errors import StartupError

log = logging.getLogger("batchserve")


class UnixSocketPath:
    """One --uds path: `claim` before binding, `bound` after, `release` at exit."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._made: tuple[int, int] | None = None
        """(st_dev, st_ino) of the socket this process bound at the path."""

    def __repr__(self) -> str:
        return f"<UnixSocketPath {self.path!r} {'ours' if self._made else 'not ours'}>"

    def claim(self) -> None:
        """Makes the path free to bind, or raises StartupError saying why it cannot be."""
        try:
            mode = os.stat(self.path).st_mode
        except FileNotFoundError:
            return
        except OSError as exc:
            raise StartupError(f"--uds {self.path}: cannot use it: {_cause(exc)}") from None
        if not stat.S_ISSOCK(mode):
            raise StartupError(
                f"--uds {self.path}: something that is not a socket is there; remove it or"
                " choose another path"
            )
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            try:
                probe.connect(self.path)
            except ConnectionRefusedError:
                pass  # nothing listens: stale, below
            except TimeoutError:
                raise StartupError(_in_use(self.path)) from None
            except OSError as exc:
                if exc.errno == errno.EAGAIN:  # a listener whose backlog is full
                    raise StartupError(_in_use(self.path)) from None
                raise StartupError(f"--uds {self.path}: cannot use it: {_cause(exc)}") from None
            else:
                raise StartupError(_in_use(self.path))
        log.info("--uds %s: replacing a stale socket that nothing listens on", self.path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def bound(self) -> None:
        """Remembers the socket just bound at the path as this process's own."""
        made = os.stat(self.path)
        self._made = (made.st_dev, made.st_ino)

    def release(self) -> None:
        """Removes the path if it still is the socket this process made; else leaves it."""
        if self._made is None:
            return
        self._made, made = None, self._made
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            return
        if (now.st_dev, now.st_ino) == made:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        else:
            log.warning("--uds %s: left in place, another process has replaced it", self.path)


def _in_use(path: str) -> str:
    return f"--uds {path}: another process is listening on it; stop it or choose another path"


def _cause(exc: OSError) -> str:
    return os.strerror(exc.errno).lower() if exc.errno else str(exc)
