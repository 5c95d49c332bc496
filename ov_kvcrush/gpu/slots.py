"""What a layer's slots carry beside their keys and values on the GPU path's device, and what
moves them: each slot's position (:class:`SlotPositions`, kept on the device as the slots are,
so that an eviction chosen there needs nothing back), the slots an eviction keeps
(:class:`KeptSlots`), and a decode row's logits as the model's attention wrote them
(:class:`StepLogits`). :class:`~ov_kvcrush.gpu.pool.PagedLayer` holds them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ov_kvcrush.gpu.arena import SlotState
from ov_kvcrush.gpu.device import KernelDevice, Transfers
from ov_kvcrush.gpu.layout import PoolShape
from ov_kvcrush.gpu.store import store_constants


@dataclass
class KeptSlots:
    """The slots each KV head keeps in an eviction, ascending: on the device (``slots`` ``[kv,
    stride]``; ``stride`` 0: one list every head keeps), ``count`` a head, and on the host
    (``[kv, count]``) where the host listed them; None where only the device did (a decode step's
    eviction: nothing is read back)."""

    slots: Any
    stride: int
    count: int
    host: np.ndarray | None = None


@dataclass
class StepLogits:
    """One sequence's decode row in a layer as the model's attention left it: its logits over the
    layer's slots and its log-sum-exp (``layer_inputs.logits_bytes``'s layout, in ``buffer``: rows
    of ``stride``, ``rows`` a query head, this sequence's ``row``), from which its probabilities
    are taken without the keys read again."""

    buffer: Any
    stride: int
    rows: int
    row: int


class SlotPositions:
    """Each KV head's slots' positions ``[kv, capacity]`` int32 in a device buffer: an eviction
    gathers them there, as the slots themselves, so an eviction chosen on the device needs nothing
    back. New slots' positions are a range (a step's tokens, every head alike): the latest ones are
    kept as :attr:`fresh` and written by the next kernel that reads the buffer (a decode step
    launches none of its own). :attr:`host` is the host's copy, read back when asked (a chat's
    truncation, the 2-bit store's chunk positions) and kept while it holds."""

    FIRST = 64  # slots of the first buffer

    def __init__(self, dev: KernelDevice, shape: PoolShape, transfers: Transfers, kv_heads: int,
                 allocate: Callable[[int], SlotState] | None = None) -> None:  # fmt: skip
        self.dev, self.shape, self.transfers = dev, shape, transfers  # the pool's: where a read back counts
        self.kv_heads = kv_heads
        self.count = 0
        self.capacity = 0
        #: where the positions' buffers come from (the pool's arena; else buffers of their own)
        self._allocate = allocate or (lambda nbytes: SlotState(dev, nbytes))
        self.state: SlotState | None = None
        #: slots ``first ..`` of every head hold positions ``position ..``, not yet written:
        #: ``(first, position)``, or None
        self.fresh: tuple[int, int] | None = None
        self._host: np.ndarray | None = np.zeros((kv_heads, 0), np.int32)

    def _kernel(self, name: str) -> Any:
        return self.dev.kernel("paged_store.cl", name, store_constants(self.shape))

    @property
    def buffer(self) -> Any:
        """The positions' device buffer as it is (the fresh range not written): :meth:`device` writes it."""
        return self.state.buffer if self.state is not None else None

    def append(self, first_position: int, t: int) -> None:
        """``t`` new slots after the others, at positions ``first_position ..``."""
        if self.fresh is not None and first_position - self.fresh[1] != self.count - self.fresh[0]:
            self._write_fresh()  # not the same range: the earlier one written first
        if self.count + t > self.capacity:
            # twice the slots: a prompt's first decode steps (and the next doublings') add none
            capacity = max(2 * (self.count + t), self.FIRST)
            grown = self._allocate(4 * self.kv_heads * capacity)
            written = self.fresh[0] if self.fresh is not None else self.count
            if written:
                self.dev.copy_rect(self.buffer, self.capacity, grown.buffer, capacity, 0, self.kv_heads, written)
            self.state, self.capacity = grown, capacity
        if self.fresh is None and t:
            self.fresh = (self.count, first_position)
        if self._host is not None:
            step = np.arange(first_position, first_position + t, dtype=np.int32)
            self._host = np.concatenate([self._host, np.broadcast_to(step, (self.kv_heads, t))], axis=1)
        self.count += t

    def _write_fresh(self) -> None:
        if self.fresh is None:
            return
        (first, position), i32 = self.fresh, np.int32
        n = self.count - first
        if n > 0:
            self.dev.run(self._kernel("fill_positions"), (n, self.kv_heads), None, self.buffer,
                              i32(self.capacity), i32(first), i32(position), i32(n))  # fmt: skip
        self.fresh = None

    def device(self) -> tuple[Any, int]:
        """The buffer, every position written, and its row stride."""
        self._write_fresh()
        return self.buffer, self.capacity

    def new_state(self) -> SlotState:
        """A buffer for the positions an eviction gathers (:meth:`gathered`), of this capacity."""
        return self._allocate(4 * self.kv_heads * max(self.capacity, 1))

    def gathered(self, kept: KeptSlots, out: SlotState) -> None:
        """After an eviction's launch wrote the positions of ``kept``'s slots, in that order, to
        ``out`` (the fresh ones written as they were gathered: :meth:`drop_fields` says where)."""
        self.state, self.fresh = out, None
        if self._host is not None and kept.host is not None:
            self._host = np.take_along_axis(self._host, kept.host.astype(np.int64), axis=1)
        else:
            self._host = None  # read back when next asked
        self.count = kept.count

    def drop_fields(self) -> tuple[SlotState | None, int, int, int]:
        """What ``drop_slot`` and ``keep_slots`` read of the positions (their state, its row
        stride, the fresh range's first slot and position): ``drop_slot`` writes every position
        from the dropped slot or the fresh range on, ``keep_slots`` every kept slot's."""
        first, position = self.fresh if self.fresh is not None else (self.count, 0)
        return self.state, self.capacity, first, position

    def drop_args(self) -> tuple[Any, ...]:
        """:meth:`drop_fields` as ``drop_slot``'s and ``keep_slots``' arguments (the buffer for the state)."""
        _, capacity, first, position = self.drop_fields()
        return self.buffer, np.int32(capacity), np.int32(first), np.int32(position)

    def dropped_one(self, dropped: np.ndarray | None = None, count: int = 1) -> None:
        """After ``drop_slot``: one slot fewer a head (``count`` from one the device found), every
        position written; the host's copy follows where the host knows the slot each head dropped
        (``dropped`` ``[kv]``), else it is stale."""
        if dropped is not None and count != 1:
            raise ValueError("a run dropped from slots the host knows is dropped_run's")
        self.count -= count
        self.fresh = None
        if self._host is not None and dropped is not None:
            keep = np.ones(self._host.shape, bool)
            keep[np.arange(self.kv_heads), dropped] = False
            self._host = self._host[keep].reshape(self.kv_heads, -1)
        else:
            self._host = None

    def dropped_run(self, first: int, count: int) -> None:
        """After ``drop_slot``'s body dropped slots ``first .. first + count`` of every head (a 2-bit
        flush's chunk): the slots after them moved down, every position written."""
        self.count -= count
        self.fresh = None
        if self._host is not None:
            self._host = np.delete(self._host, np.s_[first : first + count], axis=1)

    def dropped_front(self, count: int) -> None:
        """Each head's first ``count`` slots forgotten, the rest a slot index ``count`` lower (a
        sliding window's layer, whose slots hold consecutive positions alike in every head: the
        rest are a range again, written by the next kernel that reads them)."""
        rest = self.host[:, count:]
        self._host, self.count = rest, self.count - count
        self.fresh = (0, int(rest[0, 0])) if self.count else None

    def truncate(self, count: int) -> None:
        """Keep each head's first ``count`` slots."""
        if self.fresh is not None and count <= self.fresh[0]:
            self.fresh = None
        if count == 0:
            self._host = np.zeros((self.kv_heads, 0), np.int32)
        elif self._host is not None:
            self._host = self._host[:, :count]
        self.count = count

    @property
    def host(self) -> np.ndarray:
        """``[kv, count]`` on the host (read back where the device alone knows them)."""
        if self._host is None:
            buffer, capacity = self.device()
            whole = self.transfers.download("positions", buffer, np.int32, (self.kv_heads, capacity))
            self._host = np.ascontiguousarray(whole[:, : self.count])
        return self._host

    @property
    def nbytes(self) -> int:
        return 4 * self.kv_heads * self.count
