"""Our decode and prompt steps as OpenVINO GPU plugin layers (issue 49): the SimpleGPU layers
(``ov_kvcrush.gpu.plugin_layers``) compiled and run by the plugin itself, on Intel's OpenCL CPU
runtime under the emulation layer. The pool is a remote tensor of the plugin's context, laid out
as the CPU op's (shuffled blocks, garbage between them, each KV head its own token count); two
decode steps each store a token per KV head in place and attend; the attention and each head's
probabilities equal the reference over the stored tokens (``layout.stored``), and the second step
sees the first step's token, kept in the pool between inferences."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from ov_kvcrush.gpu import layer_inputs, plugin_layers, plugin_step_models
from ov_kvcrush.gpu.layout import PoolShape, page_heads, stored

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 64, 16
TOKENS = (29, 45)  # each KV head's tokens before the steps: a partial last block each
CONFIGS = [("u8", 8)]  # decode; prompt steps: f16 at 16; the whole model: f32 (every sub-group size and store once)


@dataclass
class StepScenario:
    """A pool laid out as the CPU op's (each KV head its own tokens, shuffled blocks with garbage
    between them) and steps over it (``kind``: ``"decode"``, one token per KV head through
    :func:`decode_step_model`; ``"prefill"``, ``rows`` tokens through :func:`prefill_step_model`)."""

    attributes: plugin_layers.LayerAttributes
    kind: str
    q_heads: int
    pool: np.ndarray
    steps: list[dict[str, np.ndarray]]
    #: per step, each KV head's keys, values and their positions after it (what its attention reads)
    keys: list[list[np.ndarray]]
    values: list[list[np.ndarray]]
    positions: list[list[np.ndarray]]
    first_positions: list[int] = field(default_factory=list)  # each step's first row's position


def random_scenario(
    attributes: plugin_layers.LayerAttributes, kind: str, tokens: tuple[int, ...], rows: tuple[int, ...], rng
) -> StepScenario:
    """Steps of ``rows[i]`` tokens (``kind`` ``"decode"``: 1 each) after ``tokens[h]`` tokens of
    KV head ``h``, at positions drawn below the first step's (gaps, as after eviction), from ``rng``."""
    if kind not in ("decode", "prefill") or (kind == "decode" and set(rows) != {1}):
        raise ValueError(f"kind {kind!r} with rows {rows}: 'decode' steps have one row each, or 'prefill'")
    shape, d = attributes.shape, attributes.shape.head_dim
    kv_heads = len(tokens)
    q_heads = kv_heads * shape.group
    keys = [rng.standard_normal((n, d)).astype(np.float32) for n in tokens]
    values = [rng.standard_normal((n, d)).astype(np.float32) for n in tokens]
    start = 2 * max(tokens)
    positions = [np.sort(rng.choice(start, n, replace=False)).astype(np.int32) for n in tokens]

    # blocks for the steps' tokens too: the heads laid out as if they held them all (zeros, stored over)
    def pad(xs: list[np.ndarray]) -> list[np.ndarray]:
        return [np.pad(x, ((0, sum(rows)), (0, 0))) for x in xs]

    heads = page_heads(shape, pad(keys), pad(values), rng)
    scenario = StepScenario(attributes, kind, q_heads, heads.pool, [], [], [], [])
    for n in rows:
        q_shape = (q_heads, d) if kind == "decode" else (q_heads, n, d)
        q = rng.standard_normal(q_shape).astype(np.float32)
        k = rng.standard_normal((kv_heads, n, d)).astype(np.float32)
        v = rng.standard_normal((kv_heads, n, d)).astype(np.float32)
        first = np.array([len(x) for x in keys], np.int32)
        keys = [np.concatenate([keys[i], k[i]]) for i in range(kv_heads)]
        values = [np.concatenate([values[i], v[i]]) for i in range(kv_heads)]
        positions = [
            np.concatenate([positions[i], np.arange(start, start + n, dtype=np.int32)]) for i in range(kv_heads)
        ]
        feeds = {"q": q, "k": k, "v": v, "tables": heads.tables, "first": first, "lengths": first + n}
        feeds["tokens"] = layer_inputs.token_tensor([n], [n > 1])  # one sequence: a row per KV head
        scenario.steps.append({**feeds, "step": layer_inputs.step_tensor(heads.tables.shape[1], n)})
        scenario.first_positions.append(start)
        scenario.keys.append(keys)
        scenario.values.append(values)
        scenario.positions.append(positions)
        start += n
    return scenario


def run_on_plugin(core: object, folder: Path, scenario: StepScenario) -> list[tuple[np.ndarray, ...]]:
    """Compile the scenario's step model on ``core``'s ``GPU`` (the layers' ``CONFIG_FILE``
    written into ``folder``), hold its pool in a remote tensor of the plugin's context and run its
    steps; each step's outputs."""
    import openvino as ov

    build = plugin_step_models.decode_step_model if scenario.kind == "decode" else plugin_step_models.prefill_step_model
    model = build(scenario.attributes, len(scenario.keys[0]))
    compiled = plugin_step_models.compile_step_model(core, folder, scenario.attributes, model)
    request = compiled.create_infer_request()
    context = core.get_default_context("GPU")  # type: ignore[attr-defined]
    pool = context.create_tensor(ov.Type.u8, ov.Shape([scenario.pool.size]), {})
    pool.copy_from(ov.Tensor(scenario.pool))
    request.set_tensor("pool", pool)
    if scenario.kind != "decode":  # the prompt layer's logits and score rows: asked for by none of these steps
        request.set_tensor("logits", ov.Tensor(np.zeros(4, np.uint8)))
        rows = plugin_step_models.rows_input(scenario.q_heads, scenario.attributes.shape.head_dim)
        request.set_tensor("rows", ov.Tensor(rows))
        request.set_tensor("score_rows", ov.Tensor(plugin_step_models.NO_SCORE_ROWS["score_rows"]))
    results = []
    for feeds in scenario.steps:
        for name, array in feeds.items():
            request.set_tensor(name, ov.Tensor(np.ascontiguousarray(array)))
        request.infer()
        results.append(tuple(request.get_output_tensor(i).data.copy() for i in range(len(compiled.outputs))))
    return results


def _run_in_worker(folder: str, scenario) -> list:
    """In the emulation worker: the scenario's steps run by the plugin."""
    from ov_kvcrush.op import plugin

    return run_on_plugin(plugin.shared_core(), Path(folder), scenario)


def _reference(shape: PoolShape, q: np.ndarray, keys: list, values: list) -> tuple[np.ndarray, list]:
    out, probs = np.zeros((Q_HEADS, HEAD_DIM)), []
    for h in range(Q_HEADS):
        kv = h // shape.group
        k, v = stored(shape, keys[kv]).astype(np.float64), stored(shape, values[kv]).astype(np.float64)
        logits = k @ q[h].astype(np.float64) * HEAD_DIM**-0.5
        p = np.exp(logits - logits.max())
        p /= p.sum()
        out[h] = p @ v
        probs.append(p)
    return out, probs


@pytest.mark.parametrize(("precision", "sub_group"), CONFIGS, ids=[f"{p}-sg{s}" for p, s in CONFIGS])
def test_the_plugin_runs_our_decode_step_over_a_pool_it_holds(emulation_worker, tmp_path, precision, sub_group):
    shape = PoolShape(precision, BLOCK, HEAD_DIM, Q_HEADS // KV_HEADS)
    attributes = plugin_layers.LayerAttributes(shape, sub_group, HEAD_DIM**-0.5)
    scenario = random_scenario(attributes, "decode", TOKENS, (1, 1), np.random.default_rng(7))
    steps = zip(scenario.steps, scenario.keys, scenario.values, strict=True)
    expected = [_reference(shape, step["q"], keys, values) for step, keys, values in steps]
    got = emulation_worker.submit(_run_in_worker, str(tmp_path), scenario).result(600)
    for (out, probs), (ref_out, ref_probs) in zip(got, expected, strict=True):
        np.testing.assert_allclose(out, ref_out, atol=1e-5)
        for h, p in enumerate(ref_probs):
            np.testing.assert_allclose(probs[h, : len(p)], p, atol=1e-6)


def _causal_reference(shape: PoolShape, q: np.ndarray, first_position: int, keys: list, values: list,
                      positions: list, softcap: float = 0.0) -> np.ndarray:  # fmt: skip
    """Each query head's rows (at first_position + r) over its KV head's tokens at or before them:
    the earlier steps' as stored, a step of several rows its own as given (the CPU op's prompt
    attention), a step of one row its own as stored (a decode token's)."""
    rows = q.shape[1]
    out = np.zeros(q.shape)
    for h in range(q.shape[0]):
        kv = h // shape.group
        k, v = stored(shape, keys[kv]).astype(np.float64), stored(shape, values[kv]).astype(np.float64)
        if rows > 1:
            k[-rows:], v[-rows:] = keys[kv][-rows:], values[kv][-rows:]
        for r in range(rows):
            seen = positions[kv] <= first_position + r
            logits = k[seen] @ q[h, r].astype(np.float64) * HEAD_DIM**-0.5
            if softcap:
                logits = softcap * np.tanh(logits / softcap)
            p = np.exp(logits - logits.max())
            out[h, r] = (p / p.sum()) @ v[seen]
    return out


def test_the_plugin_runs_our_prompt_steps_over_heads_with_gaps(
    emulation_worker, tmp_path, precision="f16", sub_group=16
):
    """Two prompt chunks then a step of one row, over KV heads whose earlier tokens sit at
    positions with gaps (as after eviction), in f16 blocks: each row attends exactly the slots at
    or before it, a chunk's own tokens as the model gave them, every other as stored."""
    shape = PoolShape(precision, BLOCK, HEAD_DIM, Q_HEADS // KV_HEADS)
    attributes = plugin_layers.LayerAttributes(shape, sub_group, HEAD_DIM**-0.5)
    scenario = random_scenario(attributes, "prefill", TOKENS, (20, 17, 1), np.random.default_rng(8))
    got = emulation_worker.submit(_run_in_worker, str(tmp_path), scenario).result(600)
    for (out,), step, keys, values, positions, first_position in zip(
        got, scenario.steps, scenario.keys, scenario.values, scenario.positions, scenario.first_positions, strict=True
    ):
        np.testing.assert_allclose(out, _causal_reference(shape, step["q"], first_position, keys, values, positions),
                                   atol=1e-5)  # fmt: skip


def test_the_plugin_soft_caps_a_models_logits_in_its_prompt_and_decode_rows(emulation_worker, tmp_path):
    """Gemma 2's soft-capping (``cap * tanh(s / cap)`` of each scaled logit, the layers compiled with
    the pool's cap): a chunk of 20 rows, then one row, each as the capped reference, which a cap of
    1.5 moves well past the tolerance from the uncapped one (f32 blocks)."""
    shape = PoolShape("f32", BLOCK, HEAD_DIM, Q_HEADS // KV_HEADS, softcap=1.5)
    attributes = plugin_layers.LayerAttributes(shape, 16, HEAD_DIM**-0.5)
    scenario = random_scenario(attributes, "prefill", TOKENS, (20, 1), np.random.default_rng(12))
    got = emulation_worker.submit(_run_in_worker, str(tmp_path), scenario).result(600)
    for (out,), step, keys, values, positions, first_position in zip(
        got, scenario.steps, scenario.keys, scenario.values, scenario.positions, scenario.first_positions, strict=True
    ):
        args = (shape, step["q"], first_position, keys, values, positions)
        np.testing.assert_allclose(out, _causal_reference(*args, softcap=1.5), atol=1e-5)
        assert np.abs(out - _causal_reference(*args)).max() > 1e-2  # the cap bends these logits


def batched_step(attributes: plugin_layers.LayerAttributes, held: list[list[int]], counts: list[int], rng) -> dict:
    """One step of several sequences side by side: sequence ``s`` holds ``held[s][kv]`` tokens in
    KV head ``kv`` (paged among the others' blocks, garbage between) and feeds ``counts[s]``
    tokens. The step's feeds, and each sequence's keys and values after it (per KV head)."""
    shape, d = attributes.shape, attributes.shape.head_dim
    kv_heads, q_heads = len(held[0]), len(held[0]) * shape.group
    t = sum(counts)
    old_k = [rng.standard_normal((n, d)).astype(np.float32) for per_seq in held for n in per_seq]
    old_v = [rng.standard_normal((n, d)).astype(np.float32) for per_seq in held for n in per_seq]
    new_counts = [c for c in counts for _ in range(kv_heads)]  # per row (sequence, KV head)
    heads = page_heads(shape, [np.pad(k, ((0, c), (0, 0))) for k, c in zip(old_k, new_counts, strict=True)],
                       [np.pad(v, ((0, c), (0, 0))) for v, c in zip(old_v, new_counts, strict=True)], rng)  # fmt: skip
    q = rng.standard_normal((q_heads, t, d)).astype(np.float32)
    k = rng.standard_normal((kv_heads, t, d)).astype(np.float32)
    v = rng.standard_normal((kv_heads, t, d)).astype(np.float32)
    first = np.array([n for per_seq in held for n in per_seq], np.int32)
    starts = np.cumsum([0, *counts])
    keys, values = [], []
    for row in range(len(first)):
        s, h = divmod(row, kv_heads)
        span = slice(starts[s], starts[s + 1])
        keys.append(np.concatenate([old_k[row], k[h, span]]))
        values.append(np.concatenate([old_v[row], v[h, span]]))
    feeds = {
        "q": q,
        "k": k,
        "v": v,
        "tables": heads.tables,
        "first": first,
        "lengths": first + np.array(new_counts, np.int32),
    }
    split = all(c == 1 for c in counts)  # decode rows alone: a sub-group a partition of a row, merged after
    parts_at, logits_bytes = layer_inputs.logits_layout(q_heads, t, d, split=split)
    step = layer_inputs.step_tensor(heads.tables.shape[1], t, decode_split=int(split), parts_at=parts_at)
    # several tokens read their own from k and v (equal to the f32 store's: where they are read)
    feeds |= {"tokens": layer_inputs.token_tensor(counts, [c > 1 for c in counts]), "step": step}
    feeds |= {"rows": plugin_step_models.rows_input(q_heads, d), **plugin_step_models.NO_SCORE_ROWS}
    return {"pool": heads.pool, "feeds": feeds, "keys": keys, "values": values, "logits_bytes": logits_bytes}


def _run_batched_in_worker(folder: str, attributes, kv_heads: int, steps: list[dict]) -> list:
    """In the emulation worker: each step (its own pool) through the prompt layer's model."""
    import openvino as ov

    from ov_kvcrush.op import plugin

    core = plugin.shared_core()
    model = plugin_step_models.prefill_step_model(attributes, kv_heads)
    compiled = plugin_step_models.compile_step_model(core, Path(folder), attributes, model)
    request, context = compiled.create_infer_request(), core.get_default_context("GPU")
    outs = []
    for step in steps:
        pool = context.create_tensor(ov.Type.u8, ov.Shape([step["pool"].size]), {})
        pool.copy_from(ov.Tensor(step["pool"]))
        request.set_tensor("pool", pool)
        # no logits asked for; a step of decode rows alone's partitions
        request.set_tensor("logits", ov.Tensor(np.zeros(step["logits_bytes"], np.uint8)))
        for name, array in step["feeds"].items():
            request.set_tensor(name, ov.Tensor(np.ascontiguousarray(array)))
        request.infer()
        outs.append(request.get_output_tensor(0).data.copy())
    return outs


def test_the_plugin_runs_a_step_of_several_sequences_each_over_its_own_slots(emulation_worker, tmp_path):
    """Continuous batching's step: a prompt chunk beside decode tokens of sequences of other
    lengths, in one launch (tokens side by side; a row of the cache's tensors per sequence and
    KV head): each token's rows attend exactly its own sequence's slots up to itself (a chunk's
    own tokens as the model gave them, not the f16 blocks' rounded copies); a step of decode tokens
    alone gives each partition of a row a sub-group (its slots split across the lanes), and the
    rows layer merges the partitions: rows of a few slots (some partitions empty) to 2,001 (all
    eight at work, two tiles each)."""
    shape = PoolShape("f16", BLOCK, HEAD_DIM, Q_HEADS // KV_HEADS)
    attributes = plugin_layers.LayerAttributes(shape, 16, HEAD_DIM**-0.5)
    rng = np.random.default_rng(9)
    plans = [([[0, 0], [29, 29], [45, 45], [3, 3]], [37, 1, 1, 1]),  # a new prompt beside three decoders
             ([[61, 61], [16, 16]], [1, 1]),  # a decode step of two (a sub-group a partition)
             ([[300, 300], [5, 5], [130, 130]], [1, 1, 1]),  # of three, past several tiles of the split
             ([[7, 7], [0, 0], [33, 33]], [1, 20, 1]),
             ([[2000, 2000], [2, 2]], [1, 1])]  # fmt: skip
    steps = [batched_step(attributes, held, counts, rng) for held, counts in plans]
    got = emulation_worker.submit(_run_batched_in_worker, str(tmp_path), attributes, KV_HEADS, steps).result(600)
    for out, step, (held, counts) in zip(got, steps, plans, strict=True):
        starts = np.cumsum([0, *counts])
        for s, c in enumerate(counts):
            for i in range(c):
                for h in range(Q_HEADS):
                    row = s * KV_HEADS + h // shape.group
                    seen = held[s][h // shape.group] + i + 1
                    k = stored(shape, step["keys"][row][:seen]).astype(np.float64)
                    v = stored(shape, step["values"][row][:seen]).astype(np.float64)
                    if c > 1:  # a chunk's own tokens as the model gave them, the earlier as stored
                        own = slice(held[s][h // shape.group], seen)
                        k[own], v[own] = step["keys"][row][own], step["values"][row][own]
                    logits = k @ step["feeds"]["q"][h, starts[s] + i].astype(np.float64) * HEAD_DIM**-0.5
                    p = np.exp(logits - logits.max())
                    np.testing.assert_allclose(out[h, starts[s] + i], (p / p.sum()) @ v, atol=1e-5)


def _twice_in_worker(folder: str, attributes, kv_heads: int, step: dict) -> list:
    """In a fresh emulation worker: ``step`` through the prompt layer's model converted and
    compiled twice (its nodes named anew), with the programs made from source and the program
    cache's entries after each."""
    from ov_kvcrush.gpu import emulation

    cache = Path(os.environ[emulation.PROGRAM_CACHE_ENV])
    out = []
    for _ in range(2):
        before = emulation.counts()
        got = _run_batched_in_worker(folder, attributes, kv_heads, [step])[0]
        out.append((got, (emulation.counts() - before).layer_programs, sorted(p.name for p in cache.iterdir())))
    return out


def test_a_layers_program_in_another_node_is_loaded_from_the_program_cache(tmp_path, monkeypatch):
    """The plugin heads each custom layer's program with its node's name, so the same layer in
    another model layer (or a model converted again) differed by a comment alone and was compiled
    anew (``plugins/gpu/emulation/program_cache.c`` leaves that name out of its key): the second
    model's programs, made from source again, add no entry to the cache and compute the same."""
    from ov_kvcrush.gpu import emulation

    reason = emulation.unavailable()
    if reason:
        pytest.skip(reason)
    (tmp_path / "cache").mkdir()
    monkeypatch.setenv(emulation.PROGRAM_CACHE_ENV, str(tmp_path / "cache"))
    shape = PoolShape("f16", BLOCK, HEAD_DIM, Q_HEADS // KV_HEADS)
    attributes = plugin_layers.LayerAttributes(shape, 16, HEAD_DIM**-0.5)
    step = batched_step(attributes, [[29, 29], [3, 3]], [5, 1], np.random.default_rng(4))
    with emulation.worker() as worker:
        (first, made, entries), (second, made_again, entries_again) = worker.submit(
            _twice_in_worker, str(tmp_path), attributes, KV_HEADS, step
        ).result(600)
    assert made > 0 and made_again > 0  # each compiled model made its layers' programs
    assert entries and entries_again == entries
    np.testing.assert_array_equal(second, first)
