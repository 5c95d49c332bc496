"""MiniKV's decode over its 2-bit store read in place, in steps a CUDA graph can replay.

The prefill is the reference's (:class:`~ov_kvcrush.methods.importance.ImportanceLayerCache`:
heavy hitters by the prompt's cumulative attention, which on a GPU comes from the Triton
kernel of :mod:`ov_kvcrush.kernels.flash_scores`, then the 2-bit store); this layer then takes
the store over into preallocated tensors and decodes with
:func:`~ov_kvcrush.kernels.quant2_attention.quant2_decode_attention` (codes unpacked and
dequantised inside the attention) where Triton runs, or a dequantise-then-SDPA step elsewhere.

The selection is frozen after prefill (MiniKV's design), so a step only appends: the new token
goes into the full-precision buffer at the device count ``r_dev``. The buffer starts with the
pinned prompt tail (``quant.prompt_tail``, never quantised) and goes on with the residual, so the
kernel reads both as one full-precision run, in the reference's order; when the residual fills
(every ``residual_tokens`` steps) that step quantises it into the store, as the reference does in
the same step. That step runs eagerly (:meth:`graph_key` is ``None``); the shapes then change
(one more quantised chunk), and the next step is captured again.

Where it departs from the reference: decode steps do not accumulate attention scores (with the
selection frozen they change nothing the method does).
"""

from __future__ import annotations

from typing import Any

import torch

from ov_kvcrush.fastpath.dense import FastLayerCache
from ov_kvcrush.kernels import use_triton
from ov_kvcrush.methods.base import QuantSettings, tensor_bytes
from ov_kvcrush.methods.minikv import MiniKVConfig
from ov_kvcrush.methods.quant import PACKED_KV, pack_kv, unpack_kv

# Imported where used, inside functions: what pulls in triton, heavy to import, so that importing
# this module stays light.


class FastMiniKVLayerCache(FastLayerCache):
    """One layer of MiniKV for the fast path (see the module doc)."""

    def __init__(self, config: MiniKVConfig, layer_idx: int, num_layers: int, reserve: int = 0) -> None:
        super().__init__(reserve)
        assert config.quant is not None
        self.config = config
        self.settings: QuantSettings = config.quant
        self.reference = config.make_layer(layer_idx, num_layers)  # does the prefill, then is dropped
        self.reserve = max(0, int(reserve))
        self.packed: dict[str, torch.Tensor] = {}
        self.n_q = 0  # tokens in the quantised part
        self.rk: torch.Tensor | None = None  # [b, hk, pinned + residual_tokens, d]
        self.rv: torch.Tensor | None = None
        self.r_dev: torch.Tensor | None = None  # [1] pinned + residual tokens held, on the device
        self.r_host = 0  # residual tokens held (not counting the pinned)
        self.pinned = 0
        # [b, hk, n] positions of the kept prompt tokens at prefill: quantised, pinned, residual
        self.prompt_positions: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.prompt_tokens = 0
        self._flush_now = False
        self._flushed = False

    # -- prefill: the reference's, then its store taken over -----------------------------------
    def prefill(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        ref = self.reference
        assert ref is not None
        ref.scale, ref.prompt_memo = self.scale, self.prompt_memo
        out = ref.prefill(queries, keys, values)
        self.seen, self.attend_ms = ref.seen, ref.attend_ms
        self._host_counters.update(ref.counters)
        store = ref.store
        self.prompt_tokens = keys.shape[2]
        assert store.rpos is not None and store.rk is not None and store.rv is not None
        empty = store.rpos[:, :, :0]
        self.prompt_positions = (
            empty if store.qpos is None else store.qpos,
            empty if store.ppos is None else store.ppos,
            store.rpos,
        )
        r = self.settings.residual_tokens
        self.n_q = store.quantized_tokens
        self._allocate(self.n_q + -(-self.reserve // r) * r + r, keys)
        if self.n_q:
            self._store_packed({name: getattr(store, name) for name in PACKED_KV}, 0)
        p = self.pinned = store.pinned_len
        self.rk = keys.new_zeros((*keys.shape[:2], p + r, keys.shape[3]))
        self.rv = torch.zeros_like(self.rk)
        if p:
            self.rk[:, :, :p] = store.pk
            self.rv[:, :, :p] = store.pv
        self.r_host = store.residual_len
        self.rk[:, :, p : p + self.r_host] = store.rk
        self.rv[:, :, p : p + self.r_host] = store.rv
        self.r_dev = torch.full((1,), p + self.r_host, dtype=torch.long, device=keys.device)
        self.reference = None
        return out

    def _allocate(self, tokens: int, like: torch.Tensor) -> None:
        """Packed tensors for ``tokens`` quantised tokens (the held ones copied over)."""
        b, h, _, d = like.shape
        g = self.settings.group_size
        kper, vper = 32 // self.settings.kbits, 32 // self.settings.vbits
        shapes = {
            "qk": ((b, h, tokens // kper, d), torch.int32),
            "k_scale": ((b, h, tokens // g, d), torch.float16),
            "k_zero": ((b, h, tokens // g, d), torch.float16),
            "qv": ((b, h, tokens, d // vper), torch.int32),
            "v_scale": ((b, h, tokens, d // g), torch.float16),
            "v_zero": ((b, h, tokens, d // g), torch.float16),
        }
        old, self.packed = (
            self.packed,
            {name: torch.zeros(shape, dtype=dt, device=like.device) for name, (shape, dt) in shapes.items()},
        )
        if old and self.n_q:
            self._store_packed({name: self._held(old[name], name) for name in PACKED_KV}, 0)

    def _rows(self, name: str, tokens: int) -> int:
        """Rows (dim 2) of packed tensor ``name`` that ``tokens`` quantised tokens fill."""
        if name == "qk":
            return tokens // (32 // self.settings.kbits)
        return tokens // self.settings.group_size if name.startswith("k_") else tokens

    def _held(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return tensor[:, :, : self._rows(name, self.n_q)]

    def _store_packed(self, parts: dict[str, torch.Tensor], at: int) -> None:
        """Write packed ``parts`` (each holding a whole number of chunks) from quantised token ``at``."""
        for name, part in parts.items():
            start = self._rows(name, at)
            self.packed[name][:, :, start : start + part.shape[2]] = part

    @property
    def capacity(self) -> int:
        return self.packed["qv"].shape[2] if self.packed else 0

    # -- decode -----------------------------------------------------------------------------------
    def before_step(self, t: int) -> None:
        r = self.settings.residual_tokens
        room = self.n_q + (self.r_host + t) // r * r
        if room > self.capacity:
            assert self.rk is not None
            self._allocate(room + max(r, self.capacity // 2 // r * r), self.rk)
        self._flush_now = t == 1 and self.r_host + 1 == r

    def after_step(self, t: int) -> None:
        self.seen += t
        self.r_host = (self.r_host + t) % self.settings.residual_tokens  # a full residual was flushed
        self._flushed = self._flush_now = False

    def graph_key(self) -> tuple[Any, ...] | None:
        """``None`` for a step that quantises the residual (run eagerly, never captured)."""
        return None if self._flush_now else (self.capacity, self.n_q)

    def step(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        assert self.rk is not None and self.rv is not None and self.r_dev is not None
        self.rk.index_copy_(2, self.r_dev, keys)
        self.rv.index_copy_(2, self.r_dev, values)
        self.r_dev.add_(1)
        if self._flush_now:  # the residual is full: quantised in this step, as the reference does
            self._flush(self.settings.residual_tokens)
        if use_triton(queries.device) and queries.shape[3] % 16 == 0:
            from ov_kvcrush.kernels.quant2_attention import quant2_decode_attention

            packed = tuple(self.packed[name] for name in PACKED_KV)
            g = self.settings.group_size
            st = self.settings
            return quant2_decode_attention(
                queries, packed, self.n_q, g, self.rk, self.rv, self.r_dev, self.scale, st.kbits, st.vbits
            )
        k, v = self._dequantised()
        visible = torch.cat(
            [
                torch.ones(self.n_q, dtype=torch.bool, device=k.device),
                torch.arange(self.rk.shape[2], device=k.device) < self.r_dev,
            ]
        )
        return self._sdpa(queries, k, v, visible.view(1, 1, 1, -1))

    def _flush(self, tokens: int) -> None:
        """Quantise the residual's first ``tokens`` (whole chunks, after the pinned) into the store (eager only)."""
        assert self.rk is not None and self.rv is not None and self.r_dev is not None
        p = self.pinned
        st = self.settings
        parts = pack_kv(self.rk[:, :, p : p + tokens], self.rv[:, :, p : p + tokens], st.group_size, st.kbits, st.vbits)
        self._store_packed(parts, self.n_q)
        self.n_q += tokens
        rest = self.rk.shape[2] - p - tokens
        self.rk[:, :, p : p + rest] = self.rk[:, :, p + tokens :].clone()
        self.rv[:, :, p : p + rest] = self.rv[:, :, p + tokens :].clone()
        self.r_dev.sub_(tokens)
        self._flushed = True

    def _dequantised(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The quantised part dequantised, then the whole pinned + residual buffer (unwritten slots: zeros)."""
        assert self.rk is not None and self.rv is not None
        held = {name: self._held(self.packed[name], name) for name in PACKED_KV}
        st = self.settings
        k, v = unpack_kv(held, st.group_size, self.rk.dtype, st.kbits, st.vbits)
        return torch.cat([k, self.rk], dim=2), torch.cat([v, self.rv], dim=2)

    def _multi_step(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Several tokens (eager): appended and flushed as the reference's store does, attended causally."""
        assert self.rk is not None and self.rv is not None and self.r_dev is not None
        r, t = self.settings.residual_tokens, keys.shape[2]
        for i in range(t):
            self.rk.index_copy_(2, self.r_dev, keys[:, :, i : i + 1])
            self.rv.index_copy_(2, self.r_dev, values[:, :, i : i + 1])
            self.r_dev.add_(1)
            if int(self.r_dev) == self.pinned + r:
                self._flush(r)
        held = self.n_q + self.pinned + (self.r_host + t) % r
        k, v = self._dequantised()
        k, v = k[:, :, :held], v[:, :, :held]
        pos = torch.arange(self.seen, self.seen + t, device=keys.device)
        return self._attend(queries, k, v, q_positions=pos, k_positions=self._positions_held(k.shape[2])).output

    def _positions_held(self, n: int) -> torch.Tensor:
        """``[b, hk, n]`` positions of the ``n`` held tokens in the store's order: the quantised (the
        prompt's, then the residual's as flushed), the pinned, then the residual's rest. The residual
        stream is the prompt's unflushed tokens followed by every generated one."""
        assert self.prompt_positions is not None
        kept_q, pinned, kept_r = self.prompt_positions
        generated = n - kept_q.shape[2] - pinned.shape[2] - kept_r.shape[2]
        gen = torch.arange(self.prompt_tokens, self.prompt_tokens + generated, device=kept_r.device)
        stream = torch.cat([kept_r, gen.expand(*kept_r.shape[:2], -1)], dim=2)
        flushed = self.n_q - kept_q.shape[2]
        return torch.cat([kept_q, stream[:, :, :flushed], pinned, stream[:, :, flushed:]], dim=2)

    # -- what is held ---------------------------------------------------------------------------
    def tokens_held(self) -> torch.Tensor:
        assert self.rk is not None
        return torch.full(self.rk.shape[:2], self.n_q + self.pinned + self.r_host, dtype=torch.long)

    def _metadata(self) -> list[torch.Tensor | None]:
        return [self.r_dev, *(self.prompt_positions or ()), *self._device_counters.values()]

    def memory(self) -> dict[str, int]:
        kv = tensor_bytes(*self.packed.values(), self.rk, self.rv)
        meta = tensor_bytes(*self._metadata())
        return {"kv": kv, "metadata": meta, "total": kv + meta}
