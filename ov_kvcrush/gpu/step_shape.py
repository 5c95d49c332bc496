"""The shapes a step shows OpenVINO's GPU plugin: a few sizes, so that our layers compile a few times.

The plugin's JIT for a ``SimpleGPU`` custom layer writes every input's shape into the layer's
program (``custom_primitive.cpp``: ``INPUT0_DIMS`` and the rest), and a program is compiled for
each new text. So each of our layers was compiled again for every step whose token count, number
of sequences or block tables' width had not been seen before: every new prompt length, chunk
remainder or batch size (found in the emulation's program cache, 2026-12-01). On a GPU that is a
compile in the middle of serving.

A step is shown at the next of a few sizes instead (:func:`step_size`): its tokens exact up to
:data:`EXACT`, then at most one eighth over (eight sizes a doubling: the padding
is work the model does), its sequences and its tables' width a power of two (:func:`table_width`;
their padding is rows no kernel works on). The tokens added are a sequence of their own,
after the step's (:class:`StepPadding`), whose every block is the pool's pad block (one block the
pool keeps for it): they are stored there and attend their own slots there alone, as a
sequence's tokens do, so no kernel is told of them, and no one reads what they give (the logits
come at the real sequences' last tokens, the methods read the real rows). The rows added beyond
it say "nothing here" to every layer: no slots, no 2-bit slots, no flush, no recall, no merge.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ov_kvcrush.gpu.layer_inputs import token_tensor

#: counts up to this are shown as they are (decode steps of a few sequences: no tokens added)
EXACT = 8
#: the least width of a step's block tables (blocks)
MIN_TABLE_WIDTH = 16


def step_size(n: int) -> int:
    """The size a step's ``n`` tokens (or its query rows) are shown at: ``n`` up to :data:`EXACT`, else
    the least ``m * 2**k`` at or above it with ``m`` in [8, 16) (at most ``n / 8`` more)."""
    if n <= EXACT:
        return max(n, 1)
    shift = n.bit_length() - 4  # n >> shift is in [8, 16)
    return -(-n >> shift) << shift


def power_of_two(n: int) -> int:
    """The least power of two at or above ``n`` (at least 1)."""
    return 1 << max(n - 1, 0).bit_length()


def table_width(blocks: int) -> int:
    """A step's block tables' width for a longest table of ``blocks``: a power of two, at least
    :data:`MIN_TABLE_WIDTH`, so that the tables kept on the device keep their shape for many steps
    (:class:`~ov_kvcrush.gpu.table_mirror.TableMirror` sends them whole when it changes) and the
    layers see a few widths in a sequence's life."""
    return max(MIN_TABLE_WIDTH, power_of_two(blocks))


@dataclass(frozen=True)
class StepPadding:
    """How a step of ``counts[s]`` tokens for its sequences ``s`` is shown: ``tokens`` in all
    (the step's and ``padding`` more, of the pad sequence, index ``len(counts)``) and
    ``sequences`` rows of sequences (the step's, then the pad sequence's and empty ones)."""

    counts: tuple[int, ...]
    tokens: int
    sequences: int

    @classmethod
    def of(cls, counts: list[int]) -> StepPadding:
        tokens = step_size(sum(counts))
        padded = tokens > sum(counts)
        return cls(tuple(counts), tokens, power_of_two(len(counts) + padded))

    @property
    def padding(self) -> int:
        """The tokens added (the pad sequence's)."""
        return self.tokens - sum(self.counts)

    def token_rows(self, block_size: int, own: list[bool]) -> np.ndarray:
        """The layers' ``tokens`` input ``[tokens, 3]`` (:func:`token_tensor`; ``own[s]``: sequence
        ``s``'s rows attend the step's own tokens exactly); the pad sequence's indices wrap at
        ``block_size`` (its one block: its tokens overwrite each other's slots, which no one
        reads), and its rows read the store."""
        rows = token_tensor([*self.counts, self.padding], [*own, False])  # the pad sequence's tokens last
        rows[sum(self.counts) :, 1] %= block_size
        return rows

    def pad_slots(self, block_size: int) -> int:
        """The slots the pad sequence holds in the step (its tokens' slots, in its one block)."""
        return min(self.padding, block_size)

    def rows(self, array: np.ndarray, kv_heads: int, fill: np.ndarray | int) -> np.ndarray:
        """``array`` ``[layers, len(counts) * kv_heads, ...]`` with rows ``fill`` added up to
        ``sequences * kv_heads`` (``fill``: one row's values, or a number)."""
        layers, have = array.shape[:2]
        out = np.empty((layers, self.sequences * kv_heads, *array.shape[2:]), array.dtype)
        out[:, :have] = array
        out[:, have:] = fill
        return out

    def model_tokens(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A ragged step's model inputs (``input_ids [1, T]``, ``position_ids [1, T]``) with the
        pad sequence's tokens after the step's: token 0 at position 0 (what they compute is read
        by no one)."""
        out = dict(feed)
        for name in ("input_ids", "position_ids"):
            if name in out:
                x = out[name]
                out[name] = np.concatenate([x, np.zeros((x.shape[0], self.padding), x.dtype)], axis=1)
        return out
