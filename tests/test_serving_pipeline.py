"""Continuous batching on the embedded model (issue 23, item 1): batched results against one-at-a-time runs.

Oracle: each prompt generated alone, greedily, by the same engine (``OpenVINOEngine.generate``,
whole prompt in one step, one sequence). The batch prefills in chunks and decodes every running
sequence in the same inference as a chunk (one ragged row) or in one of its own; at f32
inference precision a row's logits do not depend on the batch, so the tokens must be the same.
The pool-exhaustion test checks that requests wait (or are
preempted and recomputed), none fails, the pool's limit is never passed and every block comes back.
"""

from __future__ import annotations

import threading

import openvino_genai as ov_genai
import pytest

from ov_kvcrush import LLMPipeline
from ov_kvcrush.config import CompressionConfig, GenerationSettings
from ov_kvcrush.errors import UserError
from ov_kvcrush.serving import ContinuousBatchingPipeline, GenerationStatus
from ov_kvcrush.serving.openvino_engine import OpenVINOEngine

F32 = {"INFERENCE_PRECISION_HINT": "f32"}
TOPICS = ["lighthouses", "honey bees", "the Roman road network", "glaciers"]
NEW = 16


def long_prompt(topic: str, sentences: int = 14) -> str:
    """A ~250-token prompt: long enough for a 128-token budget to evict."""
    facts = " ".join(
        f"Fact {i} about {topic}: it has been studied for {i * 7 + 3} years by {i + 2} teams." for i in range(sentences)
    )
    return f"{facts}\nIn one sentence, what is the most surprising fact about {topic}?"


PROMPTS = [long_prompt(t) for t in TOPICS]


def scheduler_config(**fields) -> ov_genai.SchedulerConfig:
    sc = ov_genai.SchedulerConfig()
    for k, v in fields.items():
        setattr(sc, k, v)
    return sc


@pytest.fixture(scope="module")
def engine(model_dir):
    # an f32 store: a prompt in chunks reads its earlier chunks from the store, a whole prompt
    # attends them exactly (issue 72), so only an exact store makes the two the same numbers
    return OpenVINOEngine(model_dir, kv_precision="f32", properties=F32)


METHODS = {
    "full": CompressionConfig(),
    "snapkv": CompressionConfig(method="snapkv", budget=128),
    "kvcrush": CompressionConfig(method="kvcrush", budget=128),
    "minikv": CompressionConfig(method="minikv", budget=128),
    "clusterkv": CompressionConfig(method="clusterkv", budget=128),
    "kvzip": CompressionConfig(method="kvzip", budget=128),  # its scoring pass runs after each prompt
}


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
def test_a_batch_gives_the_tokens_of_one_at_a_time_runs(engine, method):
    engine.set_compression(METHODS[method])
    settings = GenerationSettings(max_new_tokens=NEW, ignore_eos=True)
    alone = [engine.generate(p, settings) for p in PROMPTS]
    cb = ContinuousBatchingPipeline(engine, scheduler_config(max_num_batched_tokens=96))
    cb.trace = []
    batched = cb.generate(PROMPTS, settings)
    # the trace has every inference: each step one, feeding every prompt token and decode row once
    assert len(cb.trace) == cb.stats["steps"]
    assert sum(t for _, t, _ in cb.trace) == sum(b.prompt_tokens for b in batched) + cb.stats["decode_rows"]
    assert all(s > 0 for _, _, s in cb.trace)
    for a, b, topic in zip(alone, batched, TOPICS, strict=True):
        assert b.token_ids == a.token_ids, f"{method}, {topic}: {b.text!r} != {a.text!r}"
        assert b.prompt_tokens == a.prompt_tokens > 96
        assert b.counters["prefill_chunks"] >= 3  # the prompt came in chunks of <= 96 tokens
        if method != "full" and method != "clusterkv":
            assert b.counters["tokens_held_per_head"] < b.prompt_tokens  # the method did evict
            assert b.kv_bytes == a.kv_bytes
        if method == "kvzip":
            assert b.counters["scoring_pass_ms"] > 0 and a.counters["scoring_pass_ms"] > 0
    assert max(b.counters["decode_batch_mean"] for b in batched) > 1  # decode steps were shared
    assert cb.stats["ragged_steps"] > 0  # chunks went beside decode tokens
    assert cb.stats["scoring_passes"] == (len(PROMPTS) if method == "kvzip" else 0)
    assert cb.stats["failed"] == 0
    assert engine.pool.stats().blocks_in_use == 0  # every block came back


@pytest.mark.slow
def test_a_full_pool_makes_requests_wait_and_none_fails(model_dir):
    # native blocks of 32 tokens of every layer and head: 7 hold two of these requests (~3 each)
    sc = scheduler_config(num_kv_blocks=7, max_num_batched_tokens=128)
    cb = ContinuousBatchingPipeline(model_dir, sc, properties=F32)
    e = cb.engine
    limit = e.max_kv_blocks
    assert limit == 7 * e.shape.layers * e.shape.kv_heads
    prompts = [f"Tell me a short fact about {t}." + " Please be precise and brief." * 8 for t in TOPICS * 2]
    settings = GenerationSettings(max_new_tokens=24, ignore_eos=True)
    alone = [e.generate(p, settings) for p in prompts]
    results = cb.generate(prompts, settings)
    assert [r.token_ids for r in results] == [a.token_ids for a in alone]
    assert cb.stats["failed"] == 0
    assert cb.stats["waited"] >= 4  # the pool, not max_num_seqs, made them wait
    stats = cb.pool.stats()
    assert stats.peak_blocks <= limit and stats.blocks_in_use == 0
    with pytest.raises(UserError, match=r"does not fit the KV pool even alone.*num_kv_blocks"):
        cb.add_request(99, " ".join(["word"] * 400), GenerationSettings(max_new_tokens=8))


@pytest.mark.slow
def test_kvzip_passes_fit_a_tight_pool_and_give_the_tokens_of_one_at_a_time_runs(model_dir):
    """A scoring pass needs room for one of its steps beside the whole prompt: requests wait for
    it (or a later one is preempted), none fails, and a request the pool cannot serve with its
    pass is refused up front, naming it."""
    comp = CompressionConfig(method="kvzip", budget=64, options={"chunk_tokens": 64})
    sc = scheduler_config(num_kv_blocks=20, max_num_batched_tokens=128)
    cb = ContinuousBatchingPipeline(model_dir, sc, properties=F32, compression=comp)
    e = cb.engine
    limit = e.max_kv_blocks
    settings = GenerationSettings(max_new_tokens=12, ignore_eos=True)
    alone = [e.generate(p, settings) for p in PROMPTS]
    results = cb.generate(PROMPTS, settings)
    assert [r.token_ids for r in results] == [a.token_ids for a in alone]
    assert cb.stats["scoring_passes"] == len(PROMPTS) and cb.stats["failed"] == 0
    assert cb.stats["waited"] >= 1  # the pool (prompt + a pass step each) made some wait
    stats = cb.pool.stats()
    assert stats.peak_blocks <= limit and stats.blocks_in_use == 0
    with pytest.raises(UserError, match="a scoring pass step"):
        cb.add_request(99, " ".join(["word"] * 520), GenerationSettings(max_new_tokens=8))


@pytest.mark.slow
def test_decode_growth_preempts_a_request_which_is_recomputed_to_the_same_tokens(model_dir):
    # 6 native blocks: two ~40-token prompts start together, their 70 new tokens do not fit both
    # an f32 store too: at u8 a recomputed token's keys are read exactly in its prompt step where
    # the first run read them through the store, which can turn a greedy near tie
    cb = ContinuousBatchingPipeline(model_dir, scheduler_config(num_kv_blocks=6),
                                    properties={**F32, "KV_CACHE_PRECISION": "f32"})  # fmt: skip
    prompts = [f"Write a long poem about {t}." for t in ("the sea", "a mountain", "winter")]
    settings = GenerationSettings(max_new_tokens=70, ignore_eos=True)
    alone = [cb.engine.generate(p, settings) for p in prompts]
    results = cb.generate(prompts, settings)
    assert [r.token_ids for r in results] == [a.token_ids for a in alone]
    assert cb.stats["preemptions"] >= 1 and sum(r.counters["preemptions"] for r in results) >= 1
    assert cb.stats["failed"] == 0 and cb.pool.stats().blocks_in_use == 0


@pytest.mark.slow
def test_requests_from_threads_join_one_batch(engine):
    engine.set_compression(CompressionConfig(method="snapkv", budget=128))
    settings = GenerationSettings(max_new_tokens=NEW, ignore_eos=True)
    alone = {p: engine.generate(p, settings).token_ids for p in PROMPTS}
    cb = ContinuousBatchingPipeline(engine)
    results: dict[str, object] = {}
    go = threading.Barrier(len(PROMPTS))

    def request(prompt: str) -> None:
        go.wait()
        results[prompt] = cb.submit(prompt, settings).result(timeout=300)

    threads = [threading.Thread(target=request, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert {p: r.token_ids for p, r in results.items()} == alone
    assert max(r.counters["decode_batch_mean"] for r in results.values()) > 1


def test_stream_read_and_cancel(engine):
    engine.set_compression(CompressionConfig())
    cb = ContinuousBatchingPipeline(engine)
    pieces: list[str] = []
    streamed = cb.add_request(1, "Name three colours.", GenerationSettings(max_new_tokens=12), pieces.append)
    cancelled = cb.add_request(2, PROMPTS[0], GenerationSettings(max_new_tokens=60, ignore_eos=True))
    read: list[int] = []
    for _ in range(8):
        cb.step()
        read += cancelled.read()
    cancelled.cancel()
    while cb.has_non_finished_requests():
        cb.step()
    result = streamed.result()
    assert "".join(pieces) == result.text
    assert cancelled.status is GenerationStatus.CANCELLED
    partial = cancelled.result()
    assert read == partial.token_ids[: len(read)] and 0 < partial.generated_tokens < 60
    assert engine.pool.stats().blocks_in_use == 0
    with pytest.raises(Exception, match="request_id"):
        cb.add_request(3, "a", GenerationSettings())
        cb.add_request(3, "b", GenerationSettings())


def test_llm_pipeline_batches_a_list_of_prompts(model_dir):
    pipe = LLMPipeline(model_dir, backend="openvino", compression="snapkv", budget=128, properties=F32)
    results = pipe.generate(PROMPTS[:3], max_new_tokens=8, ignore_eos=True)
    alone = pipe.engine.generate(PROMPTS[1], GenerationSettings(max_new_tokens=8, ignore_eos=True))
    assert results[1].token_ids == alone.token_ids
    assert max(r.counters["decode_batch_mean"] for r in results) > 1


def test_a_warm_up_runs_every_kind_of_step_and_leaves_no_trace(engine, model_dir):
    """A server warms its pipeline before it listens (``ov-kvcrush serve``): the warm-up feeds a
    fast prompt chunk, the prompt's rest (past the method's budget) and a decode step, and leaves
    the pool, the kept caches, the counts and the next answers as they were. A pool too small for
    it runs nothing."""
    engine.set_compression(CompressionConfig(method="snapkv", budget=128))
    settings = GenerationSettings(max_new_tokens=NEW, ignore_eos=True)
    cb = ContinuousBatchingPipeline(engine)
    before = [r.token_ids for r in cb.generate(PROMPTS[:2], settings)]
    counts = dict(cb.stats)
    cb.trace = []
    assert cb.warm_up()
    # fast chunks, the rest (past the budget of 128: the method selects), a decode step
    assert [tokens for _, tokens, _ in cb.trace] == [256, 32, 1]
    assert cb.stats == counts and cb.pool.stats().blocks_in_use == 0 and len(cb.kept) == 0
    assert [r.token_ids for r in cb.generate(PROMPTS[:2], settings)] == before

    tight = ContinuousBatchingPipeline(model_dir, scheduler_config(num_kv_blocks=1), properties=F32)
    assert not tight.warm_up() and not tight.trace and tight.stats == dict.fromkeys(tight.stats, 0)
