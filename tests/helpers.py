"""Helpers shared by the test modules (no test module imports another; they import this).

* Step-by-step runners for the OpenVINO tests: the unmodified stateful IR vs the converted one.
  Both are fed the same tokens (a prompt, then the greedy token of the *reference* at each step,
  so one divergence cannot cascade) and return the last position's logits after every step.
* A one-op model of our ``PagedAttention`` and drivers that feed it and a reference layer cache
  the same vectors (the op-vs-reference parity tests of every method).
* Teacher-forced logits through the openvino engine on either device (the GPU plugin's checks
  of f16 against the CPU op's f32).
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ov_kvcrush.methods.vectors import layer_vectors
from ov_kvcrush.op.method_spec import method_spec

# Exact f32 execution on both sides (no bf16 matmuls, no dynamic quantization of activations), and
# the unmodified IR run step by step: the model-coverage checks' own (no OpenVINO import at import time).
from ov_kvcrush.tools.model_coverage import F32 as F32
from ov_kvcrush.tools.model_coverage import native_steps as native_steps

if TYPE_CHECKING:
    from ov_kvcrush.op import kvcache

# The OpenVINO side (the op, the pool, the graph transformation) is imported where it is used:
# the CUDA tests import this module on a GPU machine that has torch but no openvino.


def converted_steps(
    xml: Path,
    prompt: list[int],
    feed: list[int],
    kv_precision: str,
    block_size: int = 32,
    windows: list[int] | None = None,
    chunk: int = 0,
):
    """Logits of the converted model fed ``prompt`` (in ``chunk``-token steps when > 0) then each
    token of ``feed``; and the pool. ``windows``: per layer, a sliding-window span (0: global)."""
    from ov_kvcrush.transformations import convert_model

    from ov_kvcrush.op import kvcache, plugin

    core = plugin.shared_core()
    conv = convert_model(core.read_model(xml), plugin.loaded_path())
    req = core.compile_model(conv.model, "CPU", F32).create_infer_request()
    s = conv.shape
    pool = kvcache.KVPool(
        s.layers, s.q_heads, s.kv_heads, s.head_dim, block_size=block_size, precision=kv_precision, windows=windows
    )
    seq = pool.new_sequence()
    names = {i.get_any_name() for i in req.model_inputs}
    out, past, ids = [], 0, list(prompt)
    if chunk:  # all of the prompt but its last chunk, in chunks
        seq.set_prompt(len(prompt))
        while len(ids) > chunk:
            run_step(req, names, seq, ids[:chunk], past)
            past, ids = past + chunk, ids[chunk:]
    for step in range(len(feed) + 1):
        n = len(ids)
        run_step(req, names, seq, ids, past)
        past += n
        out.append(np.array(req.get_output_tensor(0).data[0, -1], dtype=np.float32))
        if step < len(feed):
            ids = [feed[step]]
    return np.stack(out), conv, pool, seq


def infer(req, inputs: dict):
    """``req.infer(inputs)`` of a model with our op, raising the op's error (the op does not
    throw: :func:`ov_kvcrush.op.kvcache.infer_steps`)."""
    from ov_kvcrush.op import kvcache

    return kvcache.infer_steps(req, inputs, np.asarray(inputs["kvc_sequence"]).ravel().tolist())


def run_step(req, names: set[str], seq: kvcache.KVSequence, ids: list[int], past: int) -> None:
    """One inference of the converted model: ``ids`` after ``past`` tokens of ``seq``."""
    from ov_kvcrush.op import step_inputs

    infer(req, step_inputs.step_inputs(names, [ids], [seq.handle], [past]))


HQ, HKV, D = 9, 3, 64  # the embedded model's attention shape


def op_model(
    core,
    hq: int,
    hkv: int,
    d: int,
    layer: int = 0,
    scale: float | None = None,
    compute: str = "f32",
    softcap: float = 0.0,
    **properties,
):
    from ov_kvcrush.op.probe import single_op_model

    return single_op_model(core, hq, hkv, d, layer, scale, compute, properties, softcap=softcap)


def reference_layer(cfg, layer: int, layers: int, softcap: float = 0.0):
    """The reference layer cache of ``cfg`` for ``layer``, soft-capping its logits at ``softcap``
    (0: none), as an engine sets it from the model."""
    lc = cfg.make_layer(layer, layers)
    lc.softcap = softcap or None
    return lc


def causal_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float | None = None):
    """The reference attention (:func:`ov_kvcrush.methods.attention.attend`) of the last
    ``q.shape[2]`` positions over all ``k.shape[2]`` keys, causal: ``(output, per-head scores)``."""
    import torch

    from ov_kvcrush.methods.attention import attend

    n, t = k.shape[2], q.shape[2]
    res = attend(
        torch.from_numpy(q),
        torch.from_numpy(k),
        torch.from_numpy(v),
        q_positions=torch.arange(n - t, n),
        k_positions=torch.arange(n),
        scale=scale,
        return_scores=True,
    )
    return res.output.numpy(), res.scores.numpy()


def held_positions(seq: kvcache.KVSequence, layer: int) -> list[np.ndarray]:
    return [seq.read_head(layer, g)[0] for g in range(HKV)]


def drive(core, cfg, *, layer, steps, seed=0, layers=4, precision="f32", block_size=32, softcap=0.0):
    """Feed ``steps`` (token counts; the first is the prompt) to the op and the reference layer
    cache (both soft-capping their logits at ``softcap``, 0: none)."""
    from ov_kvcrush.op import kvcache

    lv = layer_vectors(seed, kv_heads=HKV, q_heads=HQ, tokens=sum(steps), head_dim=D)
    pool = kvcache.KVPool(
        layers, HQ, HKV, D, block_size=block_size, precision=precision, method=method_spec(cfg, layers, HQ, block_size)
    )
    seq = pool.new_sequence()
    req = op_model(core, HQ, HKV, D, layer=layer, softcap=softcap)
    lc = reference_layer(cfg, layer, layers, softcap)
    a = 0
    for s, n in enumerate(steps):
        q, k, v = lv.queries[:, :, a : a + n], lv.keys[:, :, a : a + n], lv.values[:, :, a : a + n]
        a += n
        out = infer(req, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "kvc_sequence": np.array([seq.handle])})[0]
        ref = lc.prefill(q, k, v) if s == 0 else lc.decode(q, k, v)
        yield s, np.array(out), ref.numpy(), seq, pool, lc


def reference_positions(lc) -> list[np.ndarray]:
    """Positions each KV head of a reference layer cache holds (ascending, padding dropped)."""
    p = lc.store.positions[0]
    return [np.sort(p[g][p[g] >= 0].numpy()) for g in range(p.shape[0])]


def run_both(
    core,
    cfg,
    *,
    layer=0,
    layers=1,
    prompt=192,
    decode=40,
    seed=0,
    block_size=32,
    precision="f32",
    keep=None,
    softcap=0.0,
):
    """Run the op and the reference step by step (both soft-capping at ``softcap``, 0: none);
    yield (step, op positions, ref positions, op out, ref out, seq)."""
    from ov_kvcrush.op import kvcache

    lv = layer_vectors(seed, kv_heads=HKV, q_heads=HQ, tokens=prompt + decode, head_dim=D)
    spec = method_spec(cfg, layers, HQ, block_size)
    pool = kvcache.KVPool(layers, HQ, HKV, D, block_size=block_size, precision=precision, method=spec)
    seq = pool.new_sequence()
    req = op_model(core, HQ, HKV, D, layer=layer, softcap=softcap)
    lc = reference_layer(cfg, layer, layers, softcap)
    if keep is not None:
        keep["lc"] = lc
    steps = [(0, prompt)] + [(prompt + i, prompt + i + 1) for i in range(decode)]
    for s, (a, b) in enumerate(steps):
        q, k, v = lv.queries[:, :, a:b], lv.keys[:, :, a:b], lv.values[:, :, a:b]
        out = infer(req, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "kvc_sequence": np.array([seq.handle])})[0]
        ref = lc.prefill(q, k, v) if s == 0 else lc.decode(q, k, v)
        yield s, held_positions(seq, layer), reference_positions(lc), np.array(out), ref.numpy(), seq, pool


def scores_by_position(positions, scores) -> dict[int, float]:
    return {int(p): float(v) for p, v in zip(positions, scores, strict=True) if p >= 0}


def op_scores(seq, layer, shared: bool) -> list[dict[int, float]]:
    """Per KV head: position -> score the op holds (group-summed; layer-scope KVCrush: summed over all heads)."""
    per_head = []
    for g in range(HKV):
        pos, _, _, sc = seq.read_head(layer, g)
        per_head.append(scores_by_position(pos, sc.sum(1)))
    if shared:
        total = {p: sum(h[p] for h in per_head) for p in per_head[0]}
        return [total] * HKV
    return per_head


def ref_scores(lc, shared: bool) -> list[dict[int, float]]:
    acc = lc.acc[0].reshape(HKV, HQ // HKV, -1).sum(1)  # [hk, n]
    pos = lc.store.positions[0]
    per_head = [scores_by_position(pos[g].tolist(), acc[g].tolist()) for g in range(HKV)]
    if shared:
        total = {p: sum(h[p] for h in per_head) for p in per_head[0]}
        return [total] * HKV
    return per_head


def assert_near_tie(got, want, op_sc, ref_sc, what):
    """The op and the reference kept different tokens: only allowed between scores equal within float noise."""
    only_op = sorted(set(got.tolist()) - set(want.tolist()))
    only_ref = sorted(set(want.tolist()) - set(got.tolist()))
    assert len(only_op) == len(only_ref), what
    a = sorted(op_sc[p] for p in only_op)
    b = sorted(ref_sc[p] for p in only_ref)
    scale = max(abs(v) for v in ref_sc.values())  # scores may be negative (e.g. a norm ranked low-first)
    np.testing.assert_allclose(
        a, b, atol=2e-6 * scale, rtol=0, err_msg=f"{what}: not a near-tie {only_op} vs {only_ref}"
    )


def check_op_keeps_the_reference_tokens(
    core, cfg, layer: int, case: str = "", layers: int = 4, softcap: float = 0.0
) -> None:
    """The op and the reference layer cache of ``cfg`` on the shared test vectors, step by step:
    same tokens kept at every step until a float near-tie splits them (then justified), the same
    attention output while they agree, every head within its budget (a frozen selection keeps
    every generated token; over the 2-bit store an evicting one stays within a chunk of it), the
    block accounting and the pool's bytes exact, and (unless frozen
    or diverged) a decode-time eviction compared at least once."""
    case = case or cfg.name
    bs = getattr(cfg, "block_size", None) or 32
    budget = cfg.layer_budget(layer, layers)
    shared = cfg.name == "kvcrush" and cfg.scope == "layer"  # one selection per layer: scores summed over it
    quant = getattr(cfg, "quant", None) is not None
    frozen = cfg.selection_frozen() if hasattr(cfg, "selection_frozen") else cfg.name == "minikv"
    # over the 2-bit store an evicting selection drops whole flushed chunks: a head may hold a
    # chunk less one token over its budget, plus the recent tokens a fresh chunk may still hold
    slack = cfg.quant.residual_tokens - 1 + cfg.recent_tokens if quant and not frozen else 0
    diverged, last, first_qblocks, most_qblocks = False, None, 0, 0
    decode_evictions_compared = 0
    lc_holder = {}
    for step, got, want, out, ref, seq, pool in run_both(
        core, cfg, layer=layer, layers=layers, block_size=bs, keep=lc_holder, softcap=softcap
    ):
        held = seq.head_tokens()[layer]
        if not diverged:
            same = all(np.array_equal(got[g], want[g]) for g in range(HKV))
            if same:
                np.testing.assert_allclose(out, ref, atol=3e-5, rtol=0, err_msg=f"{case} step {step}")
                if last is not None and (held < last + 1).any():
                    decode_evictions_compared += 1
            else:
                diverged = True
                o, r = op_scores(seq, layer, shared), ref_scores(lc_holder["lc"], shared)
                for g in range(HKV):
                    if not np.array_equal(got[g], want[g]):
                        assert_near_tie(got[g], want[g], o[g], r[g], f"{case} step {step} head {g}")
        last = held
        # a frozen selection (MiniKV; KVCrush over the 2-bit store) keeps every generated token
        cap = budget + (step if frozen else slack)
        for g in range(HKV):
            assert got[g].size <= cap, f"{case} step {step} head {g} holds {got[g].size} > {cap}"
        st = seq.stats()
        # 2-bit blocks are always full and the residual starts on a block edge; a decode step's
        # evictions leave fewer than a block of holes per head before it is compacted
        holes = seq.head_holes()
        assert (holes < bs).all() and (holes[:layer].sum() + holes[layer + 1 :].sum()) == 0
        assert st.blocks_held + st.qblocks_held == sum(math.ceil(n / bs) for n in held + holes[layer])
        ps = pool.stats()
        assert ps.kv_bytes == st.kv_bytes == st.blocks_held * pool.block_bytes + st.qblocks_held * ps.qblock_bytes
        if step == 0:
            first_qblocks = st.qblocks_held
        most_qblocks = max(most_qblocks, st.qblocks_held)
    if not diverged and not frozen:
        assert decode_evictions_compared > 0  # the decode-time eviction was exercised and matched
    if quant:
        # decode tokens were flushed into the 2-bit store (an evicting selection may drop a
        # chunk in the step that flushed it: the reference counts its flushes)
        assert most_qblocks > first_qblocks or (not frozen and lc_holder["lc"].store.flushes > 1)
        assert pool.stats().qblock_bytes * 4 <= pool.block_bytes  # f32 here: 2 bits + scales is < 1/4


def cli(*args: str, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """``ov-kvcrush ARGS`` in a fresh interpreter, as a user runs it (stdout and stderr captured)."""
    return subprocess.run(
        [sys.executable, "-m", "ov_kvcrush", *args], capture_output=True, text=True, timeout=timeout, input=stdin
    )


def python_with_all_cores(script: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``script`` (dedented) in a fresh interpreter given every core the run started with
    (:func:`with_all_cores`), for what behaves otherwise in a process of one core (a worker's
    share, ``conftest.pytest_configure``): openvino_genai's rotation crash, and OpenVINO 2026.4's
    CPU plugin compiling a model with sliding-window layers at its default bf16 on a CPU with AMX
    (it dies of a division by zero, SIGFPE, the core count being read once per process)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=timeout, preexec_fn=with_all_cores)  # fmt: skip


def with_all_cores() -> None:
    """A child's ``preexec_fn``: the cores the test run started with, not its worker's share
    (``conftest.pytest_configure``), for a child whose behaviour depends on running threads in
    parallel (openvino_genai's rotation crash does not happen on one core)."""
    cores = os.environ.get("OV_KVCRUSH_TEST_ALL_CORES")
    if cores:
        os.sched_setaffinity(0, [int(c) for c in cores.split(",")])


#: the end of a child's script (``signal_after_drops``): its objects dropped in the order they
#: were made, then a signal Python handles
DROP_THEN_SIGNAL = """
while made:
    made.pop(0)
    gc.collect()
handled = []
signal.signal(signal.SIGINT, lambda *_: handled.append(True))
signal.raise_signal(signal.SIGINT)
print("handled" if handled else "missed")
"""


def signal_after_drops(making: str, *argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """A fresh interpreter runs ``making`` (it fills the list ``made``; ``gc``, ``signal`` and
    ``sys`` are imported), drops what it made in creation order and raises SIGINT: stdout ends
    ``handled``, or the process dies (OpenVINO's CPU plugins can leave a freed signal stack)."""
    script = "import gc, signal, sys\n" + textwrap.dedent(making) + DROP_THEN_SIGNAL
    return subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=timeout)


def call_main(argv: list[str]) -> int:
    """The exit code of ``ov-kvcrush ARGV`` through the entry point's ``main`` in this
    interpreter, argparse's own refusals (``SystemExit``) included."""
    from ov_kvcrush.cli.main import main

    try:
        return main(list(argv))
    except SystemExit as exc:
        return exc.code


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    """``ov-kvcrush ARGV`` through the entry point's ``main`` in this interpreter (no fresh
    interpreter's start-up): (exit code, stdout, stderr)."""
    code = call_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


#: what the recording stand-in for ``ov-kvcrush`` prints where the script called it
SCRIPT_CALL = "@@ov-kvcrush-call "
#: the stand-in: each call's arguments saved NUL-separated, numbered in call order
RECORDER = f"""#!/bin/sh
n=$(ls "$OV_KVCRUSH_CALLS" | wc -l)
for a in "$@"; do printf '%s\\0' "$a"; done > "$OV_KVCRUSH_CALLS/$n"
echo "{SCRIPT_CALL}$n"
"""


def bench_script_dry_run(script: str, run: str) -> subprocess.CompletedProcess:
    """``bash benchmarks/SCRIPT RUN`` with ``DRY_RUN=1``: its commands checked, nothing loaded.

    The script runs in bash as written, with ``OV_KVCRUSH`` a stand-in that records each call;
    every recorded ``ov-kvcrush`` command then runs through the entry point's ``main`` in this
    interpreter, in order, its output where the script called it, and the first to fail ends the
    run with its exit code (the scripts ``set -e``). The same checks as a fresh interpreter per
    call, without its start-up and imports (2 s a call)."""
    import io
    import tempfile

    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        recorder, calls = Path(tmp) / "ov-kvcrush", Path(tmp) / "calls"
        recorder.write_text(RECORDER)
        recorder.chmod(0o755)
        calls.mkdir()
        env = {**os.environ, "DRY_RUN": "1", "OV_KVCRUSH": str(recorder), "OV_KVCRUSH_CALLS": str(calls)}
        proc = subprocess.run(
            ["bash", str(root / "benchmarks" / script), run], env=env, capture_output=True, text=True, timeout=120
        )
        stdout, stderr = [], [proc.stderr]
        for line in proc.stdout.splitlines(keepends=True):
            if not line.startswith(SCRIPT_CALL):
                stdout.append(line)
                continue
            argv = (calls / line[len(SCRIPT_CALL) :].strip()).read_bytes().decode().split("\0")[:-1]
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = call_main(argv)
            stdout.append(out.getvalue())
            stderr.append(err.getvalue())
            if code:
                return subprocess.CompletedProcess(proc.args, code, "".join(stdout), "".join(stderr))
    return subprocess.CompletedProcess(proc.args, proc.returncode, "".join(stdout), "".join(stderr))


def tiny_llama(layers: int = 3):
    """``(model, config)``: a seeded random Llama small enough for step-by-step tests, on our attention."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="ov_kvcrush").eval(), cfg


@contextlib.contextmanager
def gguf_parsed_once():
    """Within the block, transformers' GGUF loading parses each file once, quickly.

    transformers parses the whole GGUF twice (for its config, then for its tokenizer), and most
    of a parse is numpy's memmap subclass finalizing each of the millions of slices gguf takes of
    the file (10 s for Gemma 3's 262k-token vocabulary). Here the second parse gets the first's
    reader, and the reader slices a plain array over the same mapping: the same fields."""
    import gguf

    class PlainViewReader(gguf.GGUFReader):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, mapping):
            self._plain = mapping.view(np.ndarray)

    readers: dict[str, gguf.GGUFReader] = {}

    def read_once(path, *args, **kwargs):
        if str(path) not in readers:
            readers[str(path)] = PlainViewReader(path, *args, **kwargs)
        return readers[str(path)]

    original, gguf.GGUFReader = gguf.GGUFReader, read_once
    try:
        yield
    finally:
        gguf.GGUFReader = original


def teacher_forced(
    model_dir: str, ids: list[int], forced: list[int], device: str, properties: dict, compressions: list,
    block_size: int, after_prompt: Callable[[Any], None] | None = None, kv_precision: str = "f16",
) -> list[np.ndarray]:  # fmt: skip
    """Each of ``compressions``' logits ``[1 + len(forced), vocab]`` through the openvino engine on
    ``device`` (a ``kv_precision`` KV store, blocks of ``block_size``): after ``ids`` (then
    ``after_prompt(engine)``, such as a scoring pass) and after each token of ``forced`` fed in
    turn (the same tokens whatever each device would pick)."""
    from ov_kvcrush.serving.openvino_engine import OpenVINOEngine

    engine = OpenVINOEngine(model_dir, device=device, kv_precision=kv_precision, block_size=block_size,
                            properties=properties)  # fmt: skip
    out = []
    try:
        for compression in compressions:
            engine.set_compression(compression)
            rows = [engine.prefill(ids)]
            if after_prompt is not None:
                after_prompt(engine)
            rows += [engine.forward([t]) for t in forced]
            out.append(np.stack(rows))
    finally:
        engine.close()
    return out


def word_texts(lengths: tuple[int, ...], seed: int = 7) -> list[str]:
    """Texts of ``lengths`` words drawn from a few (the GPU checks' prompts that a tokenizer reads:
    a recall method's tests, whose oracle is the torch reference over the text)."""
    rng = np.random.default_rng(seed)
    words = ["river", "stone", "amber", "north", "quiet", "lamp", "harvest", "seven", "copper", "field", "window"]
    return [" ".join(rng.choice(words, n)) for n in lengths]


def batched_beside_decoding(
    model_dir: str, prompts: list[list[int]], device: str, compression: Any, block_size: int, new_tokens: int,
    step_tokens: int, whole: bool = True,
) -> tuple[list, list, dict]:  # fmt: skip
    """The greedy tokens of each prompt through the openvino engine's loop on ``device`` (f32) with
    a scheduler config of ``step_tokens`` tokens a step: the prompts but the last entered together
    and stepped until each has decoded a token, then the last beside them, every prompt in chunks;
    and (where ``whole``) each prompt's alone and whole, else none; and the loop's stats. The
    tests take the prompts alone and whole on the CPU op only: the GPU's tokens together equal
    to those, its own whole prompts would add only compiles at their sizes (about a third of
    such a test's time under the emulation)."""
    import openvino_genai

    from ov_kvcrush.config import GenerationSettings
    from ov_kvcrush.serving.loop import GenerationLoop
    from ov_kvcrush.serving.openvino_engine import OpenVINOEngine

    sc = openvino_genai.SchedulerConfig()
    sc.max_num_batched_tokens, sc.max_num_seqs = step_tokens, 8
    engine = OpenVINOEngine(model_dir, device=device, kv_precision="f32", block_size=block_size, properties=F32,
                            scheduler_config=sc)  # fmt: skip
    settings = GenerationSettings(max_new_tokens=new_tokens, ignore_eos=True)
    try:
        engine.set_compression(compression)
        loop = engine.batcher
        handles = [loop.add_request(i, ids, settings) for i, ids in enumerate(prompts[:-1])]
        while loop.stats["decode_rows"] < len(handles):
            loop.step()
        handles.append(loop.add_request(len(handles), prompts[-1], settings))
        while loop.has_non_finished_requests():
            loop.step()
        together = [list(h.result().token_ids) for h in handles]
        alone = []
        if whole:
            whole_loop = GenerationLoop(engine, None, whole_prompts=True)
            alone = [list(whole_loop.run(ids, settings, None).token_ids) for ids in prompts]
        return together, alone, dict(loop.stats)
    finally:
        engine.close()


def check_gpu_gives_cpu_ops_tokens(
    worker: Any, model_dir: str, compression: Any, lengths: tuple[int, ...], seed: int, block_size: int,
    new_tokens: int, step_tokens: int,
) -> None:  # fmt: skip
    """Prompts of random ids of ``lengths`` through :func:`batched_beside_decoding` on ``GPU`` in
    the emulation ``worker`` and on the CPU op: the GPU's tokens together equal the CPU op's
    together and each prompt's alone and whole, and the prompts went in chunks."""
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(10, 380, n)] for n in lengths]
    args = (compression, block_size, new_tokens, step_tokens)
    cpu = batched_beside_decoding(model_dir, prompts, "CPU", *args)
    gpu = worker.submit(batched_beside_decoding, model_dir, prompts, "GPU", *args, False).result(timeout=900)
    assert gpu[0] == cpu[0] == cpu[1]  # the GPU together, the CPU op together and whole
    assert gpu[2]["prefill_chunks"] > len(prompts)  # the prompts went in chunks
