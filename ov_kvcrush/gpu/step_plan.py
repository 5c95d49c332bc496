"""One step of the GPU plugin's model over several sequences, laid out: what :func:`plan_step`
reserves in each sequence's layer caches and feeds the model (the cache's inputs, a row per
sequence and KV head; the 2-bit store's, a recall's and a merge's; the ``step`` tensor and the
layout of the buffers the layers write, :mod:`~ov_kvcrush.gpu.layer_inputs`), and the bytes it
sends, counted. The engine (:mod:`~ov_kvcrush.engines.gpu_plugin_model`) runs the step and hands
each sequence what the layers left (:meth:`~ov_kvcrush.gpu.plugin_cache.PluginKVSequence.after_step`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ov_kvcrush.gpu import layer_inputs
from ov_kvcrush.gpu.chelsea import MERGE_FIELDS, merge_scratch_words
from ov_kvcrush.gpu.chelsea_cache import DeviceChelseaLayerCache
from ov_kvcrush.gpu.plugin_cache import PluginKVPool, PluginKVSequence
from ov_kvcrush.gpu.quant_cache import DeviceQuantEvictionLayerCache
from ov_kvcrush.gpu.recall_cache import DeviceRecallLayerCache
from ov_kvcrush.gpu.step_shape import StepPadding, step_size, table_width

#: the block tables' inputs, kept on the device across steps and sent as they change
#: (:class:`~ov_kvcrush.gpu.table_mirror.TableMirror`): a step's bytes count them as they are sent
DEVICE_TABLES = ("kvc_tables", "kvc_qtables")
#: a row that recalls nothing (token -1: its slots in order), as a prompt's
NO_RECALL = np.array([-1] + [0] * (layer_inputs.RECALL_WIDTH - 1), np.int32)


@dataclass
class PluginStep:
    """One model step of several sequences, as :func:`plan_step` laid it out: the model's cache
    inputs (at the step's shown size, ``shown``: :mod:`~ov_kvcrush.gpu.step_shape`), and per
    sequence its tokens, its phase and where its score rows sit among the rows the layers return
    (``first_row``, ``rows``)."""

    inputs: dict[str, np.ndarray]
    sequences: list[PluginKVSequence]
    counts: list[int]
    phases: list[str]
    first_rows: list[int]
    score_rows: list[int]
    shown: StepPadding
    #: the query rows the layers write (each sequence's score rows; at least one, none read)
    returned_rows: int = 1
    #: the row stride of the logits the model writes for the methods (0: none asked)
    logit_stride: int = 0
    #: under a recall: the longest slot list a decode row attends, and the most clusters or pages a row ranks
    map_width: int = 0
    candidates: int = 0
    #: under a merge: the bytes the merging rows work in (each layer's ``kvc_scratch``)
    scratch_bytes: int = 4
    #: the window sums the layers write of the sequences' score rows (None: none asked)
    sums: layer_inputs.WindowSums | None = None
    #: the bytes of each layer's ``kvc_logits``: the logits or window sums asked, the rows'
    #: log-sum-exp, a step of decode rows alone's partitions
    logit_bytes: int = 4

    @property
    def phase(self) -> str:
        """Where the step's crossings count: a prompt's step where any sequence is in its prompt,
        else a decode step."""
        return "prompt" if "prompt" in self.phases else "decode"


def plan_step(sequences: list[PluginKVSequence], counts: list[int]) -> PluginStep:
    """Reserve ``counts[s]`` slots for sequence ``s`` in every layer and lay out the model's cache
    inputs for the step (:data:`~ov_kvcrush.transformations.plugin_attention.PLUGIN_INPUTS`, the
    pool aside): a row per (sequence, KV head), the tokens side by side in the sequences' order,
    then the padding that shows the step at one of a few sizes (:class:`StepPadding`)."""
    pool = sequences[0].pool
    layers, kv = pool.model.layers, pool.model.kv_heads
    shown = StepPadding.of(counts)
    firsts = np.zeros((layers, len(sequences) * kv), np.int32)
    phases, first_rows, score_rows, index, starts, own = [], [], [], [], [], []
    start = 0
    for s, (seq, t) in enumerate(zip(sequences, counts, strict=True)):
        firsts[:, s * kv : (s + 1) * kv] = np.stack([c.model_slots() for c in seq.caches])
        own.append(seq.attends_own(t))
        phases.append(seq.reserve(t))
        starts.append(start)
        n = seq.score_rows(t)
        first_rows.append(len(index))
        score_rows.append(n)
        index.extend(range(start + t - n, start + t))
        start += t
    heads = [[(c.model_tables(), c.model_slots()) for c in seq.caches] for seq in sequences]
    width = table_width(max(len(table) for per_seq in heads for layer_tables, _ in per_seq for table in layer_tables))
    tables = np.zeros((layers, len(sequences) * kv, width), np.int32)
    lengths = np.zeros((layers, len(sequences) * kv), np.int32)
    for s, per_seq in enumerate(heads):
        for i, (layer_tables, held) in enumerate(per_seq):
            lengths[i, s * kv : (s + 1) * kv] = held
            for h, table in enumerate(layer_tables):
                tables[i, s * kv + h, : len(table)] = table
    block_size = pool.device_pool.shape.block_size
    lengths = shown.rows(lengths, kv, 0)  # the pad sequence's: its tokens' slots in its one block
    lengths[:, len(sequences) * kv : (len(sequences) + 1) * kv] = shown.pad_slots(block_size)
    returned = max(len(index), 1)  # at least one row (none read)
    inputs = {
        "kvc_tables": shown.rows(tables, kv, pool.pad_block),  # the empty rows' too: no block of another's
        "kvc_first": shown.rows(firsts, kv, 0),
        "kvc_lengths": lengths,
        "kvc_tokens": shown.token_rows(block_size, own),
        "kvc_score_rows": np.array(index + [0] * (step_size(returned) - len(index)), np.int64),  # the rest unread
    }
    qwidth, map_width, candidates = 1, 0, 0
    if pool.quant is not None:
        inputs |= {name: shown.rows(a, kv, 0) for name, a in _quant_inputs(sequences).items()}
        qwidth = inputs["kvc_qtables"].shape[2]
    if pool.variant.recall:
        tokens = [start if phase == "decode" else None for start, phase in zip(starts, phases, strict=True)]
        recall, map_width, candidates = _recall_inputs(sequences, tokens)
        inputs["kvc_recall"] = shown.rows(recall, kv, NO_RECALL)
    scratch_bytes = 4
    if pool.variant.merge:
        inputs["kvc_merge"], scratch_bytes = _merge_inputs(sequences, shown)
    # every row a decode token's, reading the store
    decode_rows_alone = not any(own)
    # a step of decode tokens whose methods score them: the model writes each row's logits
    scored_decode = decode_rows_alone and "prompt" not in phases and any(score_rows)
    slots = inputs["kvc_lengths"] + (inputs["kvc_qlengths"] if "kvc_qlengths" in inputs else 0)
    logit_stride = int(slots.max()) if scored_decode else 0
    # any other step whose methods score rows: their sums over the full-precision slots, in the model
    sums = None
    if any(score_rows) and not scored_decode:
        largest = any(c.sums_by_largest for c in sequences[0].caches if c.method_runs)
        sums = layer_inputs.WindowSums(len(sequences), pool.model.q_heads, int(inputs["kvc_lengths"].max()), largest)
    # decode rows alone (their sums not asked: the rows layer writes the log-sum-exp they take): the
    # prompt layers give each row's partitions a sub-group each, the rows layer merges them
    split = decode_rows_alone and sums is None
    parts_at, logit_bytes = layer_inputs.logits_layout(pool.model.q_heads, shown.tokens, pool.model.head_dim,
                                                        logit_stride, sums, split)  # fmt: skip
    inputs["kvc_step"] = layer_inputs.step_tensor(width, shown.tokens, qwidth, returned, logit_stride, map_width,
                                                   candidates, int(split), sums, parts_at)  # fmt: skip
    step = PluginStep(inputs, sequences, list(counts), phases, first_rows, score_rows, shown, returned, logit_stride,
                      map_width, candidates, scratch_bytes, sums, logit_bytes)  # fmt: skip
    _count_step(pool, step)
    return step


def _quant_inputs(sequences: list[PluginKVSequence]) -> dict[str, np.ndarray]:
    """The 2-bit store's inputs of a step (:data:`~ov_kvcrush.transformations.plugin_attention.QUANT_INPUTS`,
    the pool aside), a row per (sequence, KV head) as :func:`plan_step`'s."""
    kv = sequences[0].pool.model.kv_heads
    per_seq = []
    for seq in sequences:
        methods = [c for c in seq.caches if c.method_runs]
        assert all(isinstance(c, DeviceQuantEvictionLayerCache) for c in methods), "each method layer keeps one"
        # a local layer's: no 2-bit blocks, nothing flushed (its layers read none)
        per_seq.append([c.model_inputs() if c.method_runs else ([[]] * kv, 0, (0, 0)) for c in seq.caches])
    layers = len(per_seq[0])
    width = table_width(max(len(t) for seq_inputs in per_seq for tables, _, _ in seq_inputs for t in tables))
    tables = np.zeros((layers, len(sequences) * kv, width), np.int32)
    lengths = np.zeros((layers, len(sequences) * kv), np.int32)
    flush = np.zeros((layers, len(sequences) * kv, 2), np.int32)
    for s, seq_inputs in enumerate(per_seq):
        for i, (heads, n, flushed) in enumerate(seq_inputs):
            lengths[i, s * kv : (s + 1) * kv] = n
            flush[i, s * kv : (s + 1) * kv] = flushed
            for h, blocks in enumerate(heads):
                tables[i, s * kv + h, : len(blocks)] = blocks
    return {"kvc_qtables": tables, "kvc_qlengths": lengths, "kvc_flush": flush}


def _recall_inputs(sequences: list[PluginKVSequence], tokens: list[int | None]) -> tuple[np.ndarray, int, int]:
    """A recalling method's ``kvc_recall`` of a step
    (:data:`~ov_kvcrush.transformations.plugin_attention.RECALL_INPUTS`), a row per (sequence, KV
    head) as :func:`plan_step`'s: each sequence's decode token (``tokens[s]``, its index in the
    step; None in a prompt's step) recalls on every global layer (a local layer recalls nothing:
    :data:`NO_RECALL`); and the widest slot list a row attends and the most clusters or pages a
    row ranks (each at least 1)."""
    kv = sequences[0].pool.model.kv_heads
    none = np.tile(NO_RECALL, (kv, 1))
    per_seq = [[c for c in seq.caches if isinstance(c, DeviceRecallLayerCache)] for seq in sequences]
    for seq, caches in zip(sequences, per_seq, strict=True):
        assert len(caches) == _global_layers(seq), "every global layer of a recalling method's sequence recalls"
    rows = np.stack([
        np.concatenate([c.recall_rows(t) if isinstance(c, DeviceRecallLayerCache) else none for c in seq.caches])
        for seq, t in zip(sequences, tokens, strict=True)
    ])  # fmt: skip
    layers = len(sequences[0].caches)
    # [sequences, layers * kv, fields] -> [layers, sequences * kv, fields]
    recall = np.ascontiguousarray(rows.reshape(len(sequences), layers, -1, rows.shape[-1]).transpose(1, 0, 2, 3))
    recall = recall.reshape(layers, -1, rows.shape[-1])
    width = max(c.attended() for caches in per_seq for c in caches)
    candidates = max(c.candidates() for caches in per_seq for c in caches)
    return recall, max(width, 1), max(candidates, 1)


def _global_layers(seq: PluginKVSequence) -> int:
    """How many of ``seq``'s layers are global: those its method runs on (not a local layer's)."""
    return sum(c.method_runs for c in seq.caches)


def _merge_inputs(sequences: list[PluginKVSequence], shown: StepPadding) -> tuple[np.ndarray, int]:
    """Chelsea's ``kvc_merge`` of a step (:data:`~ov_kvcrush.transformations.plugin_attention.MERGE_INPUTS`),
    a row per (sequence, KV head) as :func:`plan_step`'s (the padding's merge nothing), each
    merging row's words placed in the scratch (as many for every row: the most a merging row
    holds); and the scratch's bytes."""
    kv = sequences[0].pool.model.kv_heads
    nothing = np.zeros(len(MERGE_FIELDS), np.int32)
    nothing[[MERGE_FIELDS.index("degrees"), MERGE_FIELDS.index("scores")]] = -1
    per_seq = []
    for seq in sequences:
        merging = [c for c in seq.caches if isinstance(c, DeviceChelseaLayerCache)]
        assert len(merging) == _global_layers(seq), "every global layer of a merging method's sequence merges"
        fields = [c.merge_fields() if isinstance(c, DeviceChelseaLayerCache) else np.tile(nothing, (kv, 1))
                  for c in seq.caches]  # fmt: skip
        per_seq.append(np.stack(fields))  # [layers, kv, width]: a local layer merges nothing
    merge = shown.rows(np.concatenate(per_seq, axis=1), kv, nothing)
    held = merge[:, :, MERGE_FIELDS.index("held")]
    words = merge_scratch_words(int(held.max(initial=0)))
    merge[:, :, MERGE_FIELDS.index("scratch")] = np.arange(merge.shape[1]) * words
    return merge, 4 * words * merge.shape[1] if held.any() else 4


def _count_step(pool: PluginKVPool, step: PluginStep) -> None:
    """The step's cache inputs as bytes crossing in its phase, and in a decode step the KV bytes
    the sequences' attention reads."""
    device_pool = pool.device_pool
    device_pool.phase = step.phase
    crossed = device_pool.crossings[step.phase].to_device
    sent = sum(a.nbytes for name, a in step.inputs.items() if name not in DEVICE_TABLES)  # those: as they change
    crossed["model cache inputs"] = crossed.get("model cache inputs", 0) + sent
    if step.phase == "decode":
        pool.decode_steps += 1
        pool.decode_kv_read += sum(c.model_step_read() for seq in step.sequences for c in seq.caches)
