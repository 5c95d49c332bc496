"""KVCrush's selection on the GPU path (``plugins/gpu/kernels/kvcrush.cl``), step for step as
:func:`ov_kvcrush.methods.kvcrush.kvcrush_select` takes them.

Every step runs on the device: the heads' scores summed, the important tokens (sinks, recent, the
top summed scores), each head's decisions and the packed signatures, the anchors' distances, the
stable bucketing order, one representative per bucket, and the kept tokens as a mask, from which
the kept slots are listed on the device; the host knows how many (:attr:`DeviceSelection.kept`). Nothing
comes back to a cache's selection but a ``mean`` anchor's bits (:func:`select_on_device` reads
the kept tokens back, and for the tests' step checks each step's results). Random anchors are
drawn by the caller (the reference's seeded generator); a ``mean`` anchor is the evictable
tokens' per-bit majority, computed here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ov_kvcrush.gpu.device import DirectTransfers, KernelDevice, Transfers, device
from ov_kvcrush.gpu.sort import MAX_KEYS, stable_order
from ov_kvcrush.validation import check_choice, check_int

SIGNATURES = ("topk", "threshold")


@dataclass
class KVCrushGPUSelection:
    """What the device decided, in the reference's terms (``KVCrushSelection``); the steps'
    read-backs (``None`` unless asked for) are for the tests' step checks."""

    keep: np.ndarray  # ascending kept tokens
    keep_mask: Any  # device uchar [n]: 1 for a kept token (None once returned to numpy callers)
    important: np.ndarray | None = None  # ascending
    representatives: np.ndarray | None = None  # bucket order
    evictable: np.ndarray | None = None  # position order
    order: np.ndarray | None = None  # positions into evictable, bucketing order
    distances: np.ndarray | None = None  # [m, A]
    signatures: np.ndarray | None = None  # [n, W] packed, 32 heads per word
    anchors: np.ndarray | None = None  # [A, W] packed


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
    one_launch: bool = False,
    block: int = 1,
) -> KVCrushGPUSelection:
    """KVCrush over per-query-head scores ``[H, n]`` (one batch row), ``budget < n``.

    ``anchor_bits`` ``[A, H]``: the fixed anchors; ``mean_anchor[a]`` replaces anchor ``a`` with
    the evictable tokens' per-bit majority. ``one_launch``: every step in one kernel
    (:func:`launch_select`), its steps' results read from its scratch; else a kernel a step.
    ``block`` (one launch only): over the whole blocks of that many tokens (their summed scores;
    the counts in blocks, the tokens past them kept), as the block-wise form selects."""
    check_choice("signature", signature, SIGNATURES)
    check_choice("multi_anchor", multi_anchor, ("tuple", "nearest"))
    check_choice("representative", representative, ("max_score", "first"))
    check_int("block", block, 1, 1 if not one_launch else scores.shape[1])
    h, n = scores.shape
    units = n // block
    check_int("budget", budget, sink_tokens + recent_tokens + representatives, units - 1)
    a = anchor_bits.shape[0]
    nearest = int(multi_anchor == "nearest")
    key_range = a * (h + 1) if nearest and a > 1 else (h + 1) ** a
    if key_range > MAX_KEYS:  # before any device work
        raise ValueError(f"{a} anchors over {h} heads: {key_range} bucketing keys exceed the device sort's {MAX_KEYS}")
    dev = device(sub_group)
    choice = KVCrushChoice(budget, sink_tokens, recent_tokens, representatives, anchor_bits, mean_anchor, signature,
                           multi_anchor, representative)  # fmt: skip
    scores_b = dev.to_device(scores.astype(np.float32))
    if one_launch:
        return read_one_launch(dev, launch_select(dev, DirectTransfers(dev), scores_b, n, n, block, units, [choice]))
    sel = select_on_device(dev, DirectTransfers(dev), scores_b, h, n, choice)
    return replace(sel, keep_mask=None)  # numpy in, numpy out (a device buffer does not pickle)


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


@dataclass
class ImportantTokens:
    """Step 1's result: the summed scores, each token's flag (important or evictable), and the
    evictable tokens (the first ``evictable`` entries of ``by_flag``, on the device)."""

    combined: Any
    flags: Any
    by_flag: Any
    evictable: int


def important_tokens(dev: KernelDevice, sc: Any, h: int, n: int, c: KVCrushChoice) -> ImportantTokens:
    """The sinks, the recent tokens and the top summed scores between; the rest is evictable."""
    i32 = np.int32
    combined = dev.empty(4 * n)
    dev.run(_kernel(dev, "head_sums"), (n,), None, sc, i32(h), i32(n), combined)
    mid = n - c.sink_tokens - c.recent_tokens
    heavy = c.budget - c.representatives - c.sink_tokens - c.recent_tokens
    flags = dev.empty(4 * n)
    top = top_mask(dev, combined, 1, n, c.sink_tokens, mid, heavy)
    dev.run(_kernel(dev, "important_flags"), (n,), None, top, i32(n), i32(c.sink_tokens), i32(mid), flags)
    # evictable, then important, each in position order: the stable order by the flag
    return ImportantTokens(combined, flags, stable_order(dev, flags, n, 2), n - (c.budget - c.representatives))


def signatures(dev: KernelDevice, sc: Any, h: int, n: int, c: KVCrushChoice) -> tuple[Any, int]:
    """Each head's decisions over the middle, packed into ``w`` 32-bit words a token."""
    mid = n - c.sink_tokens - c.recent_tokens
    decisions = (
        top_mask(dev, sc, h, n, c.sink_tokens, mid, c.budget - c.sink_tokens - c.recent_tokens)
        if c.signature == "topk"
        else _threshold_mask(dev, sc, h, n, c.sink_tokens, mid)
    )
    w = max(1, -(-h // 32))
    sig = dev.empty(4 * n * w)
    i32 = np.int32
    dev.run(_kernel(dev, "pack_signatures"), (n,), None, decisions, i32(h), i32(n), i32(c.sink_tokens), i32(mid), sig)
    return sig, w


def anchor_signatures(
    dev: KernelDevice, io: Transfers, c: KVCrushChoice, sig: Any, w: int, imp: ImportantTokens, h: int
) -> np.ndarray:
    """The anchors' packed bits: the fixed ones, a mean anchor as the evictable tokens' majority bits."""
    anchors = pack_anchor_bits(c.anchor_bits.astype(bool))
    if any(c.mean_anchor or ()):
        majority = dev.empty(h)
        dev.run(
            _kernel(dev, "majority_bits"), (h,), None, sig, np.int32(w), imp.by_flag, np.int32(imp.evictable), majority
        )
        mean_bits = pack_anchor_bits(io.download("mean anchor", majority, np.uint8, (h,))[None].astype(bool))[0]
        for i, mean in enumerate(c.mean_anchor or ()):
            if mean:
                anchors[i] = mean_bits
    return anchors


def bucket_order(
    dev: KernelDevice,
    io: Transfers,
    c: KVCrushChoice,
    sig: Any,
    w: int,
    imp: ImportantTokens,
    anchors: np.ndarray,
    h: int,
) -> tuple[Any, Any]:
    """Each evictable token's Hamming distance to every anchor, and the evictable tokens ordered
    by bucket (the distances as one key): ``(distances, order)`` on the device."""
    i32, m, a = np.int32, imp.evictable, anchors.shape[0]
    nearest = int(c.multi_anchor == "nearest")
    dist_b = dev.empty(4 * max(m, 1) * a)
    keys = dev.empty(4 * max(m, 1))
    if m:
        dev.run(
            _kernel(dev, "anchor_distances"), (m, a), None, sig, i32(w), imp.by_flag, i32(m),
            io.upload("anchors", anchors), dist_b,
        )  # fmt: skip
        dev.run(_kernel(dev, "bucket_keys"), (m,), None, dist_b, i32(m), i32(a), i32(h), i32(nearest), keys)
    key_range = a * (h + 1) if nearest and a > 1 else (h + 1) ** a
    return dist_b, stable_order(dev, keys, m, key_range)


def representatives(dev: KernelDevice, c: KVCrushChoice, imp: ImportantTokens, order_b: Any) -> tuple[Any, int]:
    """One token a bucket, by score or the first: ``(representatives, buckets)`` on the device."""
    i32, m = np.int32, imp.evictable
    buckets = min(c.representatives, m)
    reps_b = dev.empty(4 * max(buckets, 1))
    if buckets:
        dev.run(
            _kernel(dev, "representatives"), (buckets,), None, imp.by_flag, order_b, i32(m), i32(buckets),
            imp.combined, i32(c.representative == "first"), reps_b,
        )  # fmt: skip
    return reps_b, buckets


@dataclass
class DeviceSelection:
    """A selection's steps on the device: the kept tokens' mask (uchar ``[n]``, 1 for a kept
    token), how many it keeps (known on the host: the important tokens and a representative a
    bucket, so the decisions need not come back), and what the tests' step checks read back."""

    mask: Any
    kept: int
    important: ImportantTokens
    signatures: Any
    words: int
    anchors: np.ndarray
    distances: Any
    order: Any
    representatives: Any
    buckets: int


def select_mask_on_device(
    dev: KernelDevice, io: Transfers, sc: Any, h: int, n: int, c: KVCrushChoice
) -> DeviceSelection:
    """KVCrush over device scores ``sc`` ``[h, n]``: the important tokens, the evictable ones'
    signatures bucketed by their distances to the anchors, one representative a bucket, the kept
    tokens' mask; nothing comes back (but a ``mean`` anchor's bits, through ``io``)."""
    imp = important_tokens(dev, sc, h, n, c)
    sig, w = signatures(dev, sc, h, n, c)
    anchors = anchor_signatures(dev, io, c, sig, w, imp, h)
    dist_b, order_b = bucket_order(dev, io, c, sig, w, imp, anchors, h)
    reps_b, buckets = representatives(dev, c, imp, order_b)
    mask_b = dev.empty(max(n, 1))
    dev.run(_kernel(dev, "kept_mask"), (n,), None, imp.flags, np.int32(n), reps_b, np.int32(buckets), mask_b)
    kept = n - imp.evictable + buckets
    return DeviceSelection(mask_b, kept, imp, sig, w, anchors, dist_b, order_b, reps_b, buckets)


def select_on_device(
    dev: KernelDevice, io: Transfers, sc: Any, h: int, n: int, c: KVCrushChoice
) -> KVCrushGPUSelection:
    """:func:`select_mask_on_device`, the kept tokens and each step's results read back through
    ``io`` (the tests' step checks)."""
    sel = select_mask_on_device(dev, io, sc, h, n, c)
    keep = np.flatnonzero(io.download("selection decisions", sel.mask, np.uint8, (n,))).astype(np.int32)
    m, a = sel.important.evictable, sel.anchors.shape[0]
    by_flag = dev.to_host(sel.important.by_flag, np.int32, (n,))
    return KVCrushGPUSelection(
        keep=keep,
        keep_mask=sel.mask,
        important=np.sort(by_flag[m:]),
        representatives=dev.to_host(sel.representatives, np.int32, (max(sel.buckets, 1),))[: sel.buckets],
        evictable=by_flag[:m],
        order=dev.to_host(sel.order, np.int32, (max(m, 1),))[:m],
        distances=dev.to_host(sel.distances, np.int32, (max(m, 1), a))[:m],
        signatures=dev.to_host(sel.signatures, np.uint32, (n, sel.words)),
        anchors=sel.anchors,
    )


def _threshold_mask(dev: KernelDevice, scores: Any, rows: int, n: int, lo: int, mid: int) -> Any:
    out = dev.empty(max(rows * mid, 1))
    if mid > 0:
        kernel = _kernel(dev, "head_decisions_threshold")
        dev.run(
            kernel, (dev.sub_group, rows), (dev.sub_group, 1), scores, np.int32(n), np.int32(lo), np.int32(mid), out
        )
    return out


def launch_block_sums(dev: KernelDevice, scores: Any, h: int, n: int, block: int) -> Any:
    """Device ``[h, ceil(n / block)]``: per-head sums of device ``scores`` ``[h, n]`` over blocks."""
    blocks = -(-n // block)
    out = dev.empty(4 * h * max(blocks, 1))
    dev.run(_kernel(dev, "block_sums"), (max(blocks, 1), h), None, scores, np.int32(n), np.int32(block), out)
    return out


def block_sums(scores: np.ndarray, block: int, sub_group: int | None = None) -> np.ndarray:
    """Per-head sums of ``scores`` ``[H, n]`` over blocks of ``block`` tokens (the last may be partial)."""
    dev = device(sub_group)
    h, n = scores.shape
    out = launch_block_sums(dev, dev.to_device(scores.astype(np.float32)), h, n, block)
    return dev.to_host(out, np.float32, (h, -(-n // block)))


#: the most units (tokens, or whole blocks) a selection takes in one launch: ``kvcrush_select``
#: gives a row one work-group, and its ranks are quadratic in the units; past it (a long prompt's
#: selection, once; token by token at a budget of 2,048 or more, every decode step) the step
#: kernels spread each step over the device
ONE_LAUNCH_UNITS = 2048
#: the lanes of ``kvcrush_select``'s work-group
SELECT_LANES = 128
#: each step's results in a row's scratch, in ``kvcrush.cl``'s order (S_SUMS ..): their names
SCRATCH = ("sums", "combined", "means", "flags", "by_flag", "signatures", "anchors", "distances", "keys", "order",
           "representatives", "kept")  # fmt: skip


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
        words = (h * u, u, h, u, u, u * w, a * w, m * a, m, m, max(self.buckets, 1), u)
        return dict(zip(SCRATCH, words, strict=True))

    @property
    def row_words(self) -> int:
        return sum(self.sizes().values())

    def offsets(self) -> dict[str, int]:
        out, at = {}, 0
        for name, words in self.sizes().items():
            out[name], at = at, at + words
        return out

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
        """The selection of ``choices``' rows over ``n`` held slots, or None where it is not one
        unit dropped in one launch (:data:`ONE_LAUNCH_UNITS`): then the sequence's own work."""
        first = choices[0]
        fields = SelectFields(n, block, units, first.anchor_bits.shape[1], first)
        if units > ONE_LAUNCH_UNITS or fields.kept != n - block:
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
        keep_mask=None,
        important=np.sort(by_flag[m:]),
        representatives=part("representatives")[: f.buckets],
        evictable=by_flag[:m],
        order=part("order"),
        distances=part("distances").reshape(m, a),
        signatures=part("signatures").view(np.uint32).reshape(f.units, w),
        anchors=part("anchors").view(np.uint32).reshape(a, w),
    )
