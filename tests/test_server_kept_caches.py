"""A conversation's cache kept across its turns (issue 50, item 2), through the server: the full
cache's, and a compressing method's held prompt (issue 73: a kept compressed cache answers later
turns worse than the history sent cold; the held prompt answers as cold, last test here).

Oracle: the loop's own two turns over one ``SequenceCache`` in process (what ``ov-kvcrush chat``
does): the server's second answer must be that answer, continued from as many cached prompt
tokens. Under pool pressure kept caches are released, least recently used first, and no request
is preempted or fails for them; at idle the pool holds only the kept caches.
"""

from __future__ import annotations

import numpy as np
import openai
import pytest

from ov_kvcrush.cli.main import build_parser
from ov_kvcrush.config import GenerationSettings
from ov_kvcrush.engines.openvino_model import SequenceCache
from ov_kvcrush.server.app import make_app
from ov_kvcrush.server.config import ServerConfig
from ov_kvcrush.server.factory import build_backend
from ov_kvcrush.server.thread import ServerThread
from ov_kvcrush.serving.kept import KeptCaches, hold_point, shared_prefix

pytestmark = pytest.mark.model

FILLER = (
    "The archive holds letters from a lighthouse keeper who wrote each evening about the weather, "
    "the ships that passed, the state of the lamp and the birds that rested on the gallery. "
)


def conversation(code: str, repeats: int = 12) -> list[dict[str, str]]:
    text = FILLER * (repeats // 2) + f"The secret code is {code}. " + FILLER * (repeats - repeats // 2)
    return [{"role": "user", "content": text + "\nWhat is the secret code?"}]


@pytest.fixture(scope="module")
def backend(model_dir):
    args = build_parser().parse_args(
        ["serve", "--model", str(model_dir), "--kv-pool-mib", "16",
         "--served-model-name", "smollm2"]
    )  # fmt: skip
    return build_backend(ServerConfig.from_args(args))


@pytest.fixture(scope="module")
def client(backend):
    with ServerThread(make_app(backend)) as s:
        yield openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)


def ask(client, messages, max_tokens: int = 16):
    r = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content, r.usage


def test_the_next_turn_continues_from_the_kept_cache_and_answers_as_the_chat_does(client, backend):
    loop = backend.pipeline
    first = conversation("ALPHA-7")
    a1, u1 = ask(client, first)
    second = [*first, {"role": "assistant", "content": a1}, {"role": "user", "content": "Say it once more."}]
    a2, u2 = ask(client, second)
    ids1, ids2 = loop.encode(first, True), loop.encode(second, True)
    assert u1.prompt_tokens_details.cached_tokens == 0
    # the kept cache holds turn 1's prompt and answer: the next turn continues from all of it
    assert u2.prompt_tokens_details.cached_tokens >= len(ids1) + u1.completion_tokens - 4
    assert u2.prompt_tokens_details.cached_tokens == shared_prefix(ids2, ids2[: u2.prompt_tokens_details.cached_tokens])
    # the oracle: the loop's own turns over one cache, in process
    settings = GenerationSettings(max_new_tokens=16)
    cache = SequenceCache(loop.pool.new_sequence())
    try:
        assert loop.run(ids1, settings, cache=cache).text == a1
        assert loop.run(ids2, settings, cache=cache).text == a2
    finally:
        cache.sequence.free()


def test_the_same_prompt_again_is_a_new_question_not_the_next_turn(client):
    messages = conversation("BRAVO-3")
    _, u1 = ask(client, messages)
    _, u2 = ask(client, messages)
    assert u1.prompt_tokens_details.cached_tokens == u2.prompt_tokens_details.cached_tokens == 0


@pytest.mark.slow
def test_under_pool_pressure_kept_caches_go_first_and_no_request_is_preempted(client, backend):
    loop = backend.pipeline
    preempted, failed = loop.stats["preemptions"], loop.stats["failed"]
    answers = [ask(client, conversation(f"CODE-{i}", repeats=24))[0] for i in range(5)]
    assert all(answers)
    assert loop.kept.reclaimed > 0  # the 16 MiB pool could not keep them all
    assert loop.stats["preemptions"] == preempted and loop.stats["failed"] == failed
    assert loop.pool.stats().blocks_in_use == loop.kept.blocks()  # at idle: only the kept caches


def test_a_full_store_releases_the_least_recently_used_cache(backend):
    pool = backend.pipeline.pool
    kept = KeptCaches(pool, capacity=2, min_shared=1, slack=0)
    caches = []
    for i in range(3):
        c = SequenceCache(pool.new_sequence())
        c.ids = [7, i, 1]
        caches.append(c)
        kept.put(c)
    assert len(kept) == 2
    assert kept.take([7, 0, 1, 5]) is None  # the first, least recently used, is gone
    taken = kept.take([7, 2, 1, 5])
    assert taken is caches[2] and len(kept) == 1
    assert kept.take([7, 2, 1]) is None  # a cache's own ids again: not a next turn
    taken.sequence.free()
    kept.clear()
    assert len(kept) == 0 and np.isfinite(pool.stats().kv_bytes)


@pytest.mark.parametrize("method", ["snapkv", "kvzip"])
def test_a_compressing_method_holds_the_prompt_and_answers_the_next_turn_as_cold(model_dir, method):
    """SnapKV chooses what to keep by the turn's question (issue 73: a kept compressed cache
    answered 0 of 10 later questions, the same histories sent cold 9 of 10). The server keeps
    such a conversation as a held prompt (turn one's prompt before the selection): turn two
    continues from it and selects with its own question in view, answering as its history sent
    cold does (the oracle: the same request without a cache). KVzip is the README's server."""
    args = build_parser().parse_args(["serve", "--model", str(model_dir), "--method", method, "--budget", "128",
                                      "--served-model-name", "smollm2"])  # fmt: skip
    backend = build_backend(ServerConfig.from_args(args))
    loop = backend.pipeline
    try:
        with ServerThread(make_app(backend)) as s:
            client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
            first = [{"role": "user", "content": conversation("DELTA-4")[0]["content"].replace(
                "\nWhat is the secret code?", "\nReply with OK.")}]  # fmt: skip
            a1, u1 = ask(client, first)
            assert len(loop.kept) == 1 and loop.kept.blocks() > 0
            second = [
                *first,
                {"role": "assistant", "content": a1},
                {"role": "user", "content": "What is the secret code?"},
            ]
            a2, u2 = ask(client, second)
            third = [*second, {"role": "assistant", "content": a2}, {"role": "user", "content": "Once more?"}]
            a3, u3 = ask(client, third)  # a short turn: what it holds again is the held start it took
        ids1, ids2 = loop.encode(first, True), loop.encode(second, True)
        # the held prompt: turn one's prompt but its last tokens (whole fast steps of it)
        assert len(ids1) - 128 <= u2.prompt_tokens_details.cached_tokens < len(ids1)
        assert len(ids2) - 128 <= u3.prompt_tokens_details.cached_tokens < len(ids2)
        assert u1.prompt_tokens_details.cached_tokens == 0
        colds = [loop.generate([m], GenerationSettings(max_new_tokens=16))[0] for m in (second, third)]
        assert [a2, a3] == [c.text for c in colds]
        assert colds[0].kv_bytes < colds[0].full_kv_bytes  # the answer came from a compressed cache
    finally:
        backend.close()
        backend.pipeline.engine.close()


def test_a_history_sent_cold_is_cut_where_its_turns_were_held_and_computes_the_kept_cache_bit_for_bit(model_dir):
    """A turn continued from a held prompt feeds its history in chunks that end at the earlier
    turn's held point; at the u8 store a token is read exactly in its own step and through its
    rounding after, so the same history sent cold in other chunks computes other numbers (the
    first held prompts answered 8 of 10 needles as cold). Cut at the same points
    (``turn_cuts``), the cold request computes the kept one's cache bit for bit: the held prompt
    it leaves for the next turn is the same, byte for byte, and so is the answer."""
    from ov_kvcrush.op.snapshot import read_snapshot

    args = build_parser().parse_args(["serve", "--model", str(model_dir), "--method", "snapkv", "--budget", "128",
                                      "--served-model-name", "smollm2"])  # fmt: skip
    backend = build_backend(ServerConfig.from_args(args))
    loop = backend.pipeline
    first = [{"role": "user", "content": conversation("KAPPA-2")[0]["content"].replace(
        "\nWhat is the secret code?", "\nReply with OK.")}]  # fmt: skip
    next_turn = FILLER * 6 + "\nWhat is the secret code?"  # long enough to move the held point

    def held_after(client, messages: list[dict]) -> tuple[str, list[int], dict]:
        """The answer, and the held prompt the request left for the next turn (ids, arrays)."""
        answer, _ = ask(client, messages)
        cache = loop.kept.take(loop.encode(messages, True))
        assert cache is not None and cache.holds_prompt
        try:
            return answer, list(cache.ids), read_snapshot(cache.sequence).arrays()
        finally:
            cache.sequence.free()

    try:
        with ServerThread(make_app(backend)) as s:
            client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
            a1, _ = ask(client, first)
            second = [*first, {"role": "assistant", "content": a1}, {"role": "user", "content": next_turn}]
            ids1, ids2 = loop.encode(first, True), loop.encode(second, True)
            assert loop.turn_prompts(second, True) == [len(ids1)]
            kept = held_after(client, second)  # continued from turn one's held prompt
            assert loop.kept.blocks() == 0
            cold = held_after(client, second)  # the same history, no kept cache
        assert hold_point(loop.pool, len(ids1), 0, loop.first_step) < len(kept[1]) < len(ids2)  # the hold moved on
        assert cold[0] == kept[0] and cold[1] == kept[1]
        assert kept[2].keys() == cold[2].keys()
        for name, array in kept[2].items():
            np.testing.assert_array_equal(cold[2][name], array, err_msg=name)
    finally:
        backend.close()
        backend.pipeline.engine.close()


class WindowPool:
    """A pool's two facts a hold point reads: SnapKV's scoring window of 32 rows, blocks of 32."""

    block_size = 32

    @staticmethod
    def held_prompt_tokens(tokens: int) -> int:
        return max(0, tokens - 32)  # the op's rule for a window of 32 (policy.cpp: held_prompt_tokens)


@pytest.mark.parametrize(
    ("prompt", "held", "want"),
    [
        (1500, 0, 1408),  # inside the first step: whole fast steps, that step stays one
        (3075, 0, 3040),  # past it (2048): whole blocks only, not 2944
        (3150, 3040, 3104),  # a next turn moves it on, to the block its window starts in
        (3080, 3040, 3040),  # too little to move it: its held start again
        (20, 0, 0),  # too short to hold
    ],
)
def test_a_prompt_is_held_up_to_the_block_its_scoring_window_starts_in(prompt, held, want):
    """Brute force: the largest point the rule allows, searched token by token (a point past the
    held start, at most the pool's held tokens, a whole number of fast steps inside the first
    step and of blocks past it; the held start when none is)."""
    cut = WindowPool.held_prompt_tokens(prompt)
    unit = 128 if held == 0 and cut <= 2048 else 32
    brute = max((p for p in range(held + 1, cut + 1) if p % unit == 0), default=held)
    if held == 0 and cut < 128:  # a first step shorter than a fast one is fed whole
        brute = cut
    assert hold_point(WindowPool(), prompt, held, first_step=2048) == brute == want
