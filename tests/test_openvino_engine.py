"""The OpenVINO engine on the embedded model: exact against OpenVINO's own SDPA and the torch engine.

* every decode step's logits equal the unmodified stateful IR's (``KV_CACHE_PRECISION`` = what
  our cache stores) on a ~1k-token prompt, and 64 greedy tokens are identical;
* greedy generation equals the torch engine's on an fp32 export of the same model;
* a 3-turn chat (cache kept across turns) gives the tokens of feeding each whole conversation;
* 100 generations leave no block in use; pipelines do not share state.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from helpers import F32, converted_steps, native_steps, run_main

from ov_kvcrush.config import CompressionConfig, GenerationSettings
from ov_kvcrush.errors import ConfigError, UserError
from ov_kvcrush.op.plugin import shared_core

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def engine(model_dir):
    from ov_kvcrush.serving.openvino_engine import OpenVINOEngine

    return OpenVINOEngine(model_dir, kv_precision="f32", properties=F32)


@pytest.fixture(scope="module")
def essay_prompt():
    """~1k tokens of essay prose and a request for a long answer (so greedy runs 64 tokens)."""
    from ov_kvcrush.corpus import essay_text, haystack_essays

    text = essay_text(haystack_essays()[0])[:4200]
    return text + "\n\nRewrite the text above as a long, detailed list of its main points."


@pytest.fixture(scope="module")
def native_f32(model_dir, engine, essay_prompt):
    """The unmodified IR's logits and greedy tokens for the essay, 64 steps, f32 cache."""
    return native_steps(model_dir / "openvino_model.xml", engine.encode(essay_prompt), 64, "f32")


@pytest.mark.slow
def test_logits_match_unmodified_model_every_step(model_dir, engine, essay_prompt, native_f32):
    ids = engine.encode(essay_prompt)
    assert 900 <= len(ids) <= 1300
    xml = model_dir / "openvino_model.xml"
    for kv in ("f32", "f16"):
        ref, tokens = native_f32 if kv == "f32" else native_steps(xml, ids, 64, kv)
        got, _, pool, seq = converted_steps(xml, ids, tokens[:-1], kv)
        scale = np.abs(ref).max()
        err = np.abs(got - ref).max(axis=1) / scale
        assert err.max() < (2e-5 if kv == "f32" else 1e-3), (kv, err.max())
        # the 64 greedy tokens are identical (each step's argmax, fed the same history)
        assert [int(np.argmax(x)) for x in got] == tokens
        assert seq.stats().tokens_seen == len(ids) + 64
        seq.free()
        assert pool.stats().blocks_in_use == 0


@pytest.mark.slow
def test_engine_generate_equals_unmodified_greedy(engine, essay_prompt, native_f32):
    ids = engine.encode(essay_prompt)
    _, tokens = native_f32
    res = engine.generate(essay_prompt, GenerationSettings(max_new_tokens=64))
    assert res.token_ids == tokens[: len(res.token_ids)]
    assert len(res.token_ids) == 64 or tokens[len(res.token_ids)] in engine.eos_ids
    assert res.backend == "openvino" and res.prompt_tokens == len(ids)
    assert res.kv_bytes == res.full_kv_bytes  # full cache
    # blocks: ceil(tokens / 32) per layer and KV head, f32 K and V
    assert res.full_kv_bytes == -(-(len(ids) + 63) // 32) * 30 * 3 * 2 * 32 * 64 * 4


@pytest.fixture(scope="module")
def fp32_ir():
    from ov_kvcrush.models.export import ensure_default_model

    return ensure_default_model("fp32", progress=False)


@pytest.mark.slow
def test_greedy_equals_torch_engine(fp32_ir, hf_dir, essay_prompt):
    from ov_kvcrush.engines.torch_engine import TorchEngine
    from ov_kvcrush.serving.openvino_engine import OpenVINOEngine

    ov_engine = OpenVINOEngine(fp32_ir, kv_precision="f32", properties=F32)
    torch_engine = TorchEngine(hf_dir)
    assert ov_engine.encode(essay_prompt) == torch_engine.encode(essay_prompt)
    settings = GenerationSettings(max_new_tokens=64)
    a = ov_engine.generate(essay_prompt, settings)
    b = torch_engine.generate(essay_prompt, settings)
    assert len(a.token_ids) >= 32
    assert a.token_ids == b.token_ids
    assert a.text == b.text
    # the same KV bytes for the same tokens: both f32, ours rounded up to whole 32-token blocks
    tokens = a.prompt_tokens + len(a.token_ids)
    assert b.full_kv_bytes <= a.full_kv_bytes < b.full_kv_bytes * (tokens + 32) / tokens


@pytest.mark.slow
def test_chat_turns_equal_whole_conversation(engine):
    from ov_kvcrush.serving.openvino_engine import OpenVINOEngine

    questions = [
        "My name is Ada and I keep bees. What is a good first hive?",
        "How many bees live in it?",
        "What was my name again, and what do I keep?",
    ]
    settings = GenerationSettings(max_new_tokens=40)
    engine.start_chat("You are a helpful assistant.")
    turns = [engine.generate(q, settings) for q in questions]
    history = engine.chat_history
    assert engine.sequence.stats().tokens_seen > sum(t.prompt_tokens for t in turns[:1])
    engine.finish_chat()
    assert engine.pool.stats().blocks_in_use == 0
    # later turns fed only the new tokens: the cache was kept
    assert turns[1].counters["prefill_tokens"] < turns[1].prompt_tokens
    assert turns[2].counters["prefill_tokens"] < turns[2].prompt_tokens
    # each turn again, as one prompt holding the whole conversation so far
    assert isinstance(engine, OpenVINOEngine)
    for i, turn in enumerate(turns):
        messages = history[: 1 + 2 * i + 1]  # system, (user, assistant) * i, user
        assert messages[-1] == {"role": "user", "content": questions[i]}
        whole = engine.generate(messages, settings)
        assert whole.token_ids == turn.token_ids, i
        assert whole.prompt_tokens == turn.prompt_tokens


@pytest.mark.slow
def test_hundred_generations_leak_no_blocks(engine):
    # the bare prompt (no chat template and its system message): the pool's bookkeeping is what is checked
    settings = GenerationSettings(max_new_tokens=3, apply_chat_template=False)
    allocated = None
    for i in range(100):
        engine.generate(f"Count to {i}.", settings)
        stats = engine.pool.stats()
        assert stats.blocks_in_use == 0 and stats.sequences == 1
        allocated = allocated or stats.blocks_allocated
        assert stats.blocks_allocated == allocated  # blocks are reused, the pool does not grow


def test_pipelines_do_not_share_state(model_dir, engine):
    from ov_kvcrush.serving.openvino_engine import OpenVINOEngine

    other = OpenVINOEngine(model_dir, kv_precision="f32", properties=F32)
    settings = GenerationSettings(max_new_tokens=12)
    alone = [engine.generate(q, settings).token_ids for q in ("Name a fruit.", "Name a color.")]
    engine.start_chat()
    other.start_chat()
    a1 = engine.generate("Name a fruit.", settings).token_ids
    b1 = other.generate("Name a color.", settings).token_ids
    a2 = engine.generate("Another one?", settings).token_ids
    b2 = other.generate("Another one?", settings).token_ids
    assert [a1, b1] == alone
    assert engine.pool.handle != other.pool.handle
    engine.finish_chat()
    other.finish_chat()
    engine.start_chat()
    engine.generate("Name a fruit.", settings)
    assert engine.generate("Another one?", settings).token_ids == a2
    engine.finish_chat()
    other.start_chat()
    other.generate("Name a color.", settings)
    assert other.generate("Another one?", settings).token_ids == b2
    other.close()


def test_sampling_is_seeded_and_streams(engine):
    settings = GenerationSettings(max_new_tokens=16, do_sample=True, temperature=1.2, top_k=50, top_p=0.95, seed=7)
    pieces: list[str] = []
    a = engine.generate("Tell me a story.", settings, streamer=lambda s: pieces.append(s) and False)
    b = engine.generate("Tell me a story.", settings)
    c = engine.generate("Tell me a story.", GenerationSettings(max_new_tokens=16, do_sample=True, seed=8))
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids
    assert "".join(pieces) == a.text


def test_pool_limit_from_scheduler_config_is_honoured(model_dir):
    import openvino_genai as ov_genai

    from ov_kvcrush.serving.openvino_engine import OpenVINOEngine

    sc = ov_genai.SchedulerConfig()
    sc.num_kv_blocks = 2  # two native blocks: 64 tokens of every layer
    small = OpenVINOEngine(model_dir, scheduler_config=sc)
    assert small.generate("Hi.", GenerationSettings(max_new_tokens=4)).text
    with pytest.raises(UserError, match="max_blocks=180"):
        small.generate("word " * 80, GenerationSettings(max_new_tokens=4))
    assert small.pool.stats().blocks_in_use == 0  # the failed sequence was released
    assert small.generate("Hi.", GenerationSettings(max_new_tokens=4)).text  # and the engine still works
    small.close()
    # without cache eviction, the scheduler config gives the limit and `compression` the method
    snap = OpenVINOEngine(model_dir, CompressionConfig(method="snapkv", budget=128), scheduler_config=sc)
    assert snap.compression.method == "snapkv" and snap.max_kv_blocks == small.max_kv_blocks == 180
    snap.close()
    with pytest.raises(UserError, match="max_kv_blocks or scheduler_config"):
        OpenVINOEngine(model_dir, max_kv_blocks=100, scheduler_config=sc)
    sc.use_cache_eviction = True
    with pytest.raises(UserError, match=r"compression or scheduler_config\.use_cache_eviction"):
        OpenVINOEngine(model_dir, CompressionConfig(method="snapkv", budget=128), scheduler_config=sc)
    sparse = ov_genai.SchedulerConfig()
    sparse.use_sparse_attention = True  # TRISHAPE, native's default mode: refused by name, never ignored
    with pytest.raises(UserError, match=r"sparse_attention_config\.mode='TRISHAPE' is invalid: allowed XATTENTION"):
        OpenVINOEngine(model_dir, scheduler_config=sparse)


def test_a_full_pool_is_an_error_on_one_inference_thread_too(model_dir):
    """With INFERENCE_NUM_THREADS=1 OpenVINO drops the op's exception; the engine still refuses the
    step that does not fit, naming the limit, and serves the next request."""
    from ov_kvcrush.serving.openvino_engine import OpenVINOEngine

    small = OpenVINOEngine(model_dir, max_kv_blocks=180, properties={"INFERENCE_NUM_THREADS": 1})
    with pytest.raises(UserError, match="max_blocks=180"):
        small.generate("word " * 80, GenerationSettings(max_new_tokens=4))
    assert small.pool.stats().blocks_in_use == 0
    assert small.generate("Hi.", GenerationSettings(max_new_tokens=4)).text
    small.close()


def test_scheduler_config_eviction_maps_to_methods():
    import openvino_genai as ov_genai

    from ov_kvcrush.config import to_native_scheduler_config
    from ov_kvcrush.engines.scheduler_config import (
        compression_from_scheduler_config,
        pool_blocks_from_scheduler_config,
    )

    for cfg in (
        CompressionConfig(method="h2o", budget=512),
        CompressionConfig(method="snapkv", budget=512, sink_tokens=64, snapkv_window=16),
        CompressionConfig(method="kvcrush", budget=512, aggregation="norm_sum"),
    ):
        sc = to_native_scheduler_config(cfg)
        back = compression_from_scheduler_config(sc)
        assert back.method == cfg.method and back.budget == cfg.budget
        assert back.native_sink_tokens == cfg.native_sink_tokens
        assert back.native_recent_tokens == cfg.native_recent_tokens
        assert back.aggregation == cfg.aggregation
        assert back.kvcrush.anchor == cfg.kvcrush.anchor
        # and back again: the same native configuration
        again = to_native_scheduler_config(back).cache_eviction_config
        assert again.get_max_cache_size() == sc.cache_eviction_config.get_max_cache_size()
        assert again.snapkv_window_size == sc.cache_eviction_config.snapkv_window_size
    sc = ov_genai.SchedulerConfig()
    assert compression_from_scheduler_config(sc).method == "full"
    assert pool_blocks_from_scheduler_config(sc, 30, 3, 8192) == 0
    sc.num_kv_blocks = 5
    assert pool_blocks_from_scheduler_config(sc, 30, 3, 8192) == 5 * 30 * 3
    sc.num_kv_blocks, sc.cache_size = 0, 1
    assert pool_blocks_from_scheduler_config(sc, 30, 3, 8192) == (1 << 30) // 8192


def test_bad_engine_arguments(model_dir, tmp_path):
    from ov_kvcrush.serving.openvino_engine import OpenVINOEngine

    with pytest.raises(ConfigError, match=r"device=.TPU.*CPU, or GPU or GPU\.N"):
        OpenVINOEngine(model_dir, device="TPU")
    if "GPU" not in shared_core().available_devices:  # here: no Intel GPU, and no emulation layer in this process
        with pytest.raises(UserError, match=r"device GPU needs an Intel GPU .*lists: CPU"):
            OpenVINOEngine(model_dir, device="GPU")
    with pytest.raises(ConfigError, match="kv_precision"):
        OpenVINOEngine(model_dir, kv_precision="u4")
    with pytest.raises(ConfigError, match="block_size"):
        OpenVINOEngine(model_dir, block_size=20)
    with pytest.raises(UserError, match=r"no openvino_model\.xml"):
        OpenVINOEngine(tmp_path)
    with pytest.raises(UserError, match="quest"):  # a recall baseline kept to the torch engine
        OpenVINOEngine(model_dir, CompressionConfig(method="quest", budget=256))
    with pytest.raises(ConfigError, match=r"options\.block_size"):  # block-wise KVCrush sets the pool's blocks
        OpenVINOEngine(model_dir, CompressionConfig(method="kvcrush", budget=256, options={"block_size": 8}))
    with pytest.raises(ConfigError, match="head_budgets"):
        OpenVINOEngine(model_dir, CompressionConfig(method="h2o", budget=256, options={"head_budgets": "adaptive"}))


def _cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ov_kvcrush", *args], input=stdin, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_cli_chat_keeps_context_across_turns(model_dir):
    """Scripted stdin: the second answer uses the first turn; /stats reads the op's cache; /reset forgets."""
    proc = _cli(
        "chat",
        "--model",
        str(model_dir),
        "--max-new-tokens",
        "24",
        stdin="My name is Ada. Say hello to me.\nWhat is my name?\n/stats\n/reset\n/stats\n",
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    turns = [tuple(map(int, m)) for m in re.findall(r"\[(\d+) tokens in context, (\d+) prefilled", proc.stderr)]
    assert len(turns) == 2
    (ctx1, fed1), (ctx2, fed2) = turns
    assert fed1 == ctx1  # first turn: the whole prompt
    assert ctx2 > ctx1 and fed2 < ctx2 - ctx1 + 24  # second turn: only what the cache did not hold
    stats = [ln for ln in lines if ln.startswith("cache:")]
    assert len(stats) == 2 and stats[1].startswith("cache: 0 tokens, 0 blocks")
    held = int(stats[0].split()[1])
    assert ctx2 <= held <= ctx2 + 24  # the conversation and the second answer
    assert "(new conversation)" in proc.stdout


@pytest.mark.slow
def test_cli_generate_openvino_backend(model_dir, tmp_path, capsys):
    prompt = tmp_path / "p.txt"
    prompt.write_text("What is the capital of France?")
    out = tmp_path / "r.json"
    # through the entry point's main, as the refusals below (a fresh interpreter's start: test_demo)
    code, _, err = run_main(
        capsys, "generate", "--backend", "openvino", "--model", str(model_dir), "--prompt-file", str(prompt),
        "--max-new-tokens", "8", "--kv-precision", "f32", "--json", str(out),
    )  # fmt: skip
    assert code == 0, err
    res = json.loads(out.read_text())
    assert res["backend"] == "openvino" and res["counters"]["kv_precision"] == "f32"
    assert res["kv_bytes"] == res["full_kv_bytes"] > 0 and "Paris" in res["text"]
    # refusals (test_user_errors runs such in a fresh interpreter)
    code, _, err = run_main(
        capsys, "generate", "--backend", "openvino", "--model", str(model_dir), "--prompt-file", str(prompt),
        "--method", "quest", "--budget", "128",
    )  # fmt: skip
    assert code == 2 and "quest" in err and "Traceback" not in err
    args = ("generate", "--backend", "torch", "--prompt-file", str(prompt), "--kv-precision", "f16")
    code, _, err = run_main(capsys, *args)
    assert code == 2 and "--kv-precision is for --backend openvino" in err


@pytest.mark.slow
def test_pipeline_chat_on_every_backend_matches_whole_conversation(model_dir):
    """LLMPipeline chat: openvino keeps its cache, genai is given the whole conversation; same answers."""
    import ov_kvcrush

    settings = GenerationSettings(max_new_tokens=16)
    for backend in ("openvino", "genai"):
        pipe = ov_kvcrush.LLMPipeline(model_dir, "CPU", backend=backend)
        pipe.start_chat("Be brief.")
        first, second = (pipe.generate(q, settings) for q in ("Hi, I am Ada.", "What is my name?"))
        history = pipe.chat_history
        assert [m["role"] for m in history] == ["system", "user", "assistant", "user", "assistant"]
        assert history[2]["content"] == first.text and history[4]["content"] == second.text
        # the second turn is answered with the whole conversation in context
        assert second.prompt_tokens == len(pipe.engine.encode(history[:4]))
        pipe.finish_chat()
        assert pipe.chat_history is None


def test_ignore_eos_runs_every_step(engine):
    short = engine.generate("What is the capital of France?", GenerationSettings(max_new_tokens=40))
    full = engine.generate("What is the capital of France?", GenerationSettings(max_new_tokens=40, ignore_eos=True))
    assert len(short.token_ids) < 40 and len(full.token_ids) == 40
    assert full.token_ids[: len(short.token_ids)] == short.token_ids
    with pytest.raises(ConfigError, match="ignore_eos"):
        GenerationSettings(ignore_eos="yes")


def test_request_past_the_context_is_refused(engine):
    assert engine.max_context > 0
    with pytest.raises(UserError, match=r"exceeds the model's context of \d+ tokens"):
        engine.generate("Hi.", GenerationSettings(max_new_tokens=engine.max_context))
    assert engine.pool.stats().blocks_in_use == 0  # refused before any step


def test_a_compression_is_checked_as_the_pool_would_take_it(engine):
    """``check_compression`` (a server's check of a request's method) accepts and refuses what
    making the pool does: block-wise KVCrush takes its own block size (the pool's then), and a
    method the op does not run is refused naming where it runs."""
    from ov_kvcrush.errors import ConfigError

    for block in (16, 64):
        compression = CompressionConfig("kvcrush", 256, options={"block_size": block})
        engine.check_compression(compression)
        assert engine.pool_spec(compression)[1] == block
    with pytest.raises(ConfigError, match=r"method='quest' is invalid: .*quest runs on:.*device GPU"):
        engine.check_compression(CompressionConfig("quest", 256))
