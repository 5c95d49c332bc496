"""Conversation caches on disk (issue 73, item 5): a sequence's snapshot, its file, a directory
of them, and what a crash or a bad file must never do.

Oracle: the sequence that was saved. A restored sequence must step exactly as the saved one
does (the same outputs, bit for bit, and the same tokens held), since its blocks are the saved
bytes; a file that is not whole, or not this model's and pool's, must never be restored.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from helpers import HKV, HQ, D, held_positions, infer, op_model

from ov_kvcrush.engines.openvino_model import SequenceCache
from ov_kvcrush.methods import QuantSettings, method_config
from ov_kvcrush.methods.vectors import layer_vectors
from ov_kvcrush.op import kvcache
from ov_kvcrush.op.method_spec import method_spec
from ov_kvcrush.op.plugin import PluginError
from ov_kvcrush.op.snapshot import read_snapshot
from ov_kvcrush.serving.persist import (
    FORMAT_VERSION,
    TEMP_PREFIX,
    CacheFileError,
    DiskCaches,
    load_cache,
    pool_identity,
    save_cache,
)

CASES = {
    "full-u8": ("full", {}, "u8"),
    "snapkv-f16": ("snapkv", dict(budget=96, sink_tokens=4, recent_tokens=16), "f16"),
    "h2o-2bit": ("h2o", dict(budget=96, recent_tokens=16, quant=QuantSettings(residual_tokens=32)), "f32"),
    "minikv": ("minikv", dict(budget=96, quant=QuantSettings(residual_tokens=32)), "f32"),
    "chelsea": ("chelsea", dict(budget=96, chunk_size=32, merge_interval=8), "f32"),
    "kvcrush-u8": ("kvcrush", dict(budget=96, sink_tokens=4, recent_tokens=16, representatives=24), "u8"),
    "sliding-window": ("full", {}, "f16"),  # a local layer's ring of blocks (Gemma 2 and 3)
}
WINDOWS = {"sliding-window": [64]}


class Layer:
    """One layer of the op over a pool of ``method``, fed the shared test vectors."""

    def __init__(self, core, method: str, fields: dict, precision: str, windows: list[int] | None = None) -> None:
        self.spec = method_spec(method_config(method, **fields), 1, HQ, 32, windows)
        self.precision, self.windows = precision, windows
        self.req = op_model(core, HQ, HKV, D)
        self.v = layer_vectors(0, kv_heads=HKV, q_heads=HQ, tokens=300, head_dim=D)

    def pool(self, **kw) -> kvcache.KVPool:
        precision = kw.get("precision", self.precision)
        return kvcache.KVPool(1, HQ, HKV, D, precision=precision, method=self.spec, windows=self.windows)

    def step(self, seq: kvcache.KVSequence, a: int, b: int) -> np.ndarray:
        q, k, v = (x[:, :, a:b].numpy() for x in (self.v.queries, self.v.keys, self.v.values))
        return np.array(infer(self.req, {"q": q, "k": k, "v": v, "kvc_sequence": np.array([seq.handle])})[0])


def identity(pool: kvcache.KVPool, model: str = "m") -> dict:
    return {"format": FORMAT_VERSION, "model": model, "pool": pool_identity(pool)}


def saved_layer(ov_core, tmp_path, case: str = "full-u8"):
    """A layer whose sequence took a prompt and 30 decode steps, saved to a file."""
    layer = Layer(ov_core, *CASES[case], WINDOWS.get(case))
    pool = layer.pool()
    seq = pool.new_sequence()
    layer.step(seq, 0, 200)
    for t in range(200, 230):
        layer.step(seq, t, t + 1)
    path = tmp_path / "a.kvc.npz"
    size = save_cache(path, SequenceCache(seq, list(range(230)), 0), identity(pool))
    return layer, pool, seq, path, size


@pytest.mark.parametrize("case", list(CASES))
def test_a_restored_sequence_steps_as_the_saved_one_bit_for_bit(ov_core, tmp_path, case):
    layer, _, seq, path, size = saved_layer(ov_core, tmp_path, case)
    other = layer.pool()  # another pool of the same configuration (a restarted process's)
    restored, _ = load_cache(path, other.new_sequence(), identity(other))
    assert restored.ids == list(range(230)) and not restored.holds_prompt
    for a, b in [*((t, t + 1) for t in range(230, 250)), (250, 262), (262, 263)]:  # decode, a turn, decode
        np.testing.assert_array_equal(layer.step(restored.sequence, a, b), layer.step(seq, a, b), err_msg=f"{a}")
        assert [p.tolist() for p in held_positions(restored.sequence, 0)] == [
            p.tolist() for p in held_positions(seq, 0)
        ]
    if case == "full-u8":  # the full cache's file: its blocks, plus ids and positions
        assert size <= 1.2 * seq.stats().kv_bytes


def test_a_method_with_state_beside_its_slots_is_refused_by_name(ov_core):
    layer = Layer(ov_core, "clusterkv", dict(budget=96, sink_tokens=4, dense_layers=0), "f32")
    seq = layer.pool().new_sequence()
    layer.step(seq, 0, 200)
    layer.step(seq, 200, 201)
    with pytest.raises(PluginError, match="ClusterKV's clusters"):
        read_snapshot(seq)


def _rewrite(path, **changes):
    """The file's arrays rewritten with ``changes`` (its old checksum kept)."""
    with np.load(path) as z:
        arrays = {n: z[n] for n in z.files}
    arrays.update(changes)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("truncated", "corrupt"),
        ("a byte flipped", "corrupt"),
        ("an array changed", "checksum"),
        ("another model", "model"),
        ("another pool", "config"),
        ("another version", "version"),
    ],
)
def test_a_file_that_must_not_be_reused_is_refused_by_reason_and_restores_nothing(ov_core, tmp_path, damage, reason):
    layer, pool, _, path, _ = saved_layer(ov_core, tmp_path)
    want = identity(pool)
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "a byte flipped":
        path.write_bytes(data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 1]) + data[len(data) // 2 + 1 :])
    elif damage == "an array changed":
        with np.load(path) as z:
            blocks = z["blocks"].copy()
        blocks[100] ^= 1
        _rewrite(path, blocks=blocks)
    elif damage == "another model":
        want = identity(pool, model="another")
    elif damage == "another pool":
        pool = layer.pool(precision="f16")
        want = identity(pool)
    else:
        save_cache(path, None, {**want, "format": FORMAT_VERSION + 1})
    target = pool.new_sequence()
    with pytest.raises(CacheFileError) as err:
        load_cache(path, target, want)
    assert err.value.reason == reason
    assert target.stats().tokens_held == 0 and target.stats().blocks_held == 0


def test_a_directory_restores_a_conversation_replaces_its_earlier_turn_and_evicts_the_least_used(ov_core, tmp_path):
    layer, pool, seq, _path, size = saved_layer(ov_core, tmp_path / "one")
    ident = identity(pool)
    store = DiskCaches(tmp_path / "caches", ident, max_bytes=int(2.5 * size), min_shared=16)
    first = SequenceCache(seq, list(range(230)), 0)
    store.save(first)
    assert store.restore(list(range(100)), pool) is None  # a shorter prompt: not this conversation's next turn
    turn = store.restore([*range(230), 7, 8], pool)  # the next turn
    assert turn is not None and turn.ids == first.ids and not turn.holds_prompt
    turn.holds_prompt = True  # a held prompt's file says so (its ids are a prompt's start)
    store.save(turn)
    turn.sequence.free()
    turn = store.restore([*range(230), 7, 8], pool)
    assert turn is not None and turn.holds_prompt
    layer.step(turn.sequence, 230, 240)
    turn.ids = list(range(240))
    store.save(turn)  # the earlier turn's file goes
    assert len(store) == 1 and store.counts["saved"] == 3 and store.counts["restored"] == 2
    for n in (3, 4):  # two more conversations: past the budget, the least recently used goes
        other = pool.new_sequence()
        layer.step(other, 0, 230)
        store.save(SequenceCache(other, [n] * 230, 0))
    assert len(store) == 2 and store.counts["evicted"] == 1
    assert store.restore([*range(240), 1], pool) is None  # it was the least recently used
    assert store.bytes_on_disk() <= store.max_bytes


def test_a_restart_ignores_unfinished_and_bad_files_and_counts_them(ov_core, tmp_path):
    _layer, pool, seq, _path, _ = saved_layer(ov_core, tmp_path / "one")
    ident = identity(pool)
    store = DiskCaches(tmp_path / "caches", ident, max_bytes=1 << 30)
    store.save(SequenceCache(seq, list(range(230)), 0))
    (good,) = store.directory.glob("*.kvc.npz")
    (store.directory / (TEMP_PREFIX + "x")).write_bytes(good.read_bytes()[:1000])  # a write a kill cut short
    (store.directory / ("bad.kvc.npz")).write_bytes(good.read_bytes()[:5000])  # a file cut short anyhow
    again = DiskCaches(store.directory, ident, max_bytes=1 << 30)
    assert len(again) == 1 and again.counts == {"rejected_unfinished": 1, "rejected_corrupt": 1}
    assert sorted(p.name for p in store.directory.iterdir()) == [good.name]
    assert DiskCaches(store.directory, {**ident, "model": "another"}, 1 << 30).counts == {"rejected_model": 1}


def test_a_file_another_process_evicted_is_a_miss_not_a_bad_file(ov_core, tmp_path):
    _layer, pool, seq, _path, _ = saved_layer(ov_core, tmp_path / "one")
    ident = identity(pool)
    mine = DiskCaches(tmp_path / "caches", ident, max_bytes=1 << 30)
    mine.save(SequenceCache(seq, list(range(230)), 0))
    theirs = DiskCaches(tmp_path / "caches", ident, max_bytes=1 << 30)  # indexes it
    for path in (tmp_path / "caches").glob("*.kvc.npz"):
        path.unlink()  # the other process evicted it
    assert theirs.restore([*range(230), 1], pool) is None and len(theirs) == 0
    assert not any(k.startswith("rejected_") for k in theirs.counts)


WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from helpers import HKV, HQ, D, infer, op_model
    from ov_kvcrush.engines.openvino_model import SequenceCache
    from ov_kvcrush.op import kvcache, plugin
    from ov_kvcrush.serving.persist import DiskCaches, FORMAT_VERSION, pool_identity

    pool = kvcache.KVPool(1, HQ, HKV, D, precision="f32")
    seq = pool.new_sequence()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, HQ, 4000, D)).astype(np.float32)
    kv = rng.standard_normal((1, HKV, 4000, D)).astype(np.float32)
    step = {"q": x, "k": kv, "v": kv, "kvc_sequence": np.array([seq.handle])}
    infer(op_model(plugin.shared_core(), HQ, HKV, D), step)
    store = DiskCaches(sys.argv[1], {"format": FORMAT_VERSION, "model": "m", "pool": pool_identity(pool)}, 1 << 40)
    for n in range(1 << 20):
        store.save(SequenceCache(seq, [n] * 4000, 0))
        print("saved", flush=True)
    """
)


def test_a_process_killed_while_it_writes_leaves_no_file_that_is_reused(tmp_path):
    """``kill -9`` in the middle of writing caches, over and over: every file a restart indexes
    restores whole (it passes its checksum), and what the kill cut short is never offered."""
    from ov_kvcrush.serving.persist import read_file

    directory = tmp_path / "caches"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    unfinished = 0
    for delay in (0.0, 0.003, 0.011, 0.029):
        cmd = [sys.executable, "-c", WRITER, str(directory)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, text=True)
        try:
            for _ in range(3):
                assert proc.stdout.readline().strip() == "saved"
            time.sleep(delay)  # somewhere inside the next write
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        unfinished += sum(1 for _ in directory.glob(TEMP_PREFIX + "*"))
        pool = kvcache.KVPool(1, HQ, HKV, D, precision="f32")
        store = DiskCaches(directory, {"format": FORMAT_VERSION, "model": "m", "pool": pool_identity(pool)}, 1 << 40)
        assert store.counts.get("rejected_unfinished", 0) == unfinished
        assert not any(k.startswith("rejected_") and k != "rejected_unfinished" for k in store.counts)  # all whole
        unfinished = 0
        for path in directory.glob("*.kvc.npz"):
            read_file(path)  # whole: its checksum holds
        assert not list(directory.glob(TEMP_PREFIX + "*"))


DOCUMENT = (
    "The archive holds letters from a lighthouse keeper who wrote each evening about the weather, "
    "the ships that passed and the birds on the gallery. "
) * 10 + "The password of the storeroom is BLUE-FALCON-7421. "


@pytest.mark.model
def test_a_chat_saved_and_loaded_answers_as_the_chat_that_went_on(model_dir, tmp_path):
    """``save_chat`` then ``load_chat`` in a new pipeline (a restarted program): the next turn
    continues from the restored cache and answers as the chat that was never interrupted; a
    pipeline of another method restores the messages only, and its next turn prefills them."""
    from ov_kvcrush import LLMPipeline

    settings = dict(max_new_tokens=12)
    first = LLMPipeline(model_dir, backend="openvino", compression="full")
    first.start_chat()
    first.generate(DOCUMENT + "Remember it.", **settings)
    path = tmp_path / "chat.kvc.npz"
    size = first.save_chat(path)
    assert size <= 1.2 * first.engine.cache.sequence.stats().kv_bytes + (1 << 16)
    want = first.generate("What is the password?", **settings)

    second = LLMPipeline(model_dir, backend="openvino", compression="full")
    assert second.load_chat(path) is True
    assert second.chat_history == first.chat_history[:2]
    got = second.generate("What is the password?", **settings)
    assert got.text == want.text
    assert got.prompt_tokens == want.prompt_tokens  # the same conversation, continued

    other = LLMPipeline(model_dir, backend="openvino", compression="snapkv", budget=128)
    assert other.load_chat(path) is False  # another pool: the messages only
    assert other.chat_history == first.chat_history[:2] and not other.engine.cache.ids
    with pytest.raises(Exception, match="is not a conversation this version can continue"):
        other.load_chat(tmp_path / "missing.kvc.npz")


@pytest.mark.model
def test_the_chat_commands_save_and_load_a_conversation(model_dir, tmp_path):
    import argparse
    import io

    from ov_kvcrush.cli.chat import chat

    path = tmp_path / "c.kvc.npz"
    args = argparse.Namespace(backend="openvino", method="full", budget=None, model=str(model_dir), system="",
                              max_new_tokens=6, kv_precision=None, sample=False, seed=0, quiet=True)  # fmt: skip
    out = io.StringIO()
    chat(args, stdin=io.StringIO(f"My name is Ada.\n/save {path}\n/save\n"), stdout=out)
    assert f"(saved the conversation to {path}: " in out.getvalue() and "(/save needs a file" in out.getvalue()
    out = io.StringIO()
    chat(args, stdin=io.StringIO(f"/load {path}\n/load {tmp_path / 'none'}\n"), stdout=out)
    assert f"(continuing the conversation of {path}: 1 turn(s), its cache restored)" in out.getvalue()
    assert "(error: load_chat: " in out.getvalue() and "the conversation goes on)" in out.getvalue()


def _serve(model_dir, port: int, cache_dir, method: tuple[str, ...] = ()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ov_kvcrush", "serve", "--model", str(model_dir), "--port", str(port),
           "--cache-dir", str(cache_dir), "--served-model-name", "m", "--quiet", *method]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout.readline().startswith("serving "), "the server did not start"
    return proc


@pytest.mark.model
@pytest.mark.parametrize("method", ["full", "snapkv"])
def test_a_conversation_goes_on_from_disk_after_the_server_is_killed(model_dir, tmp_path, method):
    """``serve --cache-dir``: turn one, then ``kill -9``; a new server on the same directory
    continues turn two from the file (its prompt tokens cached), with the answer of the server
    that kept it in memory (the in-process loop's two turns over one cache: the oracle). SnapKV's
    file is a held prompt (turn one's prompt before its selection, serving/kept.py)."""
    import socket

    import openai

    from ov_kvcrush.config import GenerationSettings
    from ov_kvcrush.server.config import ServerConfig
    from ov_kvcrush.server.factory import build_backend

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    first = [{"role": "user", "content": DOCUMENT + "Remember the password."}]

    def ask(messages):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0)
        return r.choices[0].message.content, r.usage

    flags = ("--method", method, *(("--budget", "128") if method != "full" else ()))
    proc = _serve(model_dir, port, tmp_path, flags)
    try:
        a1, _ = ask(first)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    second = [*first, {"role": "assistant", "content": a1}, {"role": "user", "content": "What is the password?"}]
    proc = _serve(model_dir, port, tmp_path, flags)
    try:
        a2, usage = ask(second)
        metrics = openai.OpenAI(base_url=f"http://127.0.0.1:{port}", api_key="-").get("/metrics", cast_to=str)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    budget = None if method == "full" else 128
    loop = build_backend(ServerConfig(model=str(model_dir), method=method, budget=budget)).pipeline
    ids1, ids2 = loop.encode(first, True), loop.encode(second, True)
    # from disk: turn one and its answer (the full cache), turn one's prompt but its last tokens (a held prompt)
    assert usage.prompt_tokens_details.cached_tokens >= len(ids1) - (0 if method == "full" else 128)
    cache = loop.turn_cache()
    settings = GenerationSettings(max_new_tokens=12)
    assert loop.run(ids1, settings, cache=cache).text == a1
    assert loop.run(ids2, settings, cache=cache).text == a2
    assert 'ovkc_disk_cache_files{event="restored"} 1.0' in metrics


def test_a_directory_that_cannot_hold_files_is_refused_at_start(tmp_path):
    from ov_kvcrush.errors import UserError

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    pool = kvcache.KVPool(1, HQ, HKV, D, precision="f32")
    with pytest.raises(UserError, match="cannot hold files"):
        DiskCaches(blocker / "caches", identity(pool), 1 << 20)
