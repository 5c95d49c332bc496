"""Model coverage: every decoder family of :mod:`~ov_kvcrush.models.families`, checked end to end.

For each family's tiny checkpoint, exported as users export (``optimum-cli export openvino``):

1. **Refusal first.** A family the compressed cache does not reproduce is refused by both
   engines before any work, with a reason (:func:`~ov_kvcrush.engines.model_family.check_family`).
2. **The export**: the unmodified IR's logits equal transformers' own (eager attention), on a
   prompt longer than every local window.
3. **Full-cache parity**: the op's logits at every step equal the unmodified IR's (OpenVINO's
   own SDPA and state), in f32 and on the u8 store (against OpenVINO's u8 cache), and its greedy
   tokens equal native ``openvino_genai``'s.
4. **Every op method** at a budget that evicts: greedy tokens equal the torch engine's (the
   reference), at f32 exactly; on the u8 store and over MiniKV's 2-bit store (every method but
   the full cache) up to the first step the op decides by less than :data:`NEAR_TIE` (random
   weights give near-tied logits; a quantized value at a bucket edge then flips a token without
   anything being wrong).

:func:`check` returns a :class:`FamilyReport`; ``python -m ov_kvcrush.models.coverage --write``
runs every family and writes ``docs/results/models/coverage.json`` and the table in the README and
``docs/models.md`` (:mod:`~ov_kvcrush.models.coverage_table`); ``tests/test_model_families.py``
runs the same checks and holds the committed results to them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ov_kvcrush.config import CompressionConfig, GenerationSettings
from ov_kvcrush.errors import UserError
from ov_kvcrush.methods import REGISTRY, methods_for
from ov_kvcrush.models.families import family

#: Exact f32 on OpenVINO: no bf16 matmuls, no dynamic quantization of activations.
F32 = {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}
#: prompt length (tokens, about): past every local window, several times the budget
PROMPT_TOKENS = 320
BUDGET = 128
NEW_TOKENS = 8
#: greedy tokens on a quantized store are compared up to the first step the op decides by less
NEAR_TIE = 0.05
#: relative logit error allowed: f32 (exact but for summation order) and the u8 store
TOLERANCE = {"f32": 1e-4, "u8": 3e-2}
#: (name, method, options): every method the op runs, and block-wise KVCrush
VARIANTS: tuple[tuple[str, str, dict], ...] = (
    *((m, m, {}) for m in methods_for("openvino")),
    ("kvcrush:block_size=32", "kvcrush", {"block_size": 32}),
)
#: the stores every method is checked on: the op's f32 and u8 caches, and MiniKV's 2-bit blocks
#: (``quant``, under any method but the full cache; the pool's f32 blocks hold the residual)
STORES = ("f32", "u8", "2-bit")


def store_compression(method: str, options: dict, store: str) -> CompressionConfig | None:
    """The compression of ``method`` on ``store`` (``None``: the op holds no 2-bit store for it:
    the full cache, and Chelsea, whose merges the torch engine re-encodes in the store)."""
    if store != "2-bit":
        return CompressionConfig(method=method, budget=BUDGET, options=options)
    if method == "full" or not REGISTRY[method].op_quant:
        return None
    return CompressionConfig(method=method, budget=BUDGET, options={**options, "quant": {"bits": 2}})


@dataclass
class FamilyReport:
    """What the checks found for one family; ``None``: not reached (refused, or an earlier failure)."""

    family: str
    model_type: str
    refused: str = ""
    export: str = ""
    ir_vs_transformers: float | None = None
    full_f32: float | None = None
    full_u8: float | None = None
    genai_tokens: bool | None = None
    #: variant -> store -> "ok", or what differed
    methods: dict[str, dict[str, str]] = field(default_factory=dict)

    @property
    def runs(self) -> bool:
        """Full-cache parity and every method on every store."""
        full = self.full_f32 is not None and self.full_f32 <= TOLERANCE["f32"]
        u8 = self.full_u8 is not None and self.full_u8 <= TOLERANCE["u8"]
        methods = len(self.methods) == len(VARIANTS) and all(
            v == "ok" for stores in self.methods.values() for v in stores.values()
        )
        return not self.refused and full and u8 and bool(self.genai_tokens) and methods

    def to_json(self) -> dict:
        return asdict(self)


def prompt_text(tokenizer) -> str:
    """About :data:`PROMPT_TOKENS` tokens of essay (a whole number of the tokenizer's tokens)."""
    from ov_kvcrush.eval.corpus import essay_text, haystack_essays

    text = essay_text(haystack_essays()[2])[: PROMPT_TOKENS * 4]
    ids = list(tokenizer(text, add_special_tokens=False).input_ids)
    return tokenizer.decode(ids[:PROMPT_TOKENS])


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def native_logits(xml: Path, prompt: list[int], feed: list[int], kv_precision: str) -> np.ndarray:
    """Logits [len(feed) + 1, vocab] of the unmodified IR (OpenVINO's SDPA and KV state)."""
    from ov_kvcrush.op import plugin

    core = plugin.shared_core()
    req = core.compile_model(core.read_model(xml), "CPU", {**F32, "KV_CACHE_PRECISION": kv_precision})
    req = req.create_infer_request()
    names = {i.get_any_name() for i in req.model_inputs}
    out, past, ids = [], 0, list(prompt)
    for step in range(len(feed) + 1):
        n = len(ids)
        inputs = {
            "input_ids": np.asarray([ids], dtype=np.int64),
            "attention_mask": np.ones((1, past + n), dtype=np.int64),
            "position_ids": np.arange(past, past + n, dtype=np.int64)[None],
            "beam_idx": np.zeros(1, dtype=np.int32),
        }
        req.infer({k: v for k, v in inputs.items() if k in names})
        past += n
        out.append(np.array(req.get_output_tensor(0).data[0, -1], dtype=np.float32))
        if step < len(feed):
            ids = [feed[step]]
    return np.stack(out)


def transformers_logits(hf_dir: Path, prompt: list[int]) -> np.ndarray:
    """The last position's logits of the checkpoint in transformers (eager attention, f32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -1].float().numpy()


def op_steps(engine, prompt: list[int], steps: int, feed: list[int] | None = None) -> tuple[np.ndarray, list[float]]:
    """The op engine's logits over ``prompt`` then ``steps`` greedy tokens (or ``feed``), and the
    margin of each choice (top-1 minus top-2)."""
    engine.cache.reset()
    out = [engine.forward(list(prompt))]
    engine.scoring_pass()  # KVzip's selection (no-op for the other methods)
    for step in range(steps):
        token = feed[step] if feed is not None else int(out[-1].argmax())
        out.append(engine.forward([token]))
    logits = np.stack(out)
    top2 = np.sort(logits, axis=-1)[:, -2:]
    engine.cache.reset()
    return logits, (top2[:, 1] - top2[:, 0]).tolist()


def compare_tokens(got: list[int], margins: list[float], want: list[int], exact: bool) -> str:
    """``ok``, or where the op's greedy tokens leave the reference's (``exact``: every token;
    otherwise up to the first step the op decides by less than :data:`NEAR_TIE`)."""
    n = len(want) if exact else next((i for i, m in enumerate(margins) if m < NEAR_TIE), len(want))
    if got[:n] == want[:n]:
        return "ok"
    first = next(i for i in range(n) if got[i] != want[i])
    return f"token {first} differs: {got[first]} vs the torch engine's {want[first]}"


def check(name: str, ir: Path | str, hf_dir: Path) -> FamilyReport:
    """Run every check on family ``name`` (its checkpoint ``hf_dir``, its export ``ir`` or the
    export's error)."""
    from ov_kvcrush.engines.model_family import check_family

    fam = family(name)
    report = FamilyReport(fam.name, fam.model_type)
    cfg = json.loads((hf_dir / "config.json").read_text())
    try:
        check_family(cfg, hf_dir.name)
    except UserError as exc:
        report.refused = str(exc).split(": ", 1)[1].split(" is refused: ", 1)[-1]
        return report
    if isinstance(ir, str):
        report.export = ir
        return report
    report.export = "ok"
    _full_cache(report, Path(ir), hf_dir)
    _methods(report, Path(ir), hf_dir)
    return report


def _full_cache(report: FamilyReport, ir: Path, hf_dir: Path) -> None:
    from transformers import AutoTokenizer

    from ov_kvcrush.engines.genai import GenAIEngine
    from ov_kvcrush.engines.openvino_engine import OpenVINOEngine

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    prompt = list(tokenizer(prompt_text(tokenizer), add_special_tokens=False).input_ids)
    xml = ir / "openvino_model.xml"
    ref = native_logits(xml, prompt, [], "f32")
    report.ir_vs_transformers = relative_error(ref[-1], transformers_logits(hf_dir, prompt))
    for precision in ("f32", "u8"):
        engine = OpenVINOEngine(ir, kv_precision=precision, properties=F32)
        got, _ = op_steps(engine, prompt, NEW_TOKENS)
        tokens = [int(x.argmax()) for x in got[:-1]]
        native = native_logits(xml, prompt, tokens, precision)
        setattr(report, f"full_{precision}", relative_error(got, native))
        if precision == "f32":
            genai = GenAIEngine(ir, properties=F32)
            text = engine.tokenizer.decode(prompt)
            mine = engine.generate(text, GenerationSettings(max_new_tokens=NEW_TOKENS, ignore_eos=True))
            theirs = genai.generate(text, GenerationSettings(max_new_tokens=NEW_TOKENS, ignore_eos=True))
            report.genai_tokens = mine.token_ids == theirs.token_ids
        engine.close()


def _methods(report: FamilyReport, ir: Path, hf_dir: Path) -> None:
    from ov_kvcrush.engines.openvino_engine import OpenVINOEngine
    from ov_kvcrush.engines.torch_engine import TorchEngine

    torch_engine = TorchEngine(hf_dir)
    text = prompt_text(torch_engine.tokenizer)
    settings = GenerationSettings(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    engines = {p: OpenVINOEngine(ir, kv_precision=p, properties=F32) for p in ("f32", "u8")}
    prompt = engines["f32"].encode(text)  # the chat template, through the exported tokenizer
    if prompt != torch_engine.encode(text):
        raise AssertionError(f"{report.family}: the exported tokenizer encodes the prompt differently")
    for label, method, options in VARIANTS:
        report.methods[label] = {}
        want: dict[str, list[int] | str] = {}
        for store in STORES:
            compression = store_compression(method, options, store)
            if compression is None:
                continue
            quantized = store == "2-bit" or method == "minikv"  # MiniKV's own store is 4-bit by default
            ref = "2-bit" if store == "2-bit" else "f32"  # the torch engine has no u8 store: its f32 tokens
            if ref not in want:
                want[ref] = _torch_tokens(torch_engine, compression, text, settings)
            if isinstance(want[ref], str):
                report.methods[label][store] = want[ref]
                continue
            engine = engines["u8" if store == "u8" else "f32"]
            try:
                engine.set_compression(compression)
                logits, margins = op_steps(engine, prompt, NEW_TOKENS - 1)
            except Exception as exc:
                report.methods[label][store] = f"{type(exc).__name__}: {exc}"
                continue
            got = [int(x.argmax()) for x in logits]
            exact = store == "f32" and not quantized
            report.methods[label][store] = compare_tokens(got, margins, want[ref], exact)
    for engine in engines.values():
        engine.close()


def _torch_tokens(engine, compression: CompressionConfig, text: str, settings: GenerationSettings) -> list[int] | str:
    """The torch engine's greedy tokens, or why the reference itself fails (the row then says so)."""
    try:
        engine.set_compression(compression)
        return list(engine.generate(text, settings).token_ids)
    except Exception as exc:
        return f"torch engine: {type(exc).__name__}: {exc}"
