"""A step's block tables kept on the device across steps and sent as they change (issue 71: a
decode step's bytes to the device at most 1 % of the KV bytes it reads).

Between two decode steps a sequence's tables change by a block now and then (a block taken every
``block_size`` tokens, one given back when an eviction empties it): sent whole, they were most of
what a step sends (at 4 x 8,000 tokens, the full cache's 32 KB a step of 33 KB; MiniKV's 2-bit
tables 1.3 % of what it reads). :class:`TableMirror` keeps the tables the model read last on the
device and their host copy; each step sends the words that differ as (index, value) pairs, which
one kernel writes in place (``snapkv.cl``'s ``set_elements``, queued before the model's step, after
the previous step's work that reads them), or the whole where the tables' shape changed or most of
them did (a sequence joining or leaving the step moves every row after it). Every table of a step
lies in one buffer, each a view of its own, so a step writes its changes with one command.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from ov_kvcrush.gpu.device import round_up
from ov_kvcrush.gpu.pool import DevicePool


@dataclass(frozen=True)
class TablePlace:
    """Where one table lies in the mirror's buffer: its shape and its first word."""

    shape: tuple[int, ...]
    offset: int

    @property
    def words(self) -> int:
        return int(np.prod(self.shape))


@dataclass
class TableMirror:
    """The block tables a request's model reads (``kvc_tables``, and the 2-bit store's
    ``kvc_qtables``), in one buffer on ``pool``'s device; uploads counted by the pool."""

    #: the kernel that writes a step's changes (once a step, whatever the layers)
    KERNEL: ClassVar[str] = "set_elements"

    pool: DevicePool
    buffer: Any = None
    places: dict[str, TablePlace] = field(default_factory=dict)
    #: the words on the device, as last sent
    host: np.ndarray | None = None
    #: each table as a buffer of its own (a view of :attr:`buffer`)
    views: dict[str, Any] = field(default_factory=dict)

    def update(self, tables: dict[str, np.ndarray]) -> dict[str, Any]:
        """The device holds ``tables`` (int32 each) once the commands queued now have run: each
        table's buffer, by name."""
        places = self._places(tables)
        words = np.zeros(max(p.offset + max(p.words, 1) for p in places.values()), np.int32)
        for name, place in places.items():
            words[place.offset : place.offset + place.words] = tables[name].ravel()
        if places != self.places or self.host is None:
            self._send_whole(words, places)
        else:
            changed = np.flatnonzero(words != self.host)
            if 4 * changed.size >= words.size:  # the pairs (2 words each) past half the whole
                self._send_whole(words, places)
            elif changed.size:
                self._send_changes(changed, words[changed])
        self.host = words
        return self.views

    def _places(self, tables: dict[str, np.ndarray]) -> dict[str, TablePlace]:
        """Each table's place, one after the other, each at a word the device makes views at."""
        align = self.pool.dev.view_align()
        if align is None:
            raise AssertionError("a table mirror needs a host that makes views of a buffer (pyopencl's)")
        places, at = {}, 0
        for name, table in tables.items():
            places[name] = TablePlace(tuple(table.shape), at)
            at = round_up(at + max(table.size, 1), align)
        return places

    def _send_whole(self, words: np.ndarray, places: dict[str, TablePlace]) -> None:
        self.buffer = self.pool.upload("block tables", words)
        self.places = places
        self.views = {
            name: self.pool.dev.view(self.buffer, 4 * p.offset, 4 * max(p.words, 1)) for name, p in places.items()
        }

    def _send_changes(self, index: np.ndarray, values: np.ndarray) -> None:
        pairs = np.stack([index, values], axis=1).astype(np.int32)
        changes = self.pool.upload("block tables' changes", pairs)
        dev = self.pool.dev
        dev.run(dev.kernel("snapkv.cl", self.KERNEL, {}), (len(pairs),), None, self.buffer, changes)
