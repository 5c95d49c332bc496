"""Gemma 3 270M, the second embedded model (32k context, sliding-window layers).

* The tokenizer rebuilt from the GGUF encodes exactly as llama.cpp does (a direct port of its
  SentencePiece tokenizer is the oracle here; it was checked against llama-cpp-python 0.3.36
  once, on the same texts and 20k characters of essay), saved and reloaded, and through the
  exported OpenVINO tokenizer; transformers' own conversion does not (the defect repaired).
* The IR exported past optimum-intel's transformers cap gives transformers' logits.
* Our op on the converted IR gives the unmodified IR's logits on a prompt longer than the
  window, whole or in chunks, with the local layers holding only their window as a ring.
* A method runs on the global layers only, in the op as in the torch engine (same greedy tokens).
"""

from __future__ import annotations

import heapq
import json

import numpy as np
import pytest
from helpers import F32, converted_steps, gguf_parsed_once, native_steps, python_with_all_cores

pytestmark = pytest.mark.model

GEMMA = "gemma3-270m"
#: Text with what SentencePiece segmentation gets wrong first: runs of spaces and newlines,
#: tabs, digits, accents, CJK and emoji (byte fallback), HTML tags (user-defined pieces).
TEXTS = [
    "The capital of France is",
    "The pass key is 52445. Remember it!  Naïve café, 3.14 — done.\n\tEnd",
    "  leading spaces and trailing  ",
    "Ünïcödé 日本語 emoji 🤖 and  \n\n\n newlines\t\ttabs",
    "1234567890 12,345.67",
    "<table><tr><td>1</td></tr></table>",
]


def llama_cpp_tokenize(vocab, text: str) -> list[int]:
    """llama.cpp's SentencePiece tokenizer (``llm_tokenizer_spm``), ported as written.

    Control and user-defined pieces are split out of the raw text first (longest first); spaces
    become ``▁``; adjacent symbols merge by a queue of bigrams, highest piece score first (ties:
    leftmost), while the merge is a piece; a symbol that is no piece is re-split along its merge
    history, down to ``<0xNN>`` bytes; ``<bos>`` leads when the GGUF asks for it.
    """
    index = {t: i for i, t in enumerate(vocab.tokens)}
    parts: list[tuple[bool, object]] = [(False, text)]
    for sid in sorted(vocab.special_ids(), key=lambda i: -len(vocab.tokens[i])):
        piece, out = vocab.tokens[sid], []
        for is_id, value in parts:
            if is_id or piece not in value:
                out.append((is_id, value))
                continue
            chunks = str(value).split(piece)
            for k, chunk in enumerate(chunks):
                if chunk:
                    out.append((False, chunk))
                if k < len(chunks) - 1:
                    out.append((True, sid))
        parts = out
    ids = [vocab.bos_id] if vocab.add_bos else []
    for k, (is_id, value) in enumerate(parts):
        if is_id:
            ids.append(int(value))  # type: ignore[arg-type]
            continue
        raw = str(value).replace(" ", "▁")
        ids += _spm_merge(index, vocab.scores, ("▁" if vocab.add_space_prefix and k == 0 else "") + raw)
    return ids


def _spm_merge(index: dict[str, int], scores: list[float], text: str) -> list[int]:
    sym, n = list(text), len(text)
    prev, nxt = list(range(-1, n - 1)), [*range(1, n), -1]
    alive, heap, history = [True] * n, [], {}

    def bigram(left: int, right: int) -> None:
        if left < 0 or right < 0:
            return
        merged = sym[left] + sym[right]
        if merged in index:
            heapq.heappush(heap, (-scores[index[merged]], left, right, len(merged)))
            history[merged] = (sym[left], sym[right])

    for i in range(1, n):
        bigram(i - 1, i)
    while heap:
        _, left, right, size = heapq.heappop(heap)
        if not (alive[left] and alive[right]) or len(sym[left]) + len(sym[right]) != size:
            continue
        sym[left] += sym[right]
        alive[right] = False
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        bigram(prev[left], left)
        bigram(left, nxt[left])
    out: list[int] = []

    def resegment(piece: str) -> None:
        if piece in index:
            out.append(index[piece])
        elif piece in history:
            resegment(history[piece][0])
            resegment(history[piece][1])
        else:
            out.extend(index[f"<0x{b:02X}>"] for b in piece.encode())

    i = 0 if n else -1
    while i >= 0:
        resegment(sym[i])
        i = nxt[i]
    return out


@pytest.fixture(scope="module")
def gguf_vocab():
    from ov_kvcrush.models.embedded import embedded_gguf_path
    from ov_kvcrush.models.gguf_tokenizer import read_gguf_vocab

    return read_gguf_vocab(embedded_gguf_path(GEMMA))


@pytest.fixture(scope="module")
def gemma_hf():
    from ov_kvcrush.models.export import hf_checkpoint

    return hf_checkpoint(GEMMA, progress=False)


@pytest.fixture(scope="module")
def gemma_ir():
    from ov_kvcrush.models.export import export_model

    return export_model(GEMMA, weight_format="fp32", progress=False)


@pytest.fixture(scope="module")
def gemma_tokenizer(gemma_hf):
    """The checkpoint's tokenizer (rebuilt from the GGUF, saved, reloaded): 3.5 s to load its
    262k-token vocabulary, once for the module."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gemma_hf)


@pytest.fixture(scope="module")
def window_prompt(gemma_tokenizer):
    """~700 tokens of essay: longer than the 512-token window."""
    from ov_kvcrush.corpus import essay_text, haystack_essays

    return gemma_tokenizer(essay_text(haystack_essays()[0])).input_ids[:700]


@pytest.fixture(scope="module")
def native_window(gemma_ir, window_prompt):
    """The unmodified IR on the window prompt: its logits after the prompt and 24 greedy steps
    (f32), and those tokens; computed once for the tests that compare with it."""
    return native_steps(gemma_ir / "openvino_model.xml", window_prompt, 24, "f32")


def windows_of(model_dir) -> list[int]:
    cfg = json.loads((model_dir / "config.json").read_text())
    return [cfg["sliding_window"] if t == "sliding_attention" else 0 for t in cfg["layer_types"]]


@pytest.mark.slow
def test_tokenizer_encodes_as_llama_cpp(gguf_vocab, gemma_hf, gemma_tokenizer, gemma_ir):
    import openvino_genai as ov_genai

    saved = gemma_tokenizer  # rebuilt from the GGUF, saved, reloaded
    ov_tok = ov_genai.Tokenizer(str(gemma_ir))  # the exported OpenVINO tokenizer models
    chat = saved.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert chat == "<bos><start_of_turn>user\nBe brief.\n\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"
    for text in [*TEXTS, chat.removeprefix("<bos>")]:
        want = llama_cpp_tokenize(gguf_vocab, text)
        assert saved(text).input_ids == want, text
        got = [int(i) for i in ov_tok.encode(text, add_special_tokens=True).input_ids.data[0]]
        assert got == want, text
        assert saved.decode(want, skip_special_tokens=False).removeprefix("<bos>") == text
    assert saved("The capital of France is").input_ids == [2, 818, 5279, 529, 7001, 563]
    gen = json.loads((gemma_hf / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [1, 106], "generation stops at <eos> and at <end_of_turn>"


@pytest.mark.slow
def test_transformers_own_conversion_is_the_defect_repaired(gguf_vocab):
    """Without the rebuild, transformers segments per syllable: the repair stays justified."""
    from transformers import AutoTokenizer

    from ov_kvcrush.models.embedded import embedded_gguf_path

    path = embedded_gguf_path(GEMMA)
    with gguf_parsed_once():
        theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    some = [2, 818, 5279, 529, 7001, 563, len(gguf_vocab.tokens) - 1]  # the file's tokens came through
    assert theirs.convert_ids_to_tokens(some) == [gguf_vocab.tokens[i] for i in some]
    text = "The capital of France is"
    assert theirs(text).input_ids != llama_cpp_tokenize(gguf_vocab, text)


@pytest.mark.slow
def test_ir_equals_transformers_past_the_window(gemma_hf, window_prompt, native_window):
    """optimum-intel's cap on transformers is lifted for Gemma 3 (optimum_child): its IR must
    still compute what transformers computes, across the sliding window."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gemma_hf, dtype=torch.float32)
    with torch.no_grad():
        want = model(torch.tensor([window_prompt])).logits[0, -1].numpy()
    got = native_window[0][0]  # the logits right after the prompt
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [0, 200])
def test_op_equals_unmodified_ir_past_the_window(gemma_ir, window_prompt, native_window, chunk):
    xml = gemma_ir / "openvino_model.xml"
    windows = windows_of(gemma_ir)
    assert windows.count(512) == 15 and windows.count(0) == 3
    ref, tokens = native_window
    got, conv, pool, seq = converted_steps(xml, window_prompt, tokens[:-1], "f32", windows=windows, chunk=chunk)
    err = np.abs(got - ref).max(axis=1) / np.abs(ref).max()
    assert err.max() < 2e-5, err.max()
    assert [int(np.argmax(x)) for x in got] == tokens
    assert conv.scales[0] == pytest.approx(256**-0.5)  # query_pre_attn_scalar = 256
    held = seq.head_tokens()[:, 0]
    seen = len(window_prompt) + 24
    for layer, w in enumerate(windows):
        if w:  # the ring: the window, plus at most the rest of its oldest block
            assert w - 1 <= held[layer] < w + pool.block_size, (layer, held[layer])
        else:
            assert held[layer] == seen
    seq.free()
    assert pool.stats().blocks_in_use == 0


@pytest.mark.slow
def test_completion_format_lets_the_base_model_answer(gemma_ir, tmp_path):
    """The embedded Gemma is the pretrained model (past 1k tokens, asked in the chat template it
    mostly repeats the instructions): as raw text followed by the answer's first words
    (``--prompt-format completion``) it finds the needle; our op, full cache. In a child given
    every core (``helpers.python_with_all_cores``: the CPU plugin's compile of this model at bf16
    dies in a process of one core on a CPU with AMX)."""
    script = f"""
        import json
        from ov_kvcrush.config import MethodSpec
        from ov_kvcrush.eval.runner import EvalPlan, run_eval

        plan = EvalPlan(
            tasks=("niah_single",), lengths=(1024,), methods=(MethodSpec.parse("full"),), samples=2,
            backend="openvino", model={str(gemma_ir)!r}, prompt_format="completion", max_new_tokens=12,
        )
        report = run_eval(plan, progress=False, log=lambda _: None)
        full = [s["score"] for s in report.samples if s["method"] == "full"]
        print(json.dumps({{"full": full, "format": report.meta["plan"]["prompt_format"]}}))
    """
    done = python_with_all_cores(script)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["full"] == [1.0, 1.0], got
    assert got["format"] == "completion"


@pytest.fixture(scope="module")
def gemma_engines(gemma_hf, gemma_ir):
    """Our op's engine (f32) and the torch engine on Gemma 3, loaded once; each test sets its method."""
    from ov_kvcrush.engines.torch_engine import TorchEngine
    from ov_kvcrush.serving.openvino_engine import OpenVINOEngine

    return OpenVINOEngine(gemma_ir, kv_precision="f32", properties=F32), TorchEngine(gemma_hf)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["snapkv", "kvzip"])
def test_a_method_runs_on_global_layers_as_in_the_torch_engine(gemma_engines, gemma_ir, method):
    """SnapKV selects at the prompt; KVzip scores the context with its reconstruction pass, whose
    steps pass through the sliding layers' windows (the question is asked after compression)."""
    from ov_kvcrush import CompressionConfig, GenerationSettings
    from ov_kvcrush.corpus import essay_text, haystack_essays

    budget = 256
    comp = CompressionConfig(method=method, budget=budget)
    question = "\nQuestion: what is the text about? Answer:"
    prompt = essay_text(haystack_essays()[0])[:3000] + question  # ~650 tokens: past the window
    settings = GenerationSettings(max_new_tokens=16, apply_chat_template=False, ignore_eos=True)
    op, torch_engine = gemma_engines
    op.set_compression(comp)
    torch_engine.set_compression(comp)
    got = op.generate(prompt, settings, question=question)
    want = torch_engine.generate(prompt, settings, question=question)
    assert got.prompt_tokens > 600
    assert got.token_ids == want.token_ids
    held = got.counters["tokens_held_per_layer"]  # the generation's cache as it ended (one KV head)
    windows = windows_of(gemma_ir)
    for layer, w in enumerate(windows):
        if w:  # a ring of the window
            assert held[layer] < w + op.block_size, (layer, held[layer])
    # the global layers: the method's budget (KVzip shares it unevenly), plus question and answer
    assert sum(held[i] for i, w in enumerate(windows) if not w) < 3 * (budget + 32)
