"""Int32 words in one device buffer, handed out in runs: where the GPU plugin's model finds every
layer's and sequence's ClusterKV index (one input, ``kvc_index``, however many sequences a step
feeds; each row's recall names its words, :data:`~ov_kvcrush.gpu.layer_inputs.RECALL_FIELDS`),
and where every sequence's scores and slot positions lie (:class:`SlotState`), so that one
launch does a step's method work for all its sequences, each reading its own offsets.

A run is taken first-fit and given back coalesced with its free neighbours; the buffer grows by
doubling (the words held copied over on the device), so a run's offset stays valid. An index is
rebuilt whole every ``cluster_every`` steps (its clusters grow), so runs come and go rarely.
"""

from __future__ import annotations

import bisect
import weakref
from typing import Any

from ov_kvcrush.gpu.device import KernelDevice


class IndexArena:
    """Runs of int32 words in one buffer of ``dev``, growing as they are asked for."""

    FIRST_WORDS = 1 << 14  # the first buffer's words (64 KiB)

    def __init__(self, dev: KernelDevice, align: int = 1) -> None:
        self.dev = dev
        #: every run starts at a multiple of ``align`` words (its size is rounded up to one): where
        #: a run is a buffer of its own, a view that the device aligns (``CL_DEVICE_MEM_BASE_ADDR_ALIGN``)
        self.align = align
        self.capacity = -(-self.FIRST_WORDS // align) * align
        self.buffer: Any = dev.zeros(4 * self.capacity)
        #: how many times the buffer was replaced (a view made before is of the old one)
        self.generation = 0
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # (first word, words), by first word
        #: runs whose :class:`SlotState` was collected, given back at the next take: a collection
        #: may run inside any allocation, so a finalizer must not edit the free list itself
        self._dropped: list[tuple[int, int]] = []

    def words(self, words: int) -> int:
        """What a run of ``words`` words takes: at least one, rounded up to :attr:`align`."""
        return -(-max(int(words), 1) // self.align) * self.align

    @property
    def in_use(self) -> int:
        """Words handed out."""
        return self.capacity - sum(n for _, n in self._free)

    def take(self, words: int) -> int:
        """The first word of a run of ``words`` words (the buffer grown first where no free run
        holds them)."""
        words = self.words(words)
        while self._dropped:
            self.give(*self._dropped.pop())
        while True:
            for i, (start, n) in enumerate(self._free):
                if n >= words:
                    self._free[i : i + 1] = [(start + words, n - words)] if n > words else []
                    return start
            self._grow(words)

    def give(self, start: int, words: int) -> None:
        """The run at ``start`` of ``words`` words back (joined to the free runs beside it)."""
        words = self.words(words)
        i = bisect.bisect(self._free, (start, 0))
        if i < len(self._free) and self._free[i][0] == start + words:  # the next free run
            words += self._free.pop(i)[1]
        if i and sum(self._free[i - 1]) == start:  # the previous one
            start, words = self._free[i - 1][0], self._free[i - 1][1] + words
            self._free.pop(i - 1)
            i -= 1
        self._free.insert(i, (start, words))

    def give_later(self, start: int, words: int) -> None:
        """:meth:`give`, at the next :meth:`take` (safe inside a garbage collection)."""
        self._dropped.append((start, words))

    def _grow(self, words: int) -> None:
        old = self.capacity
        new = max(2 * old, old + words)
        grown = self.dev.empty(4 * new)  # a run's words are what its last owner left: each owner writes its own
        self.dev.copy_bytes(self.buffer, grown, 4 * old, 0)
        self.buffer, self.capacity = grown, new
        self.generation += 1
        self.give(old, new - old)


class SlotState:
    """A device buffer of a layer's per-slot state (a method's scores, the slots' positions): a
    run of a pool's :class:`IndexArena` where the device makes views (then :attr:`offset` says
    where it lies, for the kernels that serve every sequence of a step in one launch), else a
    buffer of its own (:attr:`offset` None). Take :attr:`buffer` at each use: the arena's buffer
    is replaced when it grows. The run goes back to the arena when the state is dropped (the
    in-order queue runs the commands using it before any that the next owner enqueues)."""

    def __init__(self, dev: KernelDevice, nbytes: int, arena: IndexArena | None = None) -> None:
        self.nbytes = max(int(nbytes), 4)
        self._arena = arena
        self._view: tuple[int, Any] | None = None
        if arena is None:
            self._own: Any = dev.empty(self.nbytes)
            self.offset: int | None = None
            return
        self.offset = arena.take(-(-self.nbytes // 4))
        weakref.finalize(self, arena.give_later, self.offset, -(-self.nbytes // 4))

    @property
    def buffer(self) -> Any:
        if self._arena is None or self.offset is None:
            return self._own
        arena = self._arena
        if self._view is None or self._view[0] != arena.generation:
            self._view = (arena.generation, arena.dev.view(arena.buffer, 4 * self.offset, self.nbytes))
        return self._view[1]
