"""Where a layer's kept keys/values live: full precision, or MiniKV's bit-packed 2-/4-bit store.

Both stores hold ``[batch, kv_heads, tokens, head_dim]`` tokens in insertion order with their
absolute positions ``[batch, kv_heads, tokens]`` (heads may hold different positions after
eviction) and expose the same small interface, so any selection method can run over either
(the issue's "selection over a MiniKV store" composition):

* ``append`` new tokens, ``dense()`` to read everything back as float tensors,
* ``keep(index)`` to retain a per-head subset, ``replace`` to overwrite everything (merging),
* ``memory()`` with the bytes really allocated.

The 2-bit store keeps the newest tokens in full precision (the residual) and quantizes them
``residual_tokens`` at a time, as MiniKV/KIVI do. The prompt's last tokens may be *pinned*: kept in
full precision for good (``append(..., pin=n)``), since they usually hold the question, and a
question stored in 2 bits loses what the method selected for it (issue 24: SnapKV over the store
answered 0/3 needles at a budget of exactly 1024, 3/3 at 1088, where 64 more prompt tokens stayed
full precision). MiniKV's paper quantizes them like the rest; ``quant.prompt_tail=0`` does.

Keeping a subset of already-quantized tokens would break their per-channel key groups, so
:meth:`QuantStore.keep` only accepts subsets of a store with nothing quantized yet (selection at
prefill, frozen afterwards: MiniKV's design); methods that rewrite tokens (Chelsea's merges) use
:meth:`replace`, which re-quantizes.
"""

from __future__ import annotations

import torch

from ov_kvcrush.methods.attention import ShapeError
from ov_kvcrush.methods.base import LayerCache, QuantSettings, gather_tokens, tensor_bytes
from ov_kvcrush.methods.quant import PACKED_KV, pack_kv, unpack_kv


class FPStore:
    """Keys/values in their input dtype."""

    quantized = False

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, pin: int = 0) -> None:
        """Add tokens at the end; ``positions`` is ``[t]`` (same for every head) or ``[b, h, t]``.

        ``pin`` is :class:`QuantStore`'s (everything here is full precision already).
        """
        pos = positions.expand(*keys.shape[:2], keys.shape[2]) if positions.dim() == 1 else positions
        if self.keys is None:
            self.keys, self.values, self.positions = keys, values, pos.clone()
        else:
            self.keys = torch.cat([self.keys, keys], dim=2)
            self.values = torch.cat([self.values, values], dim=2)
            self.positions = torch.cat([self.positions, pos], dim=2)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(keys, values, positions)`` of everything held."""
        assert self.keys is not None and self.values is not None and self.positions is not None
        return self.keys, self.values, self.positions

    def keep(self, index: torch.Tensor) -> None:
        """Retain the tokens at per-head ``index`` ``[b, h, k]`` (in that order)."""
        assert self.keys is not None and self.values is not None and self.positions is not None
        self.keys = gather_tokens(self.keys, index)
        self.values = gather_tokens(self.values, index)
        self.positions = torch.gather(self.positions, 2, index)

    def replace(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Overwrite the whole content (after merging)."""
        self.keys, self.values, self.positions = keys, values, positions

    def memory(self) -> dict[str, int]:
        kv = tensor_bytes(self.keys, self.values)
        return {"kv": kv, "metadata": tensor_bytes(self.positions)}


class QuantStore:
    """MiniKV's store: bit-packed 2- or 4-bit keys (per channel) and values (per token) plus a full-precision residual.

    Layout per ``[batch, head]``, ``G = group_size``:

    * ``qk`` int32 ``[b, h, n_q / P_k, d]``: key codes packed along tokens (``P = 32 / bits``
      codes per word); ``k_scale``/``k_zero`` fp16 ``[b, h, n_q / G, d]`` (one per channel per
      ``G`` tokens);
    * ``qv`` int32 ``[b, h, n_q, d / P_v]``: value codes packed along channels; ``v_scale``/
      ``v_zero`` fp16 ``[b, h, n_q, d / G]``;
    * ``pk``/``pv`` ``[b, h, p, d]`` the pinned prompt tail in full precision (never quantized);
    * ``rk``/``rv`` ``[b, h, r, d]`` the newest ``r < residual_tokens`` tokens in full precision.

    :meth:`dense` reads them in that order (quantized, pinned, residual), with their positions.
    """

    quantized = True

    def __init__(self, settings: QuantSettings, deferred: bool = False) -> None:
        """``deferred``: appends never flush; the owner calls :meth:`flush_heads` after it has
        selected (KVzip: a prompt is held whole until its scoring pass has chosen what stays)."""
        self.settings = settings
        self.deferred = deferred
        self.qk = self.k_scale = self.k_zero = None
        self.qv = self.v_scale = self.v_zero = None
        self.pk: torch.Tensor | None = None
        self.pv: torch.Tensor | None = None
        self.rk: torch.Tensor | None = None
        self.rv: torch.Tensor | None = None
        # positions of the quantized, pinned and residual tokens, each [b, h, n]
        self.qpos: torch.Tensor | None = None
        self.ppos: torch.Tensor | None = None
        self.rpos: torch.Tensor | None = None
        self.dtype: torch.dtype = torch.float32
        self.flushes = 0

    # ---- sizes
    @property
    def quantized_tokens(self) -> int:
        return 0 if self.qv is None else self.qv.shape[2]

    @property
    def residual_len(self) -> int:
        return 0 if self.rk is None else self.rk.shape[2]

    @property
    def pinned_len(self) -> int:
        return 0 if self.pk is None else self.pk.shape[2]

    def __len__(self) -> int:
        return self.quantized_tokens + self.pinned_len + self.residual_len

    @property
    def positions(self) -> torch.Tensor | None:
        """``[b, h, n]`` positions of the tokens in :meth:`dense`'s order."""
        parts = [p for p in (self.qpos, self.ppos, self.rpos) if p is not None]
        return None if not parts else parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

    @positions.setter
    def positions(self, value: torch.Tensor) -> None:
        """Overwrite the positions (a padding slot gets ``-1``), in :meth:`dense`'s order."""
        nq, npin = self.quantized_tokens, self.pinned_len
        if nq:
            self.qpos = value[:, :, :nq].clone()
        if self.pk is not None:
            self.ppos = value[:, :, nq : nq + npin].clone()
        if self.rk is not None:
            self.rpos = value[:, :, nq + npin :].clone()

    # ---- writing
    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, pin: int = 0) -> None:
        """Add tokens to the residual; quantize whole ``residual_tokens`` chunks as they fill.

        ``pin``: the last ``pin`` tokens held after this append (the prompt's tail) stay in full
        precision for good; only once, with nothing pinned yet.
        """
        g = self.settings.group_size
        if keys.shape[3] % g:
            raise ShapeError(
                f"head_dim={keys.shape[3]} must be a multiple of quant.group_size={g} for the quantized store"
            )
        self.dtype = keys.dtype
        pos = positions.expand(*keys.shape[:2], keys.shape[2]) if positions.dim() == 1 else positions
        if self.rk is None:
            self.rk, self.rv = keys, values
        else:
            self.rk = torch.cat([self.rk, keys], dim=2)
            self.rv = torch.cat([self.rv, values], dim=2)
        self.rpos = pos.clone() if self.rpos is None else torch.cat([self.rpos, pos], dim=2)
        if pin > 0:
            self._pin(pin)
        if not self.deferred:
            self._flush()

    def _pin(self, n: int) -> None:
        """Move the residual's last ``n`` tokens (at most all of it) into the pinned part."""
        if self.pk is not None:
            raise RuntimeError("QuantStore: the prompt's tail is pinned once")
        assert self.rk is not None and self.rv is not None and self.rpos is not None
        cut = max(0, self.rk.shape[2] - n)
        # copies, so that neither part keeps the other's storage alive
        self.pk, self.pv, self.ppos = (x[:, :, cut:].clone() for x in (self.rk, self.rv, self.rpos))
        self.rk, self.rv, self.rpos = (x[:, :, :cut].clone() for x in (self.rk, self.rv, self.rpos))

    def _flush(self) -> None:
        r = self.settings.residual_tokens
        assert self.rk is not None and self.rv is not None and self.rpos is not None
        n = (self.rk.shape[2] // r) * r
        if n == 0:
            return
        self._quantize_append(self.rk[:, :, :n], self.rv[:, :, :n])
        moved = self.rpos[:, :, :n]
        self.qpos = moved.clone() if self.qpos is None else torch.cat([self.qpos, moved], dim=2)
        self.rk, self.rv, self.rpos = self.rk[:, :, n:], self.rv[:, :, n:], self.rpos[:, :, n:].clone()
        self.flushes += 1

    def _quantize_append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        st = self.settings
        for name, part in pack_kv(k, v, st.group_size, st.kbits, st.vbits).items():
            held = getattr(self, name)
            setattr(self, name, part if held is None else torch.cat([held, part], dim=2))

    # ---- reading
    def dense(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dequantized keys/values (quantized part first, then the pinned, then the residual) and positions."""
        parts_k, parts_v = [], []
        if self.qk is not None:
            st = self.settings
            packed = {name: getattr(self, name) for name in PACKED_KV}
            k, v = unpack_kv(packed, st.group_size, self.dtype, st.kbits, st.vbits)
            parts_k.append(k)
            parts_v.append(v)
        for k, v in ((self.pk, self.pv), (self.rk, self.rv)):
            if k is not None:
                parts_k.append(k)
                parts_v.append(v)
        positions = self.positions
        assert positions is not None
        return torch.cat(parts_k, dim=2), torch.cat(parts_v, dim=2), positions

    def keep(self, index: torch.Tensor) -> None:
        """Retain a per-head subset of the full-precision residual (``index`` ``[b, h, k]`` in
        :meth:`dense`'s slots). Quantized tokens are frozen (their key groups cannot lose members):
        ``index`` must start with every quantized slot, in order. Nothing may be pinned."""
        if self.pk is not None:
            raise RuntimeError("QuantStore.keep: pinned tokens are frozen; select before pinning")
        nq = self.quantized_tokens
        if nq:
            whole = torch.arange(nq, device=index.device).expand(*index.shape[:2], nq)
            if index.shape[2] < nq or not torch.equal(index[:, :, :nq], whole):
                raise RuntimeError("QuantStore.keep: quantized tokens are frozen; keep them all, first")
            index = (index[:, :, nq:] - nq).clamp_min(0)
        assert self.rk is not None and self.rv is not None and self.rpos is not None
        self.rk = gather_tokens(self.rk, index)
        self.rv = gather_tokens(self.rv, index)
        self.rpos = torch.gather(self.rpos, 2, index)
        if not self.deferred:
            self._flush()

    def order_of(self, positions: torch.Tensor) -> torch.Tensor | None:
        """The index ``[b, h, n]`` that takes per-token state listed by ``positions`` (``[n]`` or
        ``[b, h, n]``: the same tokens, in another order) to :meth:`dense`'s order, ``None`` when
        the orders agree: pinning the prompt's tail and each flush reorder the tokens (quantized,
        pinned, residual)."""
        held = self.positions
        if held is None:
            return None
        if positions.dim() == 1:  # the same for every head, as `append` takes them
            positions = positions.expand_as(held)
        if torch.equal(positions, held):
            return None
        index = torch.empty_like(held)
        return index.scatter_(-1, torch.argsort(held, dim=-1), torch.argsort(positions, dim=-1))

    def keep_chunks(self, chunks: torch.Tensor) -> torch.Tensor:
        """Keep the quantized chunks ``chunks`` ``[b, h, k]`` (ascending; chunk ``c`` is quantized
        tokens ``[c * residual_tokens, (c + 1) * residual_tokens)``, a whole number of key groups
        and packed words) and drop the others: the unit a decode-time eviction can drop, since a
        key group cannot lose single members. Returns the kept tokens' former slots in
        :meth:`dense`'s order (``[b, h, n']``; the pinned and residual tokens all stay) for the
        owner's per-token state."""
        r = self.settings.residual_tokens
        nq = self.quantized_tokens
        assert self.qpos is not None and nq % r == 0
        b, h, _ = chunks.shape

        def rows(per_chunk: int) -> torch.Tensor:
            step = torch.arange(per_chunk, device=chunks.device)
            return (chunks.unsqueeze(-1) * per_chunk + step).reshape(b, h, -1)

        for name in PACKED_KV:
            part = getattr(self, name)
            setattr(self, name, gather_tokens(part, rows(part.shape[2] * r // nq)))
        kept = rows(r)
        self.qpos = torch.gather(self.qpos, 2, kept)
        rest = torch.arange(nq, nq + self.pinned_len + self.residual_len, device=chunks.device).expand(b, h, -1)
        return torch.cat([kept, rest], dim=2)

    def flush_heads(self) -> torch.Tensor | None:
        """Quantize, head by head, the largest multiple of ``residual_tokens`` of the residual's
        real tokens (position ``>= 0``), in slot order: what the op's store does with heads that
        hold different counts. The quantized part stays one width for all heads: a head that
        quantizes fewer tokens fills its part with zero padding slots (position ``-1``); whole
        groups of them, since ``residual_tokens`` is a multiple of the group, so no real token
        shares a key group with padding. The rest of each head stays full precision.

        Returns the residual's new layout (``[b, h, k]`` indices into the old residual, the old
        residual's length for a padding slot; quantized part first) for the owner's per-slot
        state, or ``None`` when nothing was quantized.
        """
        assert self.pk is None, "QuantStore.flush_heads: nothing may be pinned"
        if self.rk is None:
            return None
        assert self.rv is not None and self.rpos is not None
        r = self.settings.residual_tokens
        p = self.rpos
        n = p.shape[2]
        real = p >= 0
        rank = torch.cumsum(real.long(), dim=-1) - 1
        flushed = real & (rank < (real.sum(-1, keepdim=True) // r * r))
        rest = real & ~flushed
        width_q, width_r = int(flushed.sum(-1).max()), int(rest.sum(-1).max())
        if width_q == 0:
            return None
        slot = torch.arange(n, device=p.device).expand_as(p)

        def first(mask: torch.Tensor, width: int) -> torch.Tensor:
            # the slots of `mask` in order, then the padding slot n, `width` in all
            order = torch.sort(torch.where(mask, slot, slot + n), dim=-1).values[:, :, :width]
            return torch.where(order < n, order, torch.full_like(order, n))

        index = torch.cat([first(flushed, width_q), first(rest, width_r)], dim=2)
        zero = self.rk.new_zeros(*self.rk.shape[:2], 1, self.rk.shape[3])
        k = gather_tokens(torch.cat([self.rk, zero], dim=2), index)
        v = gather_tokens(torch.cat([self.rv, zero], dim=2), index)
        pos = torch.gather(torch.cat([p, p.new_full((*p.shape[:2], 1), -1)], dim=2), 2, index)
        self._quantize_append(k[:, :, :width_q], v[:, :, :width_q])
        moved = pos[:, :, :width_q]
        self.qpos = moved.clone() if self.qpos is None else torch.cat([self.qpos, moved], dim=2)
        self.rk, self.rv, self.rpos = k[:, :, width_q:], v[:, :, width_q:], pos[:, :, width_q:].clone()
        self.flushes += 1
        return index

    def replace(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Re-encode everything from full-precision (or dequantized-and-merged) tensors (nothing pinned)."""
        self.qk = self.k_scale = self.k_zero = self.qv = self.v_scale = self.v_zero = None
        self.pk = self.pv = self.rk = self.rv = None
        self.qpos = self.ppos = self.rpos = None
        self.append(keys, values, positions)

    def memory(self) -> dict[str, int]:
        kv = tensor_bytes(
            self.qk, self.k_scale, self.k_zero, self.qv, self.v_scale, self.v_zero, self.pk, self.pv, self.rk, self.rv
        )
        return {"kv": kv, "metadata": tensor_bytes(self.qpos, self.ppos, self.rpos)}


def make_store(quant: QuantSettings | None, deferred: bool = False) -> FPStore | QuantStore:
    """The store a method uses: full precision, or quantized when ``quant`` is set (``deferred``:
    see :class:`QuantStore`)."""
    return FPStore() if quant is None else QuantStore(quant, deferred)


class StoredLayerCache(LayerCache):
    """A layer cache whose tokens live in ``self.store``, its heads padded with ``-1`` positions
    once they keep different counts (the importance methods, KVzip): what it holds, a per-head
    keep, and its bytes (the store's plus :meth:`_metadata_tensors`)."""

    store: FPStore | QuantStore

    def _metadata_tensors(self) -> tuple[torch.Tensor | None, ...]:
        """The method's own per-token state (scores ...), counted as metadata."""
        return ()

    def _keep_padded(self, index: torch.Tensor) -> torch.Tensor:
        """Keep the slots ``index`` ``[b, h, k]`` of each head (``-1``: a padding slot), counting
        what goes as ``evicted``; returns the mask of real slots."""
        positions = self.store.positions
        assert positions is not None
        before = int((positions >= 0).sum())
        valid = index >= 0
        self.store.keep(index.clamp_min(0))
        kept = self.store.positions
        assert kept is not None
        self.store.positions = torch.where(valid, kept, torch.full_like(index, -1))
        self._bump("evicted", before - int((self.store.positions >= 0).sum()))
        return valid

    def tokens_held(self) -> torch.Tensor:
        if self.store.positions is None:
            return torch.zeros(0, 0, dtype=torch.long)
        return (self.store.positions >= 0).sum(-1)

    def kept_positions(self) -> torch.Tensor:
        """``[b, hk, n]`` absolute positions of the held tokens (``-1`` for padding)."""
        assert self.store.positions is not None
        return self.store.positions

    def memory(self) -> dict[str, int]:
        m = self.store.memory()
        meta = m["metadata"] + tensor_bytes(*self._metadata_tensors())
        return {"kv": m["kv"], "metadata": meta, "total": m["kv"] + meta}
