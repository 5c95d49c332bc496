"""Int32 words in one device buffer, handed out in runs: where the GPU plugin's model finds every
layer's and sequence's ClusterKV index (one input, ``kvc_index``, however many sequences a step
feeds; each row's recall names its words, :data:`~ov_kvcrush.gpu.plugin_layers.RECALL_FIELDS`).

A run is taken first-fit and given back coalesced with its free neighbours; the buffer grows by
doubling (the words held copied over on the device), so a run's offset stays valid. An index is
rebuilt whole every ``cluster_every`` steps (its clusters grow), so runs come and go rarely.
"""

from __future__ import annotations

import bisect
from typing import Any

from ov_kvcrush.gpu.device import KernelDevice


class IndexArena:
    """Runs of int32 words in one buffer of ``dev``, growing as they are asked for."""

    FIRST_WORDS = 1 << 14  # the first buffer's words (64 KiB)

    def __init__(self, dev: KernelDevice) -> None:
        self.dev = dev
        self.capacity = self.FIRST_WORDS
        self.buffer: Any = dev.zeros(4 * self.capacity)
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # (first word, words), by first word

    @property
    def in_use(self) -> int:
        """Words handed out."""
        return self.capacity - sum(n for _, n in self._free)

    def take(self, words: int) -> int:
        """The first word of a run of ``words`` words (the buffer grown first where no free run
        holds them)."""
        words = max(int(words), 1)
        while True:
            for i, (start, n) in enumerate(self._free):
                if n >= words:
                    self._free[i : i + 1] = [(start + words, n - words)] if n > words else []
                    return start
            self._grow(words)

    def give(self, start: int, words: int) -> None:
        """The run at ``start`` of ``words`` words back (joined to the free runs beside it)."""
        words = max(int(words), 1)
        i = bisect.bisect(self._free, (start, 0))
        if i < len(self._free) and self._free[i][0] == start + words:  # the next free run
            words += self._free.pop(i)[1]
        if i and sum(self._free[i - 1]) == start:  # the previous one
            start, words = self._free[i - 1][0], self._free[i - 1][1] + words
            self._free.pop(i - 1)
            i -= 1
        self._free.insert(i, (start, words))

    def _grow(self, words: int) -> None:
        old = self.capacity
        new = max(2 * old, old + words)
        grown = self.dev.zeros(4 * new)
        self.dev.copy_bytes(self.buffer, grown, 4 * old, 0)
        self.buffer, self.capacity = grown, new
        self.give(old, new - old)
