"""A sliding-window layer on the GPU plugin's path: Gemma 3's (and Gemma 2's) local layers.

The CPU op's rule (``attention_step.cpp``: ``window``): a local layer's row at position ``p``
attends the positions ``(p - window, p]``, the layer keeps a ring of blocks, and the method never
runs there (its budget and selection are the global layers'). Here the model's prompt layer is
compiled with the window (``plugin_layers.cl``'s ``WINDOW``: a row sees the last ``window`` of its
slots, which hold consecutive positions, since nothing is evicted from the layer), and after each
step the blocks whose every slot lies before the next rows' windows go back to the pool: the layer
holds the window, the step's tokens and less than a block more, as the ring does (blocks handed
back rather than overwritten: the tables stay in slot order, so the kernels need no ring offset).
In a step of the method's scoring pass (KVzip's, run on the global layers) the layer attends its
window as a decode step would, scores nothing, and keeps nothing of the step (the CPU op's rule).
"""

from __future__ import annotations

from typing import Any

from ov_kvcrush.gpu.layer_cache import DeviceFullLayerCache
from ov_kvcrush.gpu.pool import DevicePool
from ov_kvcrush.gpu.slots import StepLogits


class DeviceWindowLayerCache(DeviceFullLayerCache):
    """One local layer over the device pool: every token stored, a row attending the last
    ``window`` slots up to its own (the model's layer does), the slots no later row sees let go."""

    method_runs = False

    def __init__(self, window: int, pool: DevicePool, kv_heads: int, q_heads: int) -> None:
        if window < 1:
            raise ValueError(f"window {window}: a local layer's window is at least 1 token")
        super().__init__(pool, kv_heads, q_heads)
        self.window = window
        #: the next step is a step of the method's scoring pass
        self.scoring = False
        #: the tokens held before the scoring step being fed (None: no such step)
        self.before_scoring: int | None = None

    # ---- a step of the method's scoring pass
    def score_positions(self, lo: int, hi: int) -> None:
        """The next step is a step of the method's scoring pass (whatever it repeats: the layer
        attends its window and drops the step after)."""
        self.scoring = True

    def end_scoring_pass(self, keep_scores: bool = True) -> None:
        """The pass is over; a step of it the model did not finish dropped too."""
        self._end_scoring_step()

    def attends_own(self, t: int) -> bool:
        return self.scoring or super().attends_own(t)

    def reserve(self, t: int) -> None:
        if self.scoring:
            self.before_scoring = self.seen
        super().reserve(t)

    def _end_scoring_step(self) -> None:
        """The scoring step's tokens, where it stored any, forgotten and its blocks given back (the
        window kept whole); the layer's next step is its own again."""
        if self.before_scoring is not None:
            super().truncate(self.before_scoring)
            self.before_scoring = None
        self.scoring = False

    def first_seen(self, position: int) -> int:
        """The first position the rows from ``position`` on see: the row at ``position`` sees
        ``(position - window, position]``, the later rows less of the past."""
        return max(0, position - self.window + 1)

    def after_model_step(self, rows: Any, t: int, logits: StepLogits | None = None, sums: Any = None) -> None:
        """No method's work; the whole blocks before the next rows' windows back to the pool (after
        a scoring step, its tokens instead)."""
        if self.before_scoring is not None:
            self._end_scoring_step()
            return
        self.forget_passed_blocks()

    def forget_passed_blocks(self) -> None:
        """Every head's leading blocks whose slots all lie before what the next step's rows see
        (:meth:`first_seen` of :attr:`seen`) given back (the slots after them keep their order, a
        block's worth of slots lower each)."""
        lay = self.layer
        if not lay.held:
            return
        passed = self.first_seen(self.seen) - int(lay.positions[0, 0])  # the slots hold consecutive positions
        blocks = max(0, passed) // lay.pool.shape.block_size
        if blocks:
            lay.drop_leading_blocks(blocks)

    def truncate(self, tokens: int) -> bool:
        """As the full cache's where the layer still holds what the rows after ``tokens`` see; False
        (nothing dropped) where those slots were given back (the loop then feeds the conversation
        again)."""
        held_from = int(self.layer.positions[0, 0]) if self.layer.held else 0
        if tokens < self.seen and held_from > self.first_seen(tokens):
            return False
        return super().truncate(tokens)
