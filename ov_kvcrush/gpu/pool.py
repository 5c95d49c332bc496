"""A decoding sequence's KV cache resident on the GPU path's device: the pool of blocks, each
layer's block tables, and the kernels run over them in place.

The kernels' hosts beside this module take and return numpy arrays (each call copies its pool
in and out: how they are tested against the reference). A decode cannot: the pool must stay on
the device and only a step's tensors may cross. :class:`DevicePool` holds the blocks (one
buffer, a free list, the CPU op's block layout) and counts every byte that crosses between host
and device; :class:`PagedLayer` is one layer's KV heads in it: their block tables (on the host,
uploaded when they change), the positions of their slots (:class:`~ov_kvcrush.gpu.slots.SlotPositions`,
on the device beside the slots), and the steps a method's cache runs (store a step's tokens, attend a prompt or
a decode token, keep a selection of slots).

Every KV head of a layer holds the same number of slots here (the full cache and the uniform
budgets of the importance methods); ragged heads (adaptive budgets, ClusterKV's recall) are not
served yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ov_kvcrush.gpu import HOSTS
from ov_kvcrush.gpu.arena import IndexArena, SlotState
from ov_kvcrush.gpu.attention import DecodeBuffers, QuantHeads, decode_buffers, launch_decode, launch_quant_logits
from ov_kvcrush.gpu.device import HeadsOnDevice, KernelDevice, device
from ov_kvcrush.gpu.growth import grow_blocks
from ov_kvcrush.gpu.layout import PoolShape, QuantShape
from ov_kvcrush.gpu.prefill import launch_prompt
from ov_kvcrush.gpu.quant_blocks import QuantBlocks
from ov_kvcrush.gpu.runtime import GPUPathError
from ov_kvcrush.gpu.slots import KeptSlots, SlotPositions
from ov_kvcrush.gpu.store import launch_store, store_constants
from ov_kvcrush.gpu.sycl_host import sycl_device


def open_device(host: str, sub_group: int | None = None) -> KernelDevice:
    """The process's device through ``host`` (:data:`HOSTS`): the pyopencl host's
    :class:`~ov_kvcrush.gpu.device.Device`, or the C++ SYCL host's
    :class:`~ov_kvcrush.gpu.sycl_host.SyclDevice` (both :class:`~ov_kvcrush.gpu.device.KernelDevice`)."""
    if host == "sycl":
        return sycl_device(sub_group)
    if host != "opencl":
        raise GPUPathError(f"host={host!r} is invalid: allowed one of {', '.join(HOSTS)}")
    return device(sub_group)


def largest_pool(dev: KernelDevice, shape: PoolShape) -> int | None:
    """The most blocks of ``shape`` one buffer on ``dev`` holds (its largest allocation); None
    where the host does not say."""
    largest = dev.largest_allocation()
    return None if largest is None else largest // shape.block_bytes


@dataclass
class Crossings:
    """Bytes copied between host and device in one phase, by direction and by what they were;
    for decode, the layer steps taken and the KV bytes they read in place (what the crossings
    compare with)."""

    to_device: dict[str, int] = field(default_factory=dict)
    to_host: dict[str, int] = field(default_factory=dict)
    layer_steps: int = 0
    kv_read: int = 0

    def total(self) -> int:
        return sum(self.to_device.values()) + sum(self.to_host.values())


class DevicePool:
    """Up to ``blocks`` blocks of ``shape`` in one device buffer, handed out to layers' KV heads;
    on ``dev``, or the process's device through ``host`` at ``sub_group`` lanes.

    ``grow``: the buffer starts at one chunk (:attr:`CHUNK_BYTES`) and grows as blocks are asked
    for, by a chunk or a tenth of it, whichever is more (the blocks held copied over on the
    device), so it holds at most 1.1 times the blocks in use plus a chunk; else all ``blocks`` are
    allocated at once. ``blocks`` is the budget; one buffer cannot pass the device's largest
    allocation, which caps it (:attr:`limit_reason` says which bound holds)."""

    #: a growing pool's step, in bytes
    CHUNK_BYTES = 64 << 20

    def __init__(
        self,
        shape: PoolShape,
        blocks: int,
        sub_group: int | None = None,
        host: str = "opencl",
        dev: KernelDevice | None = None,
        grow: bool = False,
    ) -> None:
        if blocks < 1:
            raise GPUPathError(f"a device pool needs at least one block, got {blocks}")
        self.shape = shape
        self.dev: KernelDevice = dev if dev is not None else open_device(host, sub_group)
        largest = largest_pool(self.dev, shape)
        self.limit_reason = "its budget"
        if largest is not None and blocks > largest:
            blocks = largest
            where = "memory" if self.dev.large_buffers else "largest allocation"
            self.limit_reason = f"the device's {where} ({largest * shape.block_bytes >> 20} MiB, one buffer)"
        self.blocks = blocks
        self.chunk = max(1, min(blocks, self.CHUNK_BYTES // shape.block_bytes))
        #: the buffer grows as blocks are asked for (else it was allocated whole)
        self.grows = grow
        self.capacity = self.chunk if grow else blocks
        self.buffer = self.dev.empty(self.capacity * shape.block_bytes)
        self._free = list(range(self.capacity - 1, -1, -1))
        #: what crossed while prompts were attended, and while tokens were decoded
        self.crossings = {"prompt": Crossings(), "decode": Crossings()}
        self.phase = "prompt"  # set by the layer caches
        self._quant: dict[QuantShape, QuantBlocks] = {}
        self._arena: IndexArena | None = None
        align = self.dev.view_align()
        #: every layer's and sequence's scores and slot positions (:class:`SlotState`), where the
        #: device makes views: one buffer that a launch over a step's sequences reads
        self.slot_arena: IndexArena | None = IndexArena(self.dev, align) if align else None
        #: a decode's slot list where it has none (the kernels take a buffer; made once)
        self.no_slots = self.dev.zeros(4)

    def quant_blocks(self, shape: QuantShape) -> QuantBlocks:
        """The 2-bit blocks of ``shape`` that this pool's layer caches share (made when first
        asked): in a growing pool, within its budget beside the full-precision blocks."""
        if shape not in self._quant:
            spare = self._spare_bytes if self.grows else lambda: None
            self._quant[shape] = QuantBlocks(self.dev, shape, self.CHUNK_BYTES, spare, self.limit_reason)
        return self._quant[shape]

    def _spare_bytes(self) -> int:
        """The bytes the budget leaves beside the blocks allocated, full-precision and 2-bit."""
        quant = sum(q.allocated_bytes for q in self._quant.values())
        return (self.blocks - self.capacity) * self.shape.block_bytes - quant

    def index_arena(self) -> IndexArena:
        """The words that this pool's ClusterKV layer caches put their index in for the GPU
        plugin's model (made when first asked)."""
        if self._arena is None:
            self._arena = IndexArena(self.dev)
        return self._arena

    def slot_state(self, nbytes: int) -> SlotState:
        """A buffer of ``nbytes`` for a layer's per-slot state, in :attr:`slot_arena` where there is one."""
        return SlotState(self.dev, nbytes, self.slot_arena)

    @property
    def blocks_in_use(self) -> int:
        return self.capacity - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            self._grow(self.capacity + n - len(self._free))
        return [self._free.pop() for _ in range(n)]

    def _grow(self, need: int) -> None:
        """Room for ``need`` blocks (:func:`~ov_kvcrush.gpu.growth.grow_blocks`), within the budget
        (the 2-bit blocks' bytes taken from it)."""
        old, bb = self.capacity, self.shape.block_bytes
        most = old + max(self._spare_bytes(), 0) // bb
        if need > most:
            beside = f", {(self.blocks - most) * bb >> 20} MiB of it 2-bit blocks" if most < self.blocks else ""
            raise GPUPathError(
                f"the device pool is out of blocks: {need} needed, {most} at most "
                f"({self.blocks * bb >> 20} MiB: {self.limit_reason}{beside}; a larger max_kv_blocks, "
                "scheduler_config.cache_size or --kv-pool-mib raises a budget)"
            )
        self.buffer, self.capacity = grow_blocks(self.dev, self.buffer, self._free, old, need, self.chunk, most, bb)

    def release(self, ids: list[int]) -> None:
        self._free.extend(reversed(ids))

    def upload(self, what: str, array: np.ndarray) -> Any:
        """A device copy of ``array``, counted under ``what``."""
        c = self.crossings[self.phase]
        c.to_device[what] = c.to_device.get(what, 0) + array.nbytes
        return self.dev.to_device(array)

    def upload_slots(self, what: str, slots: np.ndarray) -> Any:
        """A device copy of the 1-D slot list ``slots``, sent as its runs of consecutive slots and
        expanded on the device (a few runs: a store's reorder) where that is fewer bytes."""
        slots = np.ascontiguousarray(slots, np.int32)
        starts = np.flatnonzero(np.diff(slots, prepend=slots[:1] - 2) != 1) if slots.size else np.zeros(0, np.int64)
        if 2 * len(starts) >= len(slots):
            return self.upload(what, slots)
        runs = np.stack([starts, slots[starts]], axis=1).astype(np.int32)
        out = self.dev.empty(4 * len(slots))
        kernel = self.dev.kernel("snapkv.cl", "expand_runs", {})
        self.dev.run(kernel, (len(slots),), None, self.upload(what, runs), np.int32(len(runs)), out)
        return out

    def download(self, what: str, buffer: Any, dtype: type, shape: tuple[int, ...]) -> np.ndarray:
        """``buffer``'s first ``prod(shape)`` elements on the host, counted under ``what``."""
        out = self.dev.to_host(buffer, np.dtype(dtype), shape)
        c = self.crossings[self.phase]
        c.to_host[what] = c.to_host.get(what, 0) + out.nbytes
        return out


def table_array(tables: list[Any], fill: int = 0) -> np.ndarray:
    """Each head's list (its blocks, its slots or their positions) as a row of an int32 array as
    wide as the longest, ``fill`` past its end."""
    width = max(max(len(t) for t in tables), 1)
    out = np.full((len(tables), width), fill, np.int32)
    for h, t in enumerate(tables):
        out[h, : len(t)] = t
    return out


class PagedLayer:
    """One layer's KV heads in a :class:`DevicePool`: each head its own blocks, all holding
    :attr:`held` slots, each slot's position kept for prompt attention's causal mask."""

    def __init__(self, pool: DevicePool, kv_heads: int, q_heads: int) -> None:
        if q_heads % kv_heads or q_heads // kv_heads != pool.shape.group:
            raise GPUPathError(f"{q_heads} query heads over {kv_heads} KV heads do not match the pool's group")
        self.pool = pool
        self.kv_heads = kv_heads
        self.q_heads = q_heads
        self.tables: list[list[int]] = [[] for _ in range(kv_heads)]
        self.held = 0
        self.slot_positions = SlotPositions(pool.dev, pool.shape, pool, kv_heads, pool.slot_state)
        self._tables_on_device: Any = None

    @property
    def positions(self) -> np.ndarray:
        """Each head's slots' positions ``[kv, held]`` on the host (:attr:`SlotPositions.host`)."""
        return self.slot_positions.host

    # ---- the tables the kernels read
    def device_tables(self) -> tuple[Any, int]:
        """The block tables on the device and their row stride (uploaded when the blocks change)."""
        if self._tables_on_device is None:  # uploaded when the blocks change
            table = table_array(self.tables)
            self._tables_on_device = (self.pool.upload("block tables", table), table.shape[1])
        return self._tables_on_device

    def fit_heads(self, counts: np.ndarray) -> None:
        """Each head's blocks for ``counts[h]`` slots (heads that keep different counts: KVzip's,
        Chelsea's): blocks allocated, or the ones past them given back; :attr:`held` the most."""
        bs = self.pool.shape.block_size
        tables = [list(t) for t in self.tables]
        for h, table in enumerate(tables):
            blocks = -(-int(counts[h]) // bs)
            table.extend(self.pool.allocate(max(0, blocks - len(table))))
            self.pool.release(table[blocks:])
            del table[blocks:]
        if tables != self.tables:
            self.set_tables(tables)
        self.held = int(counts.max(initial=0))

    def set_tables(self, tables: list[list[int]], on_device: tuple[Any, int] | None = None) -> None:
        """Each head's blocks are now ``tables`` (``on_device``: their device copy and row stride,
        where the caller made one): heads that keep different counts (KVzip's) keep their own."""
        self.tables = tables
        self._tables_on_device = on_device

    def _heads(self, lengths: int, positions: bool = False) -> HeadsOnDevice:
        p = self.pool
        tables, stride = self.device_tables()
        lengths_b = p.upload("lengths", np.full(self.kv_heads, lengths, np.int32))
        if not positions:
            return HeadsOnDevice(p.buffer, tables, stride, lengths_b)
        return HeadsOnDevice(p.buffer, tables, stride, lengths_b, *self.slot_positions.device())

    # ---- the steps
    def reserve(self, t: int, first_position: int) -> int:
        """Room for ``t`` more tokens at positions ``first_position ..`` in every head (blocks
        allocated as needed, the slots' positions recorded); returns the first new slot. The
        tokens are stored by :meth:`append`, or by the model's own store layer (OpenVINO's GPU
        plugin, :mod:`ov_kvcrush.gpu.plugin_cache`)."""
        bs = self.pool.shape.block_size
        need = -(-(self.held + t) // bs) - len(self.tables[0])
        if need > 0:
            for table in self.tables:
                table.extend(self.pool.allocate(need))
            self._tables_on_device = None
        self.slot_positions.append(first_position, t)
        first, self.held = self.held, self.held + t
        return first

    def append(self, keys: np.ndarray, values: np.ndarray, first_position: int) -> None:
        """Store ``keys``, ``values`` ``[kv, t, D]`` at slots ``held ..`` of every head."""
        kv, t, _ = keys.shape
        first = self.reserve(t, first_position)
        tables, stride = self.device_tables()
        p = self.pool
        launch_store(p.dev, p.shape, p.buffer, tables, stride,
                     p.upload("step slots", np.full(kv, first, np.int32)),
                     p.upload("step keys and values", np.ascontiguousarray(keys, np.float32)),
                     p.upload("step keys and values", np.ascontiguousarray(values, np.float32)), t, kv)  # fmt: skip

    def attend_prompt(self, q: np.ndarray, first_position: int, scale: float, window: int) -> tuple[np.ndarray, Any]:
        """Rows ``q`` ``[Hq, t, D]`` (positions from ``first_position``, stored already) over every
        slot at or before their position: the output on the host, and the device buffer of each
        slot's probability summed over the last ``window`` rows ``[Hq, held]``."""
        hq, rows, d = q.shape
        p = self.pool
        q_b = p.upload("queries", np.ascontiguousarray(q, np.float32))
        out_b, scores_b = self.prompt_on_device(q_b, rows, first_position, scale, window)
        return p.download("attention output", out_b, np.float32, (hq, rows, d)), scores_b

    def prompt_on_device(self, q_b: Any, rows: int, first_position: int, scale: float, window: int) -> tuple[Any, Any]:
        """:meth:`attend_prompt` of ``rows`` query rows already on the device (``q_b`` ``[Hq,
        rows, D]``): the device buffers of the output and of the window's per-slot sums."""
        p = self.pool
        heads = self._heads(self.held, positions=True)
        out_b, _, scores_b = launch_prompt(p.dev, p.shape, heads, q_b, self.q_heads, rows, first_position, scale,
                                           window, self.held)  # fmt: skip
        return out_b, scores_b

    def attend_decode(
        self, q: np.ndarray, scale: float, quant: QuantHeads | None = None, quant_read: int = 0
    ) -> tuple[np.ndarray, Any, int]:
        """One query row ``q`` ``[Hq, D]`` over every held slot (after ``quant``'s 2-bit slots,
        under one softmax; ``quant_read``: their bytes): the output on the host, and the device
        buffer of the probabilities ``[Hq, stride]`` (2-bit slots first) with its row stride."""
        hq, d = q.shape
        p = self.pool
        q_b = p.upload("queries", np.ascontiguousarray(q, np.float32))
        bufs = self.decode_on_device(q_b, scale, quant, quant_read)
        return p.download("attention output", bufs.out, np.float32, (hq, d)), bufs.probs, int(bufs.stride)

    def decode_on_device(
        self, q_b: Any, scale: float, quant: QuantHeads | None = None, quant_read: int = 0, values: bool = True
    ) -> DecodeBuffers:
        """:meth:`attend_decode` of a query row already on the device (``q_b`` ``[Hq, D]``): its
        buffers, the output and the probabilities left there (``values=False``: the probabilities
        only, the keys alone read)."""
        hq, d = self.q_heads, self.pool.shape.head_dim
        p = self.pool
        heads = self._heads(self.held)
        nq = quant.longest if quant else 0
        first = quant.lengths if quant else p.upload("lengths", np.zeros(self.kv_heads, np.int32))
        # every head holds as many slots (and as many 2-bit ones): every probability read is written
        bufs = decode_buffers(p.dev, q_b, hq, d, nq + self.held, first, ragged=False, values=values)
        quant_pass = launch_quant_logits(p.dev, quant, bufs, hq, scale) if quant else None
        totals = p.upload("lengths", np.full(self.kv_heads, nq + self.held, np.int32)) if quant else heads.lengths
        launch_decode(p.dev, p.shape, heads, bufs, hq, self.held, totals, scale, (p.no_slots, 0), quant_pass, values)
        if values:
            self._count_decode_step(self.kv_heads * self.held, quant_read)
        else:  # the keys only
            self._count_decode_step(0, self.kv_heads * self.held * p.shape.head_dim * p.shape.elem_bytes + quant_read)
        return bufs

    def attend_slots(self, q: Any, scale: float, slots: tuple[Any, int], lengths: Any, counts: np.ndarray,
                     extra_read: int = 0) -> np.ndarray:  # fmt: skip
        """One query row (device ``q`` ``[Hq, D]``) over a list of slots per KV head (device
        ``slots``: the map and its row stride; ``lengths`` its device counts, ``counts`` the same
        on the host): the output on the host. ``extra_read``: other bytes the step read in place
        (ClusterKV's centroids), counted with the slots'."""
        hq, d = self.q_heads, self.pool.shape.head_dim
        p = self.pool
        tables, stride = self.device_tables()
        heads = HeadsOnDevice(p.buffer, tables, stride, lengths)
        first = p.upload("lengths", np.zeros(self.kv_heads, np.int32))
        longest = int(counts.max()) if counts.size else 0
        bufs = decode_buffers(p.dev, q, hq, d, longest, first)
        launch_decode(p.dev, p.shape, heads, bufs, hq, longest, lengths, scale, slots)
        self._count_decode_step(int(counts.sum()), extra_read)
        return p.download("attention output", bufs.out, np.float32, (hq, d))

    def _count_decode_step(self, slots_read: int, other_bytes: int) -> None:
        """A decode step of this layer, and the bytes it read in place: ``slots_read`` full-precision
        slots (keys and values, all heads together) and ``other_bytes`` beside them."""
        c = self.pool.crossings["decode"]
        c.layer_steps += 1
        c.kv_read += slots_read * 2 * self.pool.shape.head_dim * self.pool.shape.elem_bytes + other_bytes

    def read_keys(self, first: int, count: int) -> Any:
        """Device ``[kv, count, D]`` float32: the keys of slots ``first ..`` of every head, read
        from the pool on the device."""
        return self._read(first, count, values=False)

    def read_values(self, first: int, count: int) -> Any:
        """The same for the values."""
        return self._read(first, count, values=True)

    def _read(self, first: int, count: int, values: bool) -> Any:
        p = self.pool
        tables, stride = self.device_tables()
        out = p.dev.empty(4 * self.kv_heads * max(count, 1) * p.shape.head_dim)
        kernel = p.dev.kernel("paged_store.cl", "read_slots", store_constants(p.shape))
        p.dev.run(kernel, (p.shape.head_dim, max(count, 1), self.kv_heads), None, p.buffer, tables, np.int32(stride),
                  np.int32(first), np.int32(count), np.int32(values), out)  # fmt: skip
        return out

    def key_norms(self, first: int, count: int, scores: Any, stride: int) -> None:
        """Knorm's scores of slots ``first ..`` (``count`` of them): ``-||key||`` into row ``kv *
        group`` of device ``scores`` (rows ``stride`` apart), computed where the keys lie."""
        p = self.pool
        tables, table_stride = self.device_tables()
        kernel = p.dev.kernel("paged_store.cl", "key_norm_scores", store_constants(p.shape))
        i32 = np.int32
        p.dev.run(kernel, (max(count, 1), self.kv_heads), None, p.buffer, tables, i32(table_stride), i32(first),
                  i32(count), i32(self.q_heads // self.kv_heads), scores, i32(stride))  # fmt: skip

    def keep(self, kept: KeptSlots, scores: tuple[Any, int, Any, int] | None = None) -> None:
        """Keep slots ``kept`` of every head, moved to fresh blocks in that order with their
        positions and (``scores``: the buffer ``[Hq, stride]``, its stride, and a new buffer with
        its stride) their scores, in one launch; the old blocks go back to the pool."""
        n, kv, i32 = kept.count, self.kv_heads, np.int32
        p = self.pool
        new_tables = [p.allocate(-(-n // p.shape.block_size)) for _ in range(kv)]
        old_tables, old_stride = self.device_tables()
        new_array = table_array(new_tables)
        new_b = p.upload("block tables", new_array)
        positions = self.slot_positions
        new_positions = positions.new_state()
        src, src_stride, dst, dst_stride = scores if scores is not None else (p.no_slots, 0, p.no_slots, 0)
        group = self.q_heads // kv if scores is not None else 0
        kernel = p.dev.kernel("paged_store.cl", "keep_slots", store_constants(p.shape))
        p.dev.run(kernel, (p.shape.head_dim + 5 + group, max(n, dst_stride, 1), kv), None, p.buffer, old_tables,
                  i32(old_stride), new_b, i32(new_array.shape[1]), kept.slots, i32(kept.stride), i32(n),
                  *positions.drop_args(), new_positions.buffer, i32(positions.capacity), src, i32(src_stride), dst,
                  i32(dst_stride), i32(group))  # fmt: skip
        for table in self.tables:
            p.release(table)
        self.tables = new_tables
        self._tables_on_device = (new_b, new_array.shape[1])
        positions.gathered(kept, new_positions)
        self.held = n

    def drop_one(
        self, dropped: Any, scores: tuple[Any, int] | None = None, host_dropped: np.ndarray | None = None
    ) -> None:
        """Drop slot ``dropped[kv]`` (a device int per KV head) of every head in place: the slots
        after it move down one, with their positions and (``scores``: the buffer ``[Hq, stride]``
        and its stride) their scores; a block left empty goes back to the pool. ``host_dropped``:
        the same slots where the host knows them (its copy of the positions then follows)."""
        p, i32 = self.pool, np.int32
        tables, stride = self.device_tables()
        group = self.q_heads // self.kv_heads
        score_buffer, score_stride = scores if scores is not None else (p.no_slots, 0)
        kernel = p.dev.kernel("paged_store.cl", "drop_slot", store_constants(p.shape))
        p.dev.run(kernel, (p.shape.head_dim + 5 + group, self.kv_heads), None, p.buffer, tables, i32(stride),
                  dropped, i32(self.held), *self.slot_positions.drop_args(), score_buffer, i32(score_stride),
                  i32(group))  # fmt: skip
        self.forget_one(host_dropped)
        self.release_empty_blocks()

    def forget_one(self, host_dropped: np.ndarray | None = None, count: int = 1) -> None:
        """The host's side of a drop of one slot a head (:meth:`drop_one`, or a launch over a
        step's sequences that drops it; ``count``: a run of that many from a slot the device
        found, a block-wise selection's unit): slots fewer, the positions' host copy following
        where the host knows the slot (``host_dropped``). The blocks it empties stay until
        :meth:`release_empty_blocks`, after the drop is enqueued: the drop reads the last slot."""
        self.slot_positions.dropped_one(host_dropped, count)
        self.held -= count

    def forget_run(self, first: int, count: int) -> None:
        """:meth:`forget_one` of slots ``first .. first + count`` of every head (a 2-bit flush's
        chunk, with slots after it that a launch moves down)."""
        self.slot_positions.dropped_run(first, count)
        self.held -= count

    def drop_leading_blocks(self, blocks: int) -> None:
        """Every head's first ``blocks`` blocks back to the pool, their slots forgotten (a sliding
        window's layer: slots no later row sees); the rest keep their order, ``blocks`` blocks'
        slots lower."""
        for table in self.tables:
            self.pool.release(table[:blocks])
            del table[:blocks]
        self._tables_on_device = None
        count = blocks * self.pool.shape.block_size
        self.held -= count
        self.slot_positions.dropped_front(count)

    def release_empty_blocks(self) -> None:
        """The blocks past the slots held back to the pool."""
        blocks = -(-self.held // self.pool.shape.block_size)
        for table in self.tables:
            self.pool.release(table[blocks:])
            del table[blocks:]

    def truncate(self, tokens: int) -> bool:
        """Drop every slot at position ``tokens`` or later (a chat rolled back to a common prefix):
        the slots ascend in position, so the kept ones are each head's first; their trailing blocks
        go back to the pool. False (nothing dropped) when the heads would keep different counts."""
        keep = (self.positions < tokens).sum(axis=1)
        if keep.size and keep.min() != keep.max():
            return False
        self.keep_first(int(keep[0]) if keep.size else 0)
        return True

    def keep_first(self, n: int) -> None:
        """Keep each head's first ``n`` slots (nothing moves: their trailing blocks go back to the
        pool; a 2-bit flush of the slots after them, or a truncation)."""
        self.held = n
        self.release_empty_blocks()
        self._tables_on_device = None
        self.slot_positions.truncate(n)

    def release(self) -> None:
        for table in self.tables:
            self.pool.release(table)
        self.tables = [[] for _ in range(self.kv_heads)]
        self._tables_on_device = None
        self.slot_positions.truncate(0)
        self.held = 0

    def kv_bytes(self) -> int:
        return sum(len(t) for t in self.tables) * self.pool.shape.block_bytes
