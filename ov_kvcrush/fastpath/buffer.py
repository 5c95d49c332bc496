"""A layer's keys and values in preallocated tensors: appending a decode step writes in place.

The reference store (:class:`~ov_kvcrush.methods.store.FPStore`) concatenates every step, which
copies the whole cache per layer per token: at 32k tokens of a Llama-3-8B layer that is 128 MiB
read and written per step, the decode's largest cost after the model's weights. Here the tensors
grow geometrically (rarely, by at least :data:`GROWTH_TOKENS`), and a step writes ``t`` tokens.
"""

from __future__ import annotations

import torch

#: Smallest growth of a buffer, in tokens (and the rounding of every capacity).
GROWTH_TOKENS = 256


class KVBuffer:
    """``[batch, kv_heads, capacity, head_dim]`` keys and values; the first :attr:`n` slots are held.

    Args:
        reserve: tokens to leave free after the first append (the engine passes the new tokens it
            will generate, so a whole generation needs no reallocation).
    """

    def __init__(self, reserve: int = 0) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.n = 0
        self.reserve = max(0, int(reserve))

    @property
    def capacity(self) -> int:
        """Tokens the allocated tensors hold (0 before the first append)."""
        return 0 if self.keys is None else self.keys.shape[2]

    def reserve_for(self, t: int) -> None:
        """Make room for ``t`` more tokens (a reallocation moves the tensors: a new capacity)."""
        assert self.keys is not None and self.values is not None
        need = self.n + t
        if need > self.capacity:
            capacity = -(-(need + max(GROWTH_TOKENS, self.capacity // 2)) // GROWTH_TOKENS) * GROWTH_TOKENS
            self.keys = self._grown(self.keys, self.keys, capacity)
            self.values = self._grown(self.values, self.values, capacity)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``keys``/``values`` ``[b, hk, t, d]`` after the held tokens, growing if needed."""
        t = keys.shape[2]
        need = self.n + t
        if self.keys is None or self.values is None:
            capacity = -(-(need + self.reserve) // GROWTH_TOKENS) * GROWTH_TOKENS
            self.keys = self._grown(None, keys, capacity)
            self.values = self._grown(None, values, capacity)
        else:
            self.reserve_for(t)
        assert self.keys is not None and self.values is not None
        self.keys[:, :, self.n : need] = keys
        self.values[:, :, self.n : need] = values
        self.n = need

    def _grown(self, old: torch.Tensor | None, like: torch.Tensor, capacity: int) -> torch.Tensor:
        b, h, _, d = like.shape
        new = like.new_zeros((b, h, capacity, d))  # unwritten slots stay finite: masked, they still meet V
        if old is not None:
            new[:, :, : self.n] = old[:, :, : self.n]
        return new

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The held keys and values (views, no copy)."""
        assert self.keys is not None and self.values is not None
        return self.keys[:, :, : self.n], self.values[:, :, : self.n]

    def nbytes(self) -> int:
        """Bytes allocated (the capacity, not only the held tokens)."""
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values) if t is not None)
