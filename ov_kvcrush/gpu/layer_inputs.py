"""What a step feeds our GPU plugin layers (:mod:`ov_kvcrush.gpu.plugin_layers`) besides the
model's own tensors: the int32 ``step`` tensor a layer's kernel reads its numbers from (a custom
layer takes no scalar argument), each token's row of ``tokens``, the ClusterKV and Quest rows'
``recall`` fields, and the layout of the buffers of ours the layers write in place (``recalled``,
``logits``: the decode rows' logits, a prompt's window sums, the rows' log-sum-exp, a decode row's
partitions). ``plugins/gpu/kernels/plugin_layers.cl`` reads them by the same indices and offsets;
:func:`~ov_kvcrush.gpu.step_plan.plan_step` lays a step out with them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ov_kvcrush.gpu.device import kernel_define
from ov_kvcrush.gpu.plugin_layers import DECODE_PARTS, SOURCE

#: what the int32 tensor ``step`` holds, in order (a layer's kernel takes no scalar argument)
STEP_FIELDS = (
    "table_width", "rows", "qtable_width", "score_rows", "logit_stride", "map_width", "candidates", "decode_split",
    "sum_stride", "sum_max", "lse_at", "parts_at",
)  # fmt: skip
#: the ints of a row's ``recall`` (``plugin_layers.cl``'s RECALL_WIDTH); the first is always the
#: step's token whose query recalls (-1: none, the row attends its slots in order)
RECALL_WIDTH = 12
#: a row's ``recall`` under ClusterKV (:class:`OvkcRecall`; ``plugin_layers.cl``'s R_* defines):
#: the token, the KV head, the clusters, the words in ``index`` where the centroids, sizes,
#: offsets and sorted slots start, the slots clustered, the sinks, the first pending slot, the
#: recall budget, the slots held
RECALL_FIELDS = (
    "token", "head", "clusters", "centroids", "sizes", "offsets", "sorted", "clustered", "sinks", "pending",
    "budget", "held",
)  # fmt: skip
#: a row's ``recall`` under Quest (:class:`OvkcPages`; the P_* defines): the token, the KV head,
#: the pages after the step, the words in ``index`` of the pages' key maxima and minima ([pages,
#: HEAD_DIM] floats each, written by the layer), the first page whose bounds it computes, the pages
#: it keeps (the newest among them), the slots held, the page size
PAGE_FIELDS = ("token", "head", "pages", "kmax", "kmin", "first_page", "want", "held", "page")


def step_tensor(
    table_width: int,
    rows: int = 1,
    qtable_width: int = 1,
    score_rows: int = 0,
    logit_stride: int = 0,
    map_width: int = 0,
    candidates: int = 0,
    decode_split: int = 0,
    sums: WindowSums | None = None,
    parts_at: int = 0,
) -> np.ndarray:
    """The ``step`` input (:data:`STEP_FIELDS`): the block tables' width, the step's tokens, the
    2-bit block tables' width, the query rows :class:`OvkcRows` writes, the row stride of the
    logits the prompt layers write (0: none; :func:`logits_bytes`), and under a recall (ClusterKV,
    Quest) the longest slot list a row attends and the most clusters or pages a row ranks
    (:func:`recalled_bytes`); ``decode_split``: every token is a decode row (each its own
    sequence's one), which the prompt layers then attend in partitions, a sub-group each, merged by
    the rows layer; ``sums``: the score rows' window sums :class:`OvkcRows` writes (none: not asked).
    The rows' log-sum-exp goes after the logits or the sums, where either is asked; with
    ``decode_split``, the rows' partitions' states at float ``parts_at`` (:func:`logits_layout`)."""
    sum_stride, sum_max, lse_at = (sums.stride, int(sums.largest), sums.lse_at) if sums else (0, 0, 0)
    fields = (table_width, rows, qtable_width, score_rows, logit_stride, map_width, candidates, decode_split,
              sum_stride, sum_max, lse_at, parts_at)  # fmt: skip
    return np.array(fields, np.int32)


@dataclass(frozen=True)
class WindowSums:
    """What a step asks of :class:`OvkcRows`: for each of its ``sequences`` (shown) and
    ``q_heads`` query heads, ``stride`` slots' probabilities summed over the sequence's score rows
    (``largest``: each slot's largest instead, KVzip's), from the model's own attention. In each
    layer's ``logits`` input: the sums ``[sequences, q_heads, stride]`` float, then each row's
    log-sum-exp ``[q_heads, rows]`` (the prompt layer's, which the sums take)."""

    sequences: int
    q_heads: int
    stride: int
    largest: bool = False

    @property
    def lse_at(self) -> int:
        """Where the rows' log-sum-exp starts in ``logits``, in floats: after the sums."""
        return self.sequences * self.q_heads * self.stride

    def nbytes(self, rows: int) -> int:
        """The bytes of ``logits`` for a step of ``rows`` rows."""
        return 4 * (self.lse_at + self.q_heads * rows)


def recalled_bytes(rows: int, map_width: int, candidates: int) -> int:
    """The bytes of the recall layers' ``recalled`` input for ``rows`` rows: per row the count of
    slots it attends, their list (``map_width``), the candidates' scores and their order (or, for
    Quest's pages, whether each is kept)."""
    return 4 * rows * (1 + map_width + 2 * candidates)


def logits_bytes(q_heads: int, rows: int, stride: int) -> int:
    """The bytes of a prompt layer's ``logits`` input for ``rows`` rows of ``stride`` slots: float
    logits [q_heads, rows, stride], then each row's log-sum-exp [q_heads, rows]."""
    return 4 * q_heads * rows * (stride + 1)


def logits_layout(q_heads: int, rows: int, head_dim: int, logit_stride: int = 0, sums: WindowSums | None = None,
                  split: bool = False) -> tuple[int, int]:  # fmt: skip
    """A step's ``logits`` input, each layer's: where its decode rows' partitions' softmax states
    start (``step_tensor``'s ``parts_at``, in floats; 0 without ``split``), and its bytes: the
    logits asked (:func:`logits_bytes`) or the window sums (:meth:`WindowSums.nbytes`), then with
    ``split`` (a step of ``rows`` decode rows alone) the partitions' states (``prefill.h``'s
    row_part_split: a max, a sum and ``head_dim`` values each, :data:`DECODE_PARTS` a row and
    query head), which the rows layer merges into each row's attention."""
    nbytes = logits_bytes(q_heads, rows if logit_stride else 1, logit_stride)
    if sums is not None:
        nbytes = max(nbytes, sums.nbytes(rows))
    if not split:
        return 0, nbytes
    return nbytes // 4, nbytes + 4 * q_heads * rows * DECODE_PARTS * (head_dim + 2)


#: the ints of a token's row of the ``tokens`` input (``plugin_layers.cl``'s TOKEN_FIELDS, read there)
TOKEN_FIELDS = kernel_define(SOURCE, "TOKEN_FIELDS")


def token_tensor(counts: list[int], own: list[bool] | None = None) -> np.ndarray:
    """The ``tokens`` input [T, 3] of a step feeding ``counts[s]`` tokens to its sequence ``s``:
    each token's sequence, its index among that sequence's tokens, and whether its rows attend the
    step's own tokens exactly (``own[s]``: a prompt's step, or several tokens; else they read the
    store, as a decode token's)."""
    own = own if own is not None else [False] * len(counts)
    rows = [(s, i, int(own[s])) for s, n in enumerate(counts) for i in range(n)]
    return np.array(rows, np.int32).reshape(-1, TOKEN_FIELDS)
