"""KVCrush's selection on the GPU path (``plugins/gpu/kernels/kvcrush.cl``), step for step as
:func:`ov_kvcrush.methods.kvcrush.kvcrush_select` takes them, in one launch a selection.

Every step runs on the device, in one work-group a row (:func:`launch_select`; a decode step's
selections anew of all its sequences in one launch, :func:`launch_step_selections`): the heads'
scores summed (a block's, block-wise), the important tokens (sinks, recent, the top summed
scores), each head's decisions and the packed signatures, a ``mean`` anchor's majority bits, the
anchors' distances, the stable bucketing order, one representative per bucket, and the kept slots
listed; the host knows how many (:attr:`SelectFields.kept`), and nothing comes back (the tests'
step checks read each step's results from the launch's scratch, :func:`read_one_launch`). The
steps that order sort (a bitonic network over the row's scratch), so a selection of any size is
one launch. Random anchors are drawn by the caller (the reference's seeded generator).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ov_kvcrush.gpu.device import DirectTransfers, KernelDevice, Transfers, device
from ov_kvcrush.validation import check_choice, check_int

SIGNATURES = ("topk", "threshold")


@dataclass
class KVCrushGPUSelection:
    """What the device decided, in the reference's terms (``KVCrushSelection``), each step's
    result read back from a launch's scratch for the tests' step checks."""

    keep: np.ndarray  # ascending kept tokens
    important: np.ndarray  # ascending
    representatives: np.ndarray  # bucket order
    evictable: np.ndarray  # position order
    order: np.ndarray  # positions into evictable, bucketing order
    distances: np.ndarray  # [m, A]
    signatures: np.ndarray  # [n, W] packed, 32 heads per word
    anchors: np.ndarray  # [A, W] packed


def _kernel(dev: KernelDevice, name: str) -> Any:
    return dev.kernel("kvcrush.cl", name, {})


def top_mask(dev: KernelDevice, scores: Any, rows: int, n: int, lo: int, mid: int, keep: int) -> Any:
    """Device buffer uchar ``[rows][mid]``: is middle token i among row r's ``keep`` highest."""
    out = dev.empty(max(rows * mid, 1))
    if mid > 0:
        kernel = _kernel(dev, "head_decisions_topk")
        dev.run(kernel, (mid, rows), None, scores, np.int32(n), np.int32(lo), np.int32(mid), np.int32(keep), out)
    return out


def pack_anchor_bits(bits: np.ndarray) -> np.ndarray:
    """Bool ``[A, H]`` → uint32 ``[A, W]`` (head h: bit h % 32 of word h // 32)."""
    a, h = bits.shape
    w = max(1, -(-h // 32))
    padded = np.zeros((a, w * 32), np.uint64)
    padded[:, :h] = bits
    return (padded.reshape(a, w, 32) << np.arange(32, dtype=np.uint64)).sum(-1).astype(np.uint32)


def kvcrush_select(
    scores: np.ndarray,
    budget: int,
    sink_tokens: int,
    recent_tokens: int,
    representatives: int,
    *,
    anchor_bits: np.ndarray,
    mean_anchor: tuple[bool, ...] | None = None,
    signature: str = "topk",
    multi_anchor: str = "tuple",
    representative: str = "max_score",
    sub_group: int | None = None,
    block: int = 1,
) -> KVCrushGPUSelection:
    """KVCrush over per-query-head scores ``[H, n]`` (one batch row), ``budget < n``.

    ``anchor_bits`` ``[A, H]``: the fixed anchors; ``mean_anchor[a]`` replaces anchor ``a`` with
    the evictable tokens' per-bit majority. ``block``: over the whole blocks of that many tokens
    (their summed scores; the counts in blocks, the tokens past them kept), as the block-wise form
    selects. One launch (:func:`launch_select`), each step's result read from its scratch."""
    check_choice("signature", signature, SIGNATURES)
    check_choice("multi_anchor", multi_anchor, ("tuple", "nearest"))
    check_choice("representative", representative, ("max_score", "first"))
    check_int("block", block, 1, scores.shape[1])
    n = scores.shape[1]
    units = n // block
    check_int("budget", budget, sink_tokens + recent_tokens + representatives, units - 1)
    dev = device(sub_group)
    choice = KVCrushChoice(budget, sink_tokens, recent_tokens, representatives, anchor_bits, mean_anchor, signature,
                           multi_anchor, representative)  # fmt: skip
    scores_b = dev.to_device(scores.astype(np.float32))
    return read_one_launch(dev, launch_select(dev, DirectTransfers(dev), scores_b, n, n, block, units, [choice]))


@dataclass(frozen=True)
class KVCrushChoice:
    """What a KVCrush selection is asked for (the arguments of :func:`kvcrush_select`)."""

    budget: int
    sink_tokens: int
    recent_tokens: int
    representatives: int
    anchor_bits: np.ndarray  # [A, H] the fixed anchors
    mean_anchor: tuple[bool, ...] | None = None
    signature: str = "topk"
    multi_anchor: str = "tuple"
    representative: str = "max_score"


#: the lanes of ``kvcrush_select``'s work-group
SELECT_LANES = 128
#: each step's results in a row's scratch, in ``kvcrush.cl``'s order (S_SUMS ..): their names
SCRATCH = ("sums", "combined", "means", "flags", "by_flag", "signatures", "anchors", "distances", "keys", "order",
           "representatives", "kept", "sort")  # fmt: skip


@dataclass(frozen=True)
class SelectFields:
    """What one ``kvcrush_select`` launch is asked (its ``S_*`` fields): ``n`` slots held, taken
    as ``units`` of ``block`` tokens (the slots past them kept), with the choice's counts in units,
    over ``heads`` query heads a row."""

    n: int
    block: int
    units: int
    heads: int
    choice: KVCrushChoice

    @property
    def evictable(self) -> int:
        c = self.choice
        return self.units - (c.budget - c.representatives)

    @property
    def words(self) -> int:
        """32-bit words a signature: a bit a head."""
        return max(1, -(-self.heads // 32))

    @property
    def buckets(self) -> int:
        return min(self.choice.representatives, self.evictable)

    @property
    def kept(self) -> int:
        """The slots a row keeps: its kept units' tokens and the partial block's."""
        units = self.units - self.evictable + self.buckets
        return units * self.block + self.n - self.units * self.block

    def sizes(self) -> dict[str, int]:
        """Each step's result's words in a row's scratch (:data:`SCRATCH`)."""
        h, u, m, a, w = self.heads, self.units, self.evictable, self.choice.anchor_bits.shape[0], self.words
        sorts = h if self.choice.signature == "topk" else 1  # each head's middle sorted side by side
        words = (h * u, u, h, u, u, u * w, a * w, m * a, m, m, max(self.buckets, 1), u, 2 * sorts * self.sort_length)
        return dict(zip(SCRATCH, words, strict=True))

    @property
    def sort_length(self) -> int:
        """The keys a sort of the units takes (``kvcrush.cl``'s ``sort_length``: a power of two)."""
        return 1 << max(self.units - 1, 0).bit_length()

    @property
    def row_words(self) -> int:
        return self._layout()[1]

    def offsets(self) -> dict[str, int]:
        return self._layout()[0]

    def _layout(self) -> tuple[dict[str, int], int]:
        """Each result's first word in a row's scratch, and the row's words: the sort's keys
        (ulongs) at an even word, and a row of an even count, so that every row's keys are too."""
        out, at = {}, 0
        for name, words in self.sizes().items():
            at += name == "sort" and at % 2
            out[name], at = at, at + words
        return out, at + at % 2

    def array(self) -> np.ndarray:
        c = self.choice
        mean = sum(1 << i for i, on in enumerate(c.mean_anchor or ()) if on)
        head = [self.n, self.block, self.units, c.sink_tokens, c.recent_tokens, c.budget, c.representatives,
                self.heads, int(c.signature == "topk"), int(c.multi_anchor == "nearest"),
                int(c.representative == "first"), c.anchor_bits.shape[0], mean, self.row_words]  # fmt: skip
        return np.array(head + list(self.offsets().values()), np.int32)


@dataclass
class OneLaunchSelection:
    """A ``kvcrush_select`` launch's kept slots (device ``[rows][fields.kept]``, ascending) and its
    scratch (each step's results, read back by the tests' step checks)."""

    kept: Any
    scratch: Any
    fields: SelectFields
    rows: int


def launch_select(
    dev: KernelDevice, io: Transfers, scores: Any, stride: int, n: int, block: int, units: int,
    choices: list[KVCrushChoice],
) -> OneLaunchSelection:  # fmt: skip
    """KVCrush's whole selection in one launch for each row of ``choices`` (row ``r``: query heads
    ``r * heads ..`` of device ``scores`` ``[Hq, stride]``, ``heads`` the width of its anchors):
    ``n`` slots held, ``units`` of ``block`` tokens (``choices``' counts in units); nothing comes
    back. The rows differ only in their anchors."""
    first = choices[0]
    if any(replace(c, anchor_bits=first.anchor_bits) != first for c in choices):
        raise ValueError("the rows of one selection differ in more than their anchors")
    heads = first.anchor_bits.shape[1]
    fields = SelectFields(n, block, units, heads, first)
    rows = len(choices)
    anchors = np.stack([pack_anchor_bits(c.anchor_bits.astype(bool)) for c in choices])
    scratch = dev.empty(4 * rows * fields.row_words)
    kept = dev.empty(4 * max(rows * fields.kept, 1))
    dev.run(_kernel(dev, "kvcrush_select"), (SELECT_LANES, rows), (SELECT_LANES, 1), scores, np.int32(stride),
            io.upload("selection fields", fields.array()), io.upload("anchors", anchors), scratch, kept,
            np.int32(fields.kept))  # fmt: skip
    return OneLaunchSelection(kept, scratch, fields, rows)


@dataclass(frozen=True)
class StepSelection:
    """A decode step's selection anew of one sequence in one layer that drops exactly one unit
    (token by token: the token past the budget; block-wise: the block's worth come past it):
    launched with the step's others (:func:`launch_step_selections`), the unit it does not keep
    dropped in place by the step's drop."""

    fields: SelectFields
    anchors: np.ndarray  # [rows, A, W]: each row's fixed anchors, packed

    @staticmethod
    def of(n: int, block: int, units: int, choices: list[KVCrushChoice]) -> StepSelection | None:
        """The selection of ``choices``' rows over ``n`` held slots, or None where it does not drop
        exactly one unit: then the sequence's own work."""
        first = choices[0]
        fields = SelectFields(n, block, units, first.anchor_bits.shape[1], first)
        if fields.kept != n - block:
            return None
        return StepSelection(fields, np.stack([pack_anchor_bits(c.anchor_bits.astype(bool)) for c in choices]))


def launch_step_selections(
    dev: KernelDevice, io: Transfers, arena: Any, selections: list[tuple[StepSelection, int, int] | None],
    kv_heads: int, dropped: Any,
) -> None:  # fmt: skip
    """The step's selections (``selections[s]``: sequence ``s``'s, its scores' first word in
    the arena and their rows' stride, or None) in one launch (``kvcrush.cl``'s ``step_kvcrush_drop``): each writes the
    first slot of the unit it drops into ``dropped[s][kv]``. The sequences' rows differ only in
    their sizes: their anchors are the layer's."""
    todo = [item[0] for item in selections if item is not None]
    anchors = todo[0].anchors
    if any(sel.anchors.shape != anchors.shape or (sel.anchors != anchors).any() for sel in todo):
        raise ValueError("the step's selections differ in their anchors (one layer's are the same)")
    width = len(todo[0].fields.array()) + 2  # the fields, the scores' first word and their stride
    fields = np.zeros((len(selections), width), np.int32)
    for s, item in enumerate(selections):
        if item is not None:
            sel, scores_at, stride = item
            fields[s] = np.concatenate([sel.fields.array(), [scores_at, stride]])
    row_words = max(sel.fields.row_words for sel in todo)
    rows = anchors.shape[0]
    scratch = dev.empty(4 * len(selections) * rows * row_words)
    i32 = np.int32
    dev.run(_kernel(dev, "step_kvcrush_drop"), (SELECT_LANES, rows, len(selections)), (SELECT_LANES, 1, 1), arena,
            io.upload("selection fields", fields), i32(width), io.upload("anchors", anchors), scratch, i32(row_words),
            i32(kv_heads), dropped)  # fmt: skip


def read_one_launch(dev: KernelDevice, sel: OneLaunchSelection) -> KVCrushGPUSelection:
    """Row 0's kept tokens and each step's results, read back from its scratch."""
    f, offsets, sizes = sel.fields, sel.fields.offsets(), sel.fields.sizes()
    row = dev.to_host(sel.scratch, np.int32, (sel.rows, f.row_words))[0]

    def part(name: str) -> np.ndarray:
        return row[offsets[name] : offsets[name] + sizes[name]]

    m, w, a = f.evictable, f.words, f.choice.anchor_bits.shape[0]
    by_flag = part("by_flag")
    return KVCrushGPUSelection(
        keep=dev.to_host(sel.kept, np.int32, (sel.rows, f.kept))[0],
        important=np.sort(by_flag[m:]),
        representatives=part("representatives")[: f.buckets],
        evictable=by_flag[:m],
        order=part("order"),
        distances=part("distances").reshape(m, a),
        signatures=part("signatures").view(np.uint32).reshape(f.units, w),
        anchors=part("anchors").view(np.uint32).reshape(a, w),
    )
