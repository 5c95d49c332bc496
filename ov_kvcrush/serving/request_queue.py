"""Requests from several threads on one pipeline: served one at a time, first come first served.

An engine holds one KV sequence and one inference request (native ``openvino_genai`` likewise
keeps one scheduler): two generations running on it at once overwrite each other's cache. Seen
before this queue: a second thread's ``generate`` failed with ``Infer Request is busy``, its
error handler reset the shared sequence, and the first thread returned degenerate text without
an error. :class:`RequestQueue` gives each call a ticket and serves tickets in order, so a
request never sees another's half-written state, and an error (with its clean-up) happens while
no other request runs.

A thread already holding the turn may call in again (a pipeline method using another); a thread
interrupted while waiting (or past its ``timeout``) gives its ticket up, so it never blocks the
ones behind it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class RequestQueue:
    """First-come-first-served turns for the requests of one engine (see the module doc)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = 0  # the next ticket handed out
        self._serving = 0  # the ticket whose turn it is
        self._abandoned: set[int] = set()  # tickets of waiters that gave up (interrupted)
        self._owner: int | None = None  # the thread being served
        self._depth = 0

    @property
    def waiting(self) -> int:
        """Requests handed a ticket and not served yet (the one being served excluded)."""
        with self._cond:
            return self._next - self._serving - (self._owner is not None) - len(self._abandoned)

    @contextmanager
    def turn(self, timeout: float | None = None) -> Iterator[None]:
        """Wait for this request's turn, then hold it for the ``with`` block.

        ``timeout``: seconds to wait at most (``None``: as long as it takes); past it the ticket
        is given up and :class:`TimeoutError` raised.
        """
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:  # re-entered by the thread being served
                self._depth += 1
            else:
                ticket = self._next
                self._next += 1
                try:
                    if not self._cond.wait_for(lambda: ticket == self._serving, timeout):
                        raise TimeoutError(f"no turn within {timeout} s ({ticket - self._serving} requests ahead)")
                except BaseException:  # interrupted while waiting: give the ticket up
                    self._abandoned.add(ticket)
                    self._skip_abandoned()
                    self._cond.notify_all()
                    raise
                self._owner, self._depth = me, 1
        try:
            yield
        finally:
            with self._cond:
                self._depth -= 1
                if self._depth == 0:  # the outermost call of the thread served: the next ticket's turn
                    self._owner = None
                    self._serving += 1
                    self._skip_abandoned()
                    self._cond.notify_all()

    def _skip_abandoned(self) -> None:
        while self._serving in self._abandoned:
            self._abandoned.remove(self._serving)
            self._serving += 1
