"""The importance methods' layer caches over the 2-/4-bit store on the GPU path's device: the kept
tokens quantized in chunks of ``residual_tokens`` into the CPU op's 2-bit blocks (``quant2.cl``),
the prompt's tail and the newest tokens in full precision, and decode-time eviction of whole
quantized chunks.

The steps are the reference's (:class:`~ov_kvcrush.methods.importance.ImportanceLayerCache` over
a :class:`~ov_kvcrush.methods.store.QuantStore`), in its order of slots: the quantized chunks,
then the pinned prompt tail, then the residual. After the prompt's selection the kept tokens'
tail is pinned and whole chunks of the rest are quantized (their keys and values read from the
full-precision pool and packed on the device, one 2-bit block a chunk and KV head); a decode step
stores its token, quantizes a chunk when the residual fills one (before attending, as the
reference), attends the 2-bit slots then the full-precision ones under one softmax, adds the
probabilities to the scores (kept in the store's order on the device), and, when a head holds a
chunk more than its budget, drops the lowest-scoring whole chunks (sinks' and recent tokens'
stay): the host counts them, the device chooses them and moves the kept ones down, nothing read
back (:mod:`~ov_kvcrush.gpu.quant_step`). MiniKV's selection is frozen: its decode steps keep
every token (PyramidKV's budgets, a layer's own).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ov_kvcrush.errors import UserError
from ov_kvcrush.gpu.arena import SlotState
from ov_kvcrush.gpu.attention import QuantHeads
from ov_kvcrush.gpu.importance_cache import DeviceSnapKVLayerCache
from ov_kvcrush.gpu.kvcrush_cache import DeviceKVCrushLayerCache
from ov_kvcrush.gpu.layer_cache import host_array
from ov_kvcrush.gpu.layout import PoolShape, QuantShape
from ov_kvcrush.gpu.pool import DevicePool
from ov_kvcrush.gpu.quant import launch_quantize
from ov_kvcrush.gpu.quant_step import (
    ChunkEviction,
    QuantStepBuffers,
    QuantStepRow,
    launch_quant_steps,
    plan_chunk_eviction,
    positions_after,
)
from ov_kvcrush.gpu.slots import KeptSlots, StepLogits
from ov_kvcrush.gpu.step_work import StepWork
from ov_kvcrush.methods import MethodConfig
from ov_kvcrush.methods.importance import H2OConfig
from ov_kvcrush.methods.kvcrush import KVCrushConfig


def store_shape(config: MethodConfig, shape: PoolShape) -> QuantShape | None:
    """The 2-bit blocks of ``config``'s store over a pool of ``shape`` (a chunk of
    ``residual_tokens`` per block and KV head); None for a full-precision store."""
    st = config.store_settings()
    if st is None:
        return None
    return QuantShape(st.residual_tokens, shape.head_dim, st.group_size, st.kbits, st.vbits, shape.group)


class DeviceQuantEvictionLayerCache(DeviceSnapKVLayerCache):
    """H2O, SnapKV, PyramidKV or MiniKV (its config's scoring and layer budget) over the 2-bit
    store: :attr:`layer` holds the pinned tail and the residual in full precision, :attr:`chunks`
    each KV head's 2-bit blocks."""

    def __init__(self, config: H2OConfig, pool: DevicePool, kv_heads: int, q_heads: int, budget: int) -> None:
        super().__init__(config, pool, kv_heads, q_heads, budget)  # type: ignore[arg-type]
        st = config.quant
        assert st is not None
        self.settings = st
        self.r = st.residual_tokens
        self.qshape = store_shape(config, pool.shape)
        assert self.qshape is not None
        self.blocks = pool.quant_blocks(self.qshape)  # the pool's 2-bit blocks, shared by its layers
        self.chunks: list[list[int]] = [[] for _ in range(kv_heads)]
        self.qpos = np.zeros((kv_heads, 0), np.int32)  # positions of the quantized tokens
        self.pinned = 0
        #: :meth:`_quant_heads` as last uploaded (None: the chunks changed since)
        self._heads_on_device: QuantHeads | None = None
        #: the flush the model's step makes (a model that stores and attends itself): the first
        #: full-precision slot, the slots, and each KV head's new blocks; None when it makes none
        self.flushing: tuple[int, int, list[list[int]]] | None = None
        #: the scores before they grew for the model's step (their state, row stride and slots),
        #: until the step's launch reads them there (:meth:`_grow_in_step`)
        self._grown_from: tuple[SlotState, int, int] | None = None

    @property
    def nq(self) -> int:
        return self.qpos.shape[1]

    # ---- the protocol
    def prefill(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        out = super().prefill(queries, keys, values)  # attend, score, keep the selection
        self._store_prompt()
        return out

    def _store_prompt(self) -> None:
        """The selected prompt into the store: its tail pinned, whole chunks of the rest quantized,
        the scores in the store's order."""
        held = self.layer.held
        self.pinned = min(self.settings.pinned_tail(selecting=self.config.pins_prompt_tail), held)
        flush = (held - self.pinned) // self.r * self.r
        # the store's order: quantized (the first `flush`), pinned (the last `pinned`), residual
        tail = held - self.pinned
        order = np.concatenate([np.arange(flush), np.arange(tail, held), np.arange(flush, tail)])
        self._quantize(0, flush)
        self._reorder_scores(order)
        self._keep_full_precision(order[flush:])

    def _decode_step(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        if keys.shape[2] != 1:
            raise UserError("the 2-bit store on the GPU path (paged_device) decodes one token per step (several came)")
        self._positions(1, keys.device)
        self.layer.pool.phase = "decode"
        lay = self.layer
        if self._scored() + 1 > self.stride:
            self._grow(self._scored() + 1)
        lay.append(host_array(keys), host_array(values), self.seen - 1)
        self._zero_new_score()
        if lay.held - self.pinned >= self.r:  # the residual fills a chunk: quantized before attending
            self._quantize(self.pinned, self.pinned + self.r)
            self._flushed(self.pinned, self.r)
        q = host_array(queries)[:, 0]
        out, probs, stride = lay.attend_decode(q, self._scale(q.shape[1]), self._quant_heads(), self._quant_read())
        self._add(probs, stride, self._scored())  # every slot's own score, the new one's zeroed above
        self._evict_chunks()
        return torch.from_numpy(out)[None, :, None].to(queries.dtype)

    def _zero_new_score(self) -> None:
        """The new token's score starts at zero, in the slot after the others (a flush's order moves it)."""
        lay = self.layer
        lay.pool.dev.run(self._kernel("zero_slot"), (lay.q_heads,), None, self.scores, np.int32(self.stride),
                         np.int32(self._scored() - 1))  # fmt: skip

    def _flushed(self, start: int, count: int) -> None:
        """After full-precision slots ``[start, start + count)`` were quantized: the scores in the
        store's new order (those slots' after the older chunks'), the rest kept in full precision."""
        nq, held = self.nq - count, self.layer.held
        fp = np.concatenate([np.arange(start), np.arange(start + count, held)])
        order = np.concatenate([np.arange(nq), nq + start + np.arange(count), nq + fp])
        self._reorder_scores(order)
        self._keep_full_precision(fp)

    def tokens_held(self) -> torch.Tensor:
        return torch.full((1, self.layer.kv_heads), self._scored())

    # ---- a model that stores, flushes and attends itself (our layers in OpenVINO's GPU plugin)
    #: a step of several tokens after the prompt (a chat's next turn over the kept cache) is not
    #: taken: its rows' scores over the 2-bit slots are not computed here (the conversation is fed
    #: again as a prompt)
    several_tokens_after_prompt = False

    def reserve(self, t: int) -> None:
        """As the full-precision store's, and the flush the model makes when the step fills the
        residual's chunk (:attr:`flushing`: the new 2-bit blocks taken now, the model's inputs)."""
        if self.scores is not None:
            if t != 1:
                raise UserError("the 2-bit store on device GPU decodes one token per step after the prompt")
            filled = (self.layer.held + t - self.pinned) // self.r * self.r
            need = self._scored() + t
            if self._works_in_step_launch():
                if need > self.stride:
                    self._grow_in_step(need)
            # a step that flushes has a command more: the scores grow a step early rather than in it
            elif need > self.stride or (not filled and need + t > self.stride):
                self._grow(need + (0 if filled else t))
            if filled:
                ids = [self.blocks.take(self.layer.kv_heads) for _ in range(filled // self.r)]
                self.flushing = (self.pinned, filled, [list(head) for head in zip(*ids, strict=True)])
        super().reserve(t)

    def model_inputs(self) -> tuple[list[list[int]], int, tuple[int, int]]:
        """What the model's 2-bit layers read for the step :meth:`reserve` made room for: each KV
        head's 2-bit blocks and their slots after the step's flush, and the full-precision slots
        it flushes (first, count)."""
        if self.flushing is None:
            return self.chunks, self.nq, (0, 0)
        start, count, ids = self.flushing
        return [c + new for c, new in zip(self.chunks, ids, strict=True)], self.nq + count, (start, count)

    def model_step_read(self) -> int:
        """The 2-bit slots' bytes after the step's flush, and the full-precision slots' not flushed."""
        _, nq, (_, flushed) = self.model_inputs()
        quantized = nq * self.layer.kv_heads * self.qshape.block_bytes // self.r
        return self._full_precision_read(self.layer.held - flushed) + quantized

    def score_rows(self, t: int) -> int:
        """The prompt's window rows (a chunk's: those of the window it holds); a decode step's
        row (its probabilities over both stores)."""
        return super().score_rows(t) if self.scores is None else t

    def after_model_step(self, rows: Any, t: int, logits: StepLogits | None = None, sums: Any = None) -> None:
        """:meth:`prefill`'s or :meth:`_decode_step`'s work after the model's step: the prompt's
        selection and store, after its last chunk (its chunks stay in full precision until then,
        as the CPU op's); or the new token's score, the flush's bookkeeping (the model
        quantized the chunk), the step's probabilities over both stores and the chunks' eviction."""
        if self.scores is None:
            super().after_model_step(rows, t, sums=sums)
            if self.scores is not None:  # the prompt's last chunk (or all of it): selected, now stored
                self._store_prompt()
            return
        lay = self.layer
        self._copy_grown()
        self._zero_new_score()
        if self.flushing is not None:
            start, count, ids = self.flushing
            self.flushing = None
            self._add_chunks(start, start + count, ids)
            self._flushed(start, count)
        if logits is not None:  # the probabilities over both stores, from the model's logits
            self._add_logits(logits, self._scored())
        else:  # over both stores: the model's sums are over the full-precision slots alone
            scale = self._scale(lay.pool.shape.head_dim)
            bufs = lay.decode_on_device(rows, scale, self._quant_heads(), self._quant_read(), values=False)
            self._add(bufs.probs, int(bufs.stride), self._scored())
        self._evict_chunks()

    def step_work(self, t: int, logits: StepLogits | None) -> StepWork | None:
        """A decode token's work as a row of the step's launch: where the model flushed the
        residual's chunk, the chunks' bookkeeping here and the scores in the store's new order;
        then the probabilities over both stores added from the logits, the new slot's from zero.
        Under a selection not frozen (SnapKV, H2O with ``quant``), the chunks' eviction past the
        budget is a row of the step's 2-bit store launch, after the others (:meth:`StepWork.quant_store`):
        it ranks the chunks by the scores they left; the host gives the freed blocks back now."""
        lay = self.layer
        if logits is None or not self._works_in_step_launch():
            return None
        scored = self._scored()  # in the order before a flush too: the step's token the last
        work = StepWork(lay, self.score_state, self.stride, add_from=scored - 1, scored=scored, held=lay.held)
        if self._grown_from is not None:  # the held scores come over in the adding
            work.grown, work.grown_stride, _ = self._grown_from
            self._grown_from = None
        if self.flushing is not None:
            start, count, ids = self.flushing
            self.flushing = None
            work.flushed(self.nq, start, count)
            self._add_chunks(start, start + count, ids)
            if start + count == lay.held:  # the chunk's full-precision slots were the last: nothing moves
                lay.keep_first(start)
            else:  # the slots after them move down (the first flush after a prompt whose tail was longer)
                work.drop_flushed(start, count)
        eviction = None if self.frozen else self._chunk_eviction()
        if work.flush_from >= 0 or eviction is not None:  # after the launch's others, over the scores they left
            work.quant_store(self.nq, lay.held, eviction, self._chunks_ranked_by_layer())
        if eviction is not None:
            self._chunks_evicted(eviction)
        return work

    def _works_in_step_launch(self) -> bool:
        """Whether a decode step's work is a row of the step's launch (:meth:`step_work`: its
        scores in the pool's arena), given the model's logits."""
        return self.scores is not None and self.layer.pool.slot_arena is not None

    def _grow_in_step(self, need: int) -> None:
        """:meth:`_grow` with no command of its own: the grown rows taken now, the held scores
        read where they were by the step's launch that adds its probabilities (:meth:`step_work`),
        or copied over by :meth:`_copy_grown` where the step's work is not that launch's."""
        lay = self.layer
        self._grown_from = (self.score_state, self.stride, self._scored())
        self.stride = self._grown_stride(need)
        self.score_state = lay.pool.slot_state(4 * lay.q_heads * self.stride)

    def _copy_grown(self) -> None:
        """The held scores copied into the rows :meth:`_grow_in_step` took, where no launch read them."""
        if self._grown_from is None:
            return
        state, stride, held = self._grown_from
        self._grown_from = None
        no_list = (self.layer.pool.no_slots, -1)
        self.score_state = self._gather_scores(no_list, held, self.stride, source=(state, stride))

    def truncate(self, tokens: int) -> bool:
        """False (nothing dropped) once the prompt is stored and ``tokens`` would drop any: as the
        CPU op's, the 2-bit store does not give tokens back."""
        if self.scores is not None and tokens < self.seen:
            return False
        return super().truncate(tokens)

    def release(self) -> None:
        for chunks in self.chunks:
            self.blocks.give(chunks)
        if self.flushing is not None:
            self.blocks.give([b for head in self.flushing[2] for b in head])
            self.flushing = None
        self.chunks = [[] for _ in range(self.layer.kv_heads)]
        self._heads_on_device = None
        super().release()

    def _scored(self) -> int:
        return self.nq + self.layer.held

    def quant_blocks_held(self) -> int:
        return sum(len(c) for c in self.chunks)

    def memory(self) -> dict[str, int]:
        m = super().memory()
        quant = self.quant_blocks_held() * self.qshape.block_bytes
        meta = m["metadata"] + self.qpos.nbytes
        return {"kv": m["kv"] + quant, "metadata": meta, "total": m["kv"] + quant + meta}

    # ---- the store
    def _quantize(self, start: int, end: int) -> None:
        """Quantize full-precision slots ``[start, end)`` of every head (whole chunks) into new 2-bit
        blocks after the head's others (the full-precision slots are dropped by the caller)."""
        lay, dev, kv = self.layer, self.layer.pool.dev, self.layer.kv_heads
        new: list[list[int]] = [[] for _ in range(kv)]
        for c in range(start, end, self.r):
            ids = self.blocks.take(kv)
            k, v = lay.read_keys(c, self.r), lay.read_values(c, self.r)
            launch_quantize(dev, self.qshape, k, v, lay.pool.upload("block tables", np.array(ids, np.int32)), kv,
                            self.blocks.buffer)  # fmt: skip
            for h in range(kv):
                new[h].append(ids[h])
        self._add_chunks(start, end, new)

    def _add_chunks(self, start: int, end: int, new: list[list[int]]) -> None:
        """Each head's new 2-bit blocks ``new[h]``, holding full-precision slots ``[start, end)``."""
        self._heads_on_device = None
        for h, ids in enumerate(new):
            self.chunks[h].extend(ids)
        self.qpos = np.concatenate([self.qpos, self.layer.positions[:, start:end]], axis=1)

    def _chunks_ranked_by_layer(self) -> bool:
        """Whether every head ranks the chunks by the layer's summed scores, so that every head
        drops the same ones (the reference's ``_chunk_scores``); here each head by its own."""
        return False

    def _keep_full_precision(self, slots: np.ndarray) -> None:
        """The full-precision part keeps ``slots`` (the same for every head), in that order."""
        lay = self.layer
        kept = np.ascontiguousarray(np.broadcast_to(slots.astype(np.int32), (lay.kv_heads, len(slots))))
        lay.keep(KeptSlots(lay.pool.upload_slots("kept slots", slots), 0, len(slots), kept))  # one list, every head

    def _reorder_scores(self, order: np.ndarray) -> None:
        """The scores in a new order of slots (the same for every head): the store's after a flush."""
        uploaded = self.layer.pool.upload_slots("score order", order)
        self.score_state = self._gather_scores((uploaded, 0), len(order), self.stride)

    def _quant_heads(self) -> QuantHeads | None:
        """The 2-bit blocks as the decode reads them, uploaded when the chunks (or the 2-bit
        blocks' buffer, which grows) changed since the last step."""
        if not self.nq:
            return None
        held = self._heads_on_device
        if held is None or held.pool is not self.blocks.buffer or held.longest != self.nq:
            held = self._heads_on_device = self._upload_quant_heads()
        return held

    def _upload_quant_heads(self) -> QuantHeads:
        pool = self.layer.pool
        width = max(len(c) for c in self.chunks)
        tables = np.zeros((self.layer.kv_heads, width), np.int32)
        for h, c in enumerate(self.chunks):
            tables[h, : len(c)] = c
        lengths = np.full(self.layer.kv_heads, self.nq, np.int32)
        return QuantHeads(self.qshape, self.blocks.buffer, pool.upload("block tables", tables), width,
                          pool.upload("lengths", lengths), self.nq)  # fmt: skip

    def _quant_read(self) -> int:
        return sum(len(c) for c in self.chunks) * self.qshape.block_bytes

    def _chunks_to_drop(self) -> int:
        """The whole chunks the held tokens (both stores') are over the budget by (0: none)."""
        return max(0, (self.nq + self.layer.held - self.budget) // self.r)

    def _chunk_eviction(self) -> ChunkEviction | None:
        """The chunks each KV head drops past its budget, counted on the host
        (:func:`~ov_kvcrush.gpu.quant_step.plan_chunk_eviction`); None: none."""
        if not self.nq:
            return None
        lay, cfg = self.layer, self.config
        newest = int(max(self.qpos.max(), lay.positions.max() if lay.held else -1))
        return plan_chunk_eviction(self.qpos, self.r, self._chunks_to_drop(), cfg.sink_tokens,
                                   newest - cfg.recent_tokens)  # fmt: skip

    def _evict_chunks(self) -> None:
        """Drop, per KV head, the lowest-scoring whole chunks while it keeps its budget (the
        reference's ``_evict_quantized_chunks``: sinks' and recent tokens' chunks stay, ties drop
        the older chunk; every head drops as many), this sequence's own launch: chosen and moved
        on the device (``step_quant_store``), nothing read back."""
        eviction = None if self.frozen else self._chunk_eviction()
        if eviction is None:
            return
        lay = self.layer
        heads = self._quant_heads()  # the chunks' blocks as the device holds them, before the drop
        assert heads is not None
        row = QuantStepRow(0, self.stride, self.nq, lay.held, None, eviction, 0, heads.table_stride,
                           self._chunks_ranked_by_layer())  # fmt: skip
        buffers = QuantStepBuffers(self.score_state.buffer, heads.tables, self.blocks.buffer, self.qshape,
                                   lay.kv_heads, lay.q_heads // lay.kv_heads)  # fmt: skip
        launch_quant_steps(lay.pool, buffers, [row])
        self._chunks_evicted(eviction)

    def _chunks_evicted(self, eviction: ChunkEviction) -> None:
        """The host's side of an eviction the device makes: each head's last ``drop`` 2-bit blocks
        given back (the kept chunks were moved into its first ones), the middle's positions
        unknown."""
        drop, kv = eviction.drop, self.layer.kv_heads
        self._heads_on_device = None
        for h in range(kv):
            self.blocks.give(self.chunks[h][-drop:])
            self.chunks[h] = self.chunks[h][:-drop]
        self.qpos = positions_after(self.qpos, self.r, eviction)
        self._bump("evicted", float(drop * self.r * kv))


class DeviceQuantKVCrushLayerCache(DeviceQuantEvictionLayerCache, DeviceKVCrushLayerCache):
    """KVCrush over the 2-bit store: KVCrush's prompt selection (:class:`DeviceKVCrushLayerCache`),
    then the store's chunks; with ``scope="layer"`` every head ranks the chunks by the layer's
    summed scores, so every head drops the same ones (the reference's ``_chunk_scores``)."""

    config: KVCrushConfig

    def _chunks_ranked_by_layer(self) -> bool:
        return self.config.scope == "layer"
