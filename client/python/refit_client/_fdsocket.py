"""The daemon's descriptor socket (``<grpc socket>.fd``), where descriptors
cross between processes (SCM_RIGHTS): an engine redeems its attach ticket
there for the arena's descriptors, a trainer deposits a region's descriptor
with its registration ticket.

The daemon serves a bounded number of these connections at once and answers
one more with a "busy" refusal at once (or, when the refusal crosses the
ticket, resets the connection or closes it under the ticket), and a connect
to a socket whose backlog is full fails with EAGAIN; all are retried here,
until the caller's timeout, and then raise Unavailable.
"""

from __future__ import annotations

import os
import socket
import time
from typing import List, Optional, Tuple

from .errors import Unavailable

# The daemon's answers when it cannot serve one more connection now: as
# many as it takes are being served (from this process, or from all), or it
# has no thread for another.
_BUSY = (b"Etoo many attach connections", b"Erefitd cannot serve this connection now")

# Descriptors one answer carries at most (the daemon sends up to 4).
_MAX_FDS = 4


def exchange(path: str, ticket: str, timeout: float, fd: Optional[int] = None) -> Tuple[bytes, List[int]]:
    """Sends `ticket` (and the descriptor `fd`, if given) and returns the
    daemon's whole answer and the descriptors it carried (the caller owns
    them). Unavailable when the daemon stayed too busy to serve it until
    `timeout`."""
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        try:
            reply, fds = _exchange_once(path, ticket, max(deadline - time.monotonic(), 0.001), fd)
        except (ConnectionResetError, BrokenPipeError):
            reply, fds = _BUSY[0] + b" (the connection was reset)", []
        except BlockingIOError:
            # connect() with the socket's backlog full: EAGAIN at once,
            # whatever the timeout.
            reply, fds = _BUSY[0] + b" (its backlog is full)", []
        if not reply.startswith(_BUSY):
            return reply, fds
        for received in fds:
            os.close(received)
        if time.monotonic() + delay >= deadline:
            text = reply[1:].decode(errors="replace").strip()
            raise Unavailable(
                f"the daemon's descriptor socket {path} stayed busy for {timeout:g} s ({text}): "
                "retry"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def _exchange_once(path: str, ticket: str, timeout: float,
                   fd: Optional[int]) -> Tuple[bytes, List[int]]:
    line = (ticket + "\n").encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(path)
        except (FileNotFoundError, PermissionError, ConnectionRefusedError) as e:
            raise type(e)(e.errno, f"{e.strerror}: the daemon's descriptor socket {path}") from None
        if fd is None:
            s.sendall(line)
        else:
            socket.send_fds(s, [line], [fd])
        reply = b""
        fds: List[int] = []
        try:
            while True:
                part, received, _flags, _addr = socket.recv_fds(s, 4096, _MAX_FDS)
                fds.extend(received)
                if not part:
                    break
                reply += part
        except BaseException:
            for received in fds:
                os.close(received)
            raise
    return reply, fds
