"""Seeded test vectors shared by the reference tests and every fast path's tests (C++ op, CUDA).

Random Gaussian keys make every method look alike (no structure to exploit), so the generator
also plants what real attention has: a few heavy tokens every head attends to, clustered keys
that drift slowly along the sequence (neighbouring keys are similar, as Chelsea observes), and a
large-norm first token (an attention sink).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerVectors:
    """One layer's inputs: ``queries [b, hq, n, d]``, ``keys``/``values [b, hk, n, d]``."""

    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor

    def step(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token ``i`` alone (a decode step's inputs)."""
        return self.queries[:, :, i : i + 1], self.keys[:, :, i : i + 1], self.values[:, :, i : i + 1]

    def prefix(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first ``n`` tokens (a prompt)."""
        return self.queries[:, :, :n], self.keys[:, :, :n], self.values[:, :, :n]


def layer_vectors(
    seed: int = 0,
    *,
    batch: int = 1,
    kv_heads: int = 3,
    q_heads: int = 9,
    tokens: int = 256,
    head_dim: int = 64,
    clusters: int = 12,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> LayerVectors:
    """Structured random inputs for one layer, identical for a given seed on every device."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(batch, kv_heads, clusters, head_dim, generator=g) * 2.0
    # slowly drifting cluster choice: runs of 8-40 tokens share a cluster
    labels = torch.empty(batch, kv_heads, tokens, dtype=torch.long)
    for b in range(batch):
        for h in range(kv_heads):
            i = 0
            while i < tokens:
                run = int(torch.randint(8, 41, (1,), generator=g))
                labels[b, h, i : i + run] = int(torch.randint(clusters, (1,), generator=g))
                i += run
    keys = torch.gather(centres, 2, labels.unsqueeze(-1).expand(batch, kv_heads, tokens, head_dim))
    keys = keys + 0.5 * torch.randn(batch, kv_heads, tokens, head_dim, generator=g)
    keys[:, :, 0] *= 4.0  # sink
    values = torch.randn(batch, kv_heads, tokens, head_dim, generator=g)
    group = q_heads // kv_heads
    queries = keys.repeat_interleave(group, dim=1)[:, :, torch.randperm(tokens, generator=g)] * 0.3
    queries = queries + torch.randn(batch, q_heads, tokens, head_dim, generator=g)
    heavy = torch.randint(min(1, tokens - 1), tokens, (4,), generator=g)  # tokens every head likes
    queries = queries + 0.2 * keys.repeat_interleave(group, dim=1)[:, :, heavy].mean(2, keepdim=True)
    return LayerVectors(queries.to(device, dtype), keys.to(device, dtype), values.to(device, dtype))
