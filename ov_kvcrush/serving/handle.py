"""What a caller holds for a request served by continuous batching: its status, its tokens as they
come, its result; the pipeline pushes tokens and the end into it from its worker thread."""

from __future__ import annotations

import threading
from enum import Enum

from ov_kvcrush.engines.base import GenerationResult
from ov_kvcrush.errors import UserError


class GenerationStatus(Enum):
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


class GenerationHandle:
    """One submitted request: its status, its tokens as they come, and its result."""

    def __init__(self, request_id: int) -> None:
        self.request_id = request_id
        self.status = GenerationStatus.RUNNING
        self.error = ""
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._tokens: list[int] = []
        self._read = 0
        self._result: GenerationResult | None = None
        self.cancel_requested = False

    def can_read(self) -> bool:
        """New tokens since the last :meth:`read`."""
        with self._lock:
            return len(self._tokens) > self._read

    def read(self) -> list[int]:
        """The token ids generated since the last call (no wait)."""
        with self._lock:
            new = self._tokens[self._read :]
            self._read = len(self._tokens)
            return new

    def cancel(self) -> None:
        """Stop at the next step; the result keeps what was generated."""
        self.cancel_requested = True

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Wait for the request's end; raises :class:`UserError` when it failed."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} not finished within {timeout} s")
        if self.status is GenerationStatus.FAILED:
            raise UserError(f"request {self.request_id} failed: {self.error}")
        assert self._result is not None
        return self._result

    # -- the pipeline's side --------------------------------------------------------------------
    def push_token(self, token: int) -> None:
        """The pipeline: a new token of the request."""
        with self._lock:
            self._tokens.append(token)

    def finish(self, status: GenerationStatus, result: GenerationResult | None, error: str = "") -> None:
        """The pipeline: the request ended (its waiters wake)."""
        self.status, self._result, self.error = status, result, error
        self._done.set()


__all__ = ["GenerationHandle", "GenerationStatus"]
