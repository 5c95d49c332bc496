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
   reference) on the f32 store and over MiniKV's 2-bit store (every method but the full cache and
   Chelsea): the op is fed the reference's tokens and its choice at each step must be the
   reference's, except at a near tie (a step decided by less than :data:`NEAR_TIE` of its largest
   logit, where rounding may pick either token without anything being wrong); at least
   :data:`MIN_COMPARED` of the f32 steps must be compared. On the u8 store,
   which the torch engine does not have, every method must run; how often its tokens agree with
   the f32 reference is reported, not required (:func:`_passes`).

:func:`check` returns a :class:`FamilyReport`; ``python -m ov_kvcrush.tools.model_coverage --write``
runs every family and writes ``docs/results/models/coverage.json`` and the table in the README and
``docs/models.md`` (:mod:`~ov_kvcrush.tools.model_coverage_table`); ``tests/test_model_families.py``
runs the same checks and holds the committed results to them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ov_kvcrush.config import CompressionConfig, GenerationSettings
from ov_kvcrush.corpus import essay_text, haystack_essays
from ov_kvcrush.engines.genai import GenAIEngine
from ov_kvcrush.engines.model_family import refusal
from ov_kvcrush.methods import REGISTRY, methods_for
from ov_kvcrush.methods.runtimes import CPU_OP, refuses_option
from ov_kvcrush.models.families import family
from ov_kvcrush.op import plugin
from ov_kvcrush.serving.openvino_engine import OpenVINOEngine

# Imported where used, inside functions: what pulls in transformers, heavy to import, so that
# importing this module stays light.

#: Exact f32 on OpenVINO: no bf16 matmuls, and no dynamic quantization of activations for int8
#: weights (the plugin picks it per graph, so two graphs would differ by ~2 % in the logits for
#: reasons that have nothing to do with attention).
F32 = {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}
#: prompt length (tokens, about): past every local window, several times the budget
PROMPT_TOKENS = 320
BUDGET = 128
NEW_TOKENS = 8
#: a step is a near tie (not compared) when the op decides it by less than this share of its
#: largest logit: ~100x f32's summation noise; twice the u8 store's largest logit error
#: (9e-3); a 2-bit value at a bucket edge lands in either bucket on 1e-6 differences, as on u8
NEAR_TIE = {"f32": 1e-4, "u8": 2e-2, "2-bit": 2e-2}
#: the share of greedy tokens a store's checks must compare for the family to count as running
MIN_COMPARED = 0.5
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
    if method == "full" or refuses_option(REGISTRY[method], CPU_OP.name, "quant"):
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
    #: our u8 store's prompt logits against our f32 store's (relative): a prompt attends its own
    #: tokens exactly at any store precision, so its first token is the f32 one (issue 72)
    prompt_u8_vs_f32: float | None = None
    #: variant -> store -> "ok", or what differed
    methods: dict[str, dict[str, str]] = field(default_factory=dict)
    #: store -> greedy tokens compared over every variant (each up to its first near tie), of
    #: :data:`NEW_TOKENS` per variant
    compared: dict[str, int] = field(default_factory=dict)

    @property
    def runs(self) -> bool:
        """Full-cache parity and every method on every store."""
        full = self.full_f32 is not None and self.full_f32 <= TOLERANCE["f32"]
        u8 = self.full_u8 is not None and self.full_u8 <= TOLERANCE["u8"]
        methods = len(self.methods) == len(VARIANTS) and all(
            _passes(store, v) for stores in self.methods.values() for store, v in stores.items()
        )
        return not self.refused and full and u8 and bool(self.genai_tokens) and methods and self.compares_enough

    @property
    def compares_enough(self) -> bool:
        """At least :data:`MIN_COMPARED` of the f32 store's greedy tokens were compared (not cut
        short by near ties): a check that compares nothing proves nothing."""
        cells = sum("f32" in stores for stores in self.methods.values())
        return bool(cells) and self.compared.get("f32", 0) >= MIN_COMPARED * cells * NEW_TOKENS

    def to_json(self) -> dict:
        return asdict(self)


def _passes(store: str, verdict: str) -> bool:
    """The f32 and 2-bit stores must give the reference's tokens (the torch engine holds both);
    the u8 store must run: the torch engine has no u8 store, so a selection made over u8 keys may
    rightly differ from its f32 one (how often it agrees is reported; the full cache's u8 logits
    are checked against OpenVINO's own u8 cache)."""
    return verdict == "ok" or (store == "u8" and verdict.startswith("token "))


def prompt_text(tokenizer) -> str:
    """About :data:`PROMPT_TOKENS` tokens of essay (a whole number of the tokenizer's tokens)."""

    text = essay_text(haystack_essays()[2])[: PROMPT_TOKENS * 4]
    ids = list(tokenizer(text, add_special_tokens=False).input_ids)
    return tokenizer.decode(ids[:PROMPT_TOKENS])


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def native_steps(
    xml: Path, prompt: list[int], steps: int, kv_precision: str, feed: list[int] | None = None
) -> tuple[np.ndarray, list[int]]:
    """Logits ``[steps + 1, vocab]`` of the unmodified IR (OpenVINO's SDPA and KV state) over
    ``prompt`` then ``steps`` tokens (its own greedy ones, or ``feed``), and its greedy tokens."""

    core = plugin.shared_core()
    req = core.compile_model(core.read_model(xml), "CPU", {**F32, "KV_CACHE_PRECISION": kv_precision})
    req = req.create_infer_request()
    names = {i.get_any_name() for i in req.model_inputs}
    out, tokens, past, ids = [], [], 0, list(prompt)
    for step in range(steps + 1):
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
        tokens.append(int(np.argmax(out[-1])))
        ids = [feed[step] if feed is not None else tokens[-1]] if step < steps else []
    return np.stack(out), tokens


def transformers_logits(hf_dir: Path, prompt: list[int]) -> np.ndarray:
    """The last position's logits of the checkpoint in transformers (eager attention, f32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -1].float().numpy()


def op_steps(engine, prompt: list[int], steps: int, feed: list[int] | None = None) -> tuple[np.ndarray, list[float]]:
    """The op engine's logits over ``prompt`` then ``steps`` greedy tokens (or ``feed``), and the
    margin of each choice (top-1 minus top-2) as a share of the step's largest logit."""
    engine.cache.reset()
    out = [engine.forward(list(prompt))]
    engine.scoring_pass()  # KVzip's selection (no-op for the other methods)
    for step in range(steps):
        token = feed[step] if feed is not None else int(out[-1].argmax())
        out.append(engine.forward([token]))
    logits = np.stack(out)
    top2 = np.sort(logits, axis=-1)[:, -2:]
    engine.cache.reset()
    return logits, ((top2[:, 1] - top2[:, 0]) / np.abs(logits).max(axis=-1)).tolist()


@dataclass
class TokenCheck:
    """Greedy choices against the reference's tokens: how many steps were compared (all but the
    near ties), and ``ok`` or the first step that chose otherwise."""

    compared: int
    verdict: str


def compare_tokens(got: list[int], margins: list[float], want: list[int], store: str) -> TokenCheck:
    """The op's greedy choice at each step, fed the torch engine's tokens ``want`` (teacher
    forcing: one near tie does not end the comparison), against ``want``, at every step the op
    decides by at least :data:`NEAR_TIE` of ``store`` (at a near tie either token is right)."""
    steps = [i for i in range(len(want)) if margins[i] >= NEAR_TIE[store]]
    wrong = [i for i in steps if got[i] != want[i]]
    if not wrong:
        return TokenCheck(len(steps), "ok")
    first = wrong[0]
    return TokenCheck(len(steps), f"token {first} differs: {got[first]} vs the torch engine's {want[first]}")


def check(name: str, ir: Path | str, hf_dir: Path) -> FamilyReport:
    """Run every check on family ``name`` (its checkpoint ``hf_dir``, its export ``ir`` or the
    export's error)."""

    fam = family(name)
    report = FamilyReport(fam.name, fam.model_type)
    reason = refusal(json.loads((hf_dir / "config.json").read_text()))
    if reason:
        report.refused = fam.refused or reason  # the registry's own words where it refuses the family
        return report
    if isinstance(ir, str):
        report.export = ir
        return report
    report.export = "ok"
    # one compiled model per store, for the full cache and every method
    engines = {p: OpenVINOEngine(ir, kv_precision=p, properties=F32) for p in ("f32", "u8")}
    try:
        _full_cache(report, Path(ir), hf_dir, engines)
        _methods(report, hf_dir, engines)
    finally:
        for engine in engines.values():
            engine.close()
    return report


def _full_cache(report: FamilyReport, ir: Path, hf_dir: Path, engines: dict) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    prompt = list(tokenizer(prompt_text(tokenizer), add_special_tokens=False).input_ids)
    xml = ir / "openvino_model.xml"
    ref, _ = native_steps(xml, prompt, 0, "f32")
    report.ir_vs_transformers = relative_error(ref[-1], transformers_logits(hf_dir, prompt))
    prompt_logits = {}
    for precision, engine in engines.items():
        engine.set_compression(CompressionConfig())
        got, _ = op_steps(engine, prompt, NEW_TOKENS)
        prompt_logits[precision] = got[0]
        tokens = [int(x.argmax()) for x in got[:-1]]
        native, _ = native_steps(xml, prompt, len(tokens), precision, feed=tokens)
        setattr(report, f"full_{precision}", relative_error(got, native))
    report.prompt_u8_vs_f32 = relative_error(prompt_logits["u8"], prompt_logits["f32"])
    genai = GenAIEngine(ir, properties=F32)
    text = engines["f32"].tokenizer.decode(prompt)
    settings = GenerationSettings(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    mine = engines["f32"].generate(text, settings)
    report.genai_tokens = mine.token_ids == genai.generate(text, settings).token_ids


def _methods(report: FamilyReport, hf_dir: Path, engines: dict) -> None:
    from ov_kvcrush.engines.torch_engine import TorchEngine

    torch_engine = TorchEngine(hf_dir)
    text = prompt_text(torch_engine.tokenizer)
    settings = GenerationSettings(max_new_tokens=NEW_TOKENS, ignore_eos=True)
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
                logits, margins = op_steps(engine, prompt, NEW_TOKENS - 1, feed=want[ref][:-1])
            except Exception as exc:
                report.methods[label][store] = f"{type(exc).__name__}: {exc}"
                continue
            got = [int(x.argmax()) for x in logits]
            result = compare_tokens(got, margins, want[ref], "2-bit" if quantized else store)
            report.methods[label][store] = result.verdict
            report.compared[store] = report.compared.get(store, 0) + result.compared


def _torch_tokens(engine, compression: CompressionConfig, text: str, settings: GenerationSettings) -> list[int] | str:
    """The torch engine's greedy tokens, or why the reference itself fails (the row then says so)."""
    try:
        engine.set_compression(compression)
        return list(engine.generate(text, settings).token_ids)
    except Exception as exc:
        return f"torch engine: {type(exc).__name__}: {exc}"
