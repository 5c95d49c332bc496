"""Decode steps replayed as CUDA graphs: the model and the fast cache in one launch per token.

Eager decoding launches a few thousand small kernels per token from Python; on a GPU that, not
the memory traffic, sets the time per token (transformers' own eager decode of a Llama-3-8B runs
~90 ms per token where reading its weights takes ~5 ms). A CUDA graph records the kernels of one
step once and replays them with one launch. What it asks of the cache (values that change per
step in device tensors updated in place, no host reads) is met by the fast layers
(:mod:`ov_kvcrush.fastpath.dense`); the model's own modules meet it already (transformers
captures them for its compiled static cache).

:class:`GraphedDecoder` runs a step as: the cache's host work (``before_step``: clustering new
tokens, growing the store) -> the token and its position written into static input tensors ->
replay -> ``after_step``. When the cache's shapes change (:meth:`graph_key`: a clustering, a
larger store) the step runs eagerly once and is captured again, so a ClusterKV generation
captures once per ``cluster_every`` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ov_kvcrush.engines.hf_cache import CompressedCache


class GraphedDecoder:
    """One decode step of ``model`` over ``cache`` (fast layers only), captured and replayed;
    ``rows``: the sequences ``cache`` holds (a batch decodes one token per row per step)."""

    def __init__(self, model: Any, cache: CompressedCache, rows: int = 1) -> None:
        if not cache.graphable():
            raise ValueError("GraphedDecoder needs a cache of fast layers (CompressedCache(fast_path=True))")
        device = model.device
        self.model = model
        self.cache = cache
        self.ids = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.positions = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.key: tuple[Any, ...] | None = None
        self.logits: torch.Tensor | None = None
        #: captures made (the first step, then one per change of the cache's shapes)
        self.captures = 0
        #: whether the last step ran eagerly (a replayed step allocates nothing: the cache's memory
        #: is what it was after the step that was captured)
        self.last_eager = True

    def _forward(self) -> torch.Tensor:
        out = self.model(
            input_ids=self.ids,
            position_ids=self.positions,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1]

    def step(self, tokens: Sequence[int], position: int) -> torch.Tensor:
        """Feed one token per row at ``position`` (every row's); the next-token logits
        ``[rows, vocab]`` (valid until the next step)."""
        cache = self.cache
        cache.before_step(1)
        self.ids.copy_(torch.tensor(tokens, dtype=torch.long).view(-1, 1))
        self.positions.fill_(position)
        key = cache.graph_key()
        cache.set_graphed(True)
        try:
            with torch.inference_mode():
                self.last_eager = key is None or key != self.key or self.graph is None
                if self.last_eager:
                    logits = self._forward().clone()  # this step, eagerly (and the warm-up of the capture)
                    cache.after_step(1)
                    if key is None:  # a step with host work inside (MiniKV's flush): never captured
                        self.key = None
                    else:
                        self._capture(key)
                    return logits
                self.graph.replay()
        finally:
            cache.set_graphed(False)
        cache.after_step(1)
        assert self.logits is not None
        return self.logits

    def _capture(self, key: tuple[object, ...]) -> None:
        """Record the step for the cache's current shapes (nothing runs while recording)."""
        # The new graph shares the old one's memory pool, so a recapture does not grow the memory.
        # The old graph is dropped only after the new capture: a pool whose last graph is gone is
        # released, and capturing into it then fails inside torch's allocator.
        old, self.logits = self.graph, None  # the old output is dead: its block can be reused
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=None if old is None else old.pool()):
            self.logits = self._forward()
        self.graph, self.key = graph, key
        del old
        self.captures += 1
