"""CallExpiry: deadlines for the first messages of a gRPC stream that is a
lease (an engine's Attach, a trainer's RegisterRegion). Such a call has no
deadline of its own, since it lives as long as the lease; the handshake at
its start is bounded by cancelling the call instead, and the reason is
kept for the error the caller raises."""

from __future__ import annotations

import threading
from typing import Any, List, Optional


class CallExpiry:
    """Cancels `call` once a deadline set with after() passes, unless
    finish() came first. Thread-safe."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._lock = threading.Lock()
        self._done = False
        self.why: Optional[str] = None  # set when it cancelled the call
        self._timers: List[threading.Timer] = []

    def after(self, seconds: float, why: str) -> None:
        """Cancels the call in `seconds` (with `why` as the reason)."""
        timer = threading.Timer(seconds, self._expire, args=(why,))
        timer.daemon = True
        self._timers.append(timer)
        timer.start()

    def _expire(self, why: str) -> None:
        with self._lock:
            if not self._done and self.why is None:
                self.why = why
                self._call.cancel()

    def finish(self) -> Optional[str]:
        """Stops the timers; the reason if one cancelled the call first."""
        for timer in self._timers:
            timer.cancel()
        with self._lock:
            self._done = True
            return self.why
