"""Questions asked after compression, on the embedded model through our op (issue 25).

A document with a secret number goes in one chat turn ("Reply with OK"); the question comes in
the next. Every other selecting method scores tokens by the queries seen so far, which never
looked for the number; KVzip scores the turn by reconstructing it. The same flow is what
``eval --question-after`` measures, so the engine's question split is checked here too, and the
chat's policy line and default method.
"""

from __future__ import annotations

import argparse
import io

import pytest

from ov_kvcrush.config import CompressionConfig, GenerationSettings
from ov_kvcrush.engines.base import context_prompt, question_split
from ov_kvcrush.errors import UserError
from ov_kvcrush.methods import QuantSettings

pytestmark = pytest.mark.model

SECRET = "48213"
QUESTION = "What is the secret number in the text above? Answer with the number only."


@pytest.fixture(scope="module")
def document():
    from ov_kvcrush.corpus import essay_text, haystack_essays

    text = essay_text(haystack_essays()[2])[:2400]
    cut = text.rfind(". ", 0, 1200) + 2
    return text[:cut] + f"The secret number is {SECRET}. Remember it: {SECRET}. " + text[cut:]


@pytest.fixture(scope="module")
def engine(model_dir):
    from ov_kvcrush.serving.openvino_engine import OpenVINOEngine

    return OpenVINOEngine(model_dir)


def _chat(engine, compression, document):
    engine.set_compression(compression)
    engine.start_chat()
    settings = GenerationSettings(max_new_tokens=16)
    first = engine.generate(document + "\n\nRead the text above. Reply with OK.", settings)
    second = engine.generate(QUESTION, settings)
    st = engine.sequence.stats()
    engine.finish_chat()
    return first, second, st.tokens_held / (engine.shape.layers * engine.shape.kv_heads), st.kv_bytes


@pytest.mark.slow
def test_kvzip_keeps_what_a_later_turn_asks_for(engine, document):
    budget = 160
    full_first, full, _, _ = _chat(engine, CompressionConfig(), document)
    assert full_first.prompt_tokens > 3 * budget
    assert SECRET in full.text  # the model answers it with everything kept
    first, second, held, fp_bytes = _chat(engine, CompressionConfig(method="kvzip", budget=budget), document)
    assert SECRET in second.text, second.text
    # the document's turn is compressed; the question's turn (within slack_tokens) is answered whole
    assert first.counters["scoring_pass_ms"] > 0 and "scoring_pass_ms" not in second.counters
    assert budget < held <= budget + 128
    assert engine.pool.stats().kv_bytes == 0
    # over the 4-bit store, and a pass after every turn (no slack): the second pass keeps the
    # first one's quantized tokens and brings the cache back to its budget; answers wait
    quant = {"quant": QuantSettings(bits=4, residual_tokens=32), "slack_tokens": 0}
    _, second4, held4, bytes4 = _chat(engine, CompressionConfig("kvzip", budget, options=quant), document)
    assert SECRET in second4.text, second4.text
    assert second4.counters["scoring_pass_ms"] > 0
    assert held4 <= budget + 16 and bytes4 < 0.75 * fp_bytes


def test_question_after_equals_the_chat_turns_split(engine, document):
    """``generate(..., question=)`` compresses the context before the question, like a later turn."""
    prompt = document + "\n" + QUESTION
    ids = engine.encode(prompt)
    split = question_split(ids, engine.encode(context_prompt(prompt, "\n" + QUESTION)))
    question_ids = engine.tokenizer.encode(QUESTION, add_special_tokens=False).input_ids.data[0]
    assert len(ids) - split >= len(question_ids)  # the question and the template's tail come after
    engine.set_compression(CompressionConfig(method="kvzip", budget=160))
    res = engine.generate(prompt, GenerationSettings(max_new_tokens=16), question="\n" + QUESTION)
    assert SECRET in res.text and res.counters["scoring_pass_ms"] > 0
    assert res.counters["prefill_tokens"] == len(ids)
    with pytest.raises(UserError, match="does not end with its question"):
        engine.generate(prompt, GenerationSettings(max_new_tokens=2), question="Something else?")


def test_chat_defaults_to_kvzip_with_a_budget_and_says_so(capsys):
    from ov_kvcrush.cli.chat import cache_policy, chat
    from ov_kvcrush.serving.chat import CHAT_METHOD

    class Pipe:
        engine = object()
        backend = "fake"

        def start_chat(self, system=""):
            pass

        def finish_chat(self):
            pass

    args = argparse.Namespace(
        backend="openvino", method=None, budget=256, model=None, system="", max_new_tokens=4,
        kv_precision=None, sample=False, seed=0, quiet=False,
    )  # fmt: skip
    chat(args, stdin=io.StringIO(""), stdout=io.StringIO(), pipe=Pipe())
    err = capsys.readouterr().err
    assert CHAT_METHOD == "kvzip" and "cache: kvzip, budget 256" in err and "query-agnostic" in err
    snap = cache_policy(CompressionConfig(method="snapkv", budget=256))
    assert "may need what it evicted" in snap and "kvzip" in snap
    assert cache_policy(CompressionConfig()).startswith("cache: full")
