"""``ov-kvcrush demo``: the product on the embedded model, beside the native anchor it must beat.

One passkey question in a ~2k-token prompt, answered by:

* native ``openvino_genai``: the full cache and its KVCrush (the anchor);
* our op inside the exported IR (backend ``openvino``): the full cache, block-wise KVCrush (the
  form that answered every needle question at equal budget, where token-wise and native missed
  some), SnapKV keeping whole 32-token spans over the 4-bit store (the configuration that kept
  the full-precision selection's answers at 0.24x the bytes: docs/quality.md), and ClusterKV;
* with ``--torch``, the torch reference of KVCrush, Chelsea and MiniKV too (the oracle, slower).

Each row: the answer, TTFT, TPOT, and the KV bytes held against the full cache's in the same
backend (native and our op keep u8, torch the model's fp32: compare ratios across backends,
bytes within one). Our rows share one compiled model, a block pool per method.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ov_kvcrush.config import CompressionConfig, GenerationSettings
from ov_kvcrush.eval.tasks import passkey_prompt

# Imported where used, inside functions: what pulls in numpy, platformdirs, heavy to import, so that
# importing this module stays light.

#: the product's rows after the full caches: (backend, method, options)
PRODUCT_RUNS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("genai", "kvcrush", {}),
    ("openvino", "kvcrush", {"block_size": 32}),
    ("openvino", "snapkv", {"block_size": 32, "quant": {"bits": 4}}),
    ("openvino", "clusterkv", {}),
)
#: the torch reference's rows (``--torch``)
REFERENCE_RUNS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("torch", "full", {}),
    ("torch", "kvcrush", {}),
    ("torch", "chelsea", {}),
    ("torch", "minikv", {}),
)
DEMO_TOKENS = 2000
NEW_TOKENS = 24


@dataclass
class DemoRow:
    """One configuration's answer and measurements."""

    label: str
    answer: str
    correct: bool
    ttft_ms: float
    tpot_ms: float
    kv_bytes: int
    full_kv_bytes: int
    extra: dict[str, Any] = field(default_factory=dict)

    def lines(self) -> list[str]:
        ok = "correct" if self.correct else "WRONG"
        ratio = self.kv_bytes / self.full_kv_bytes if self.full_kv_bytes else 0.0
        return [
            f"{self.label:36s} answer: {self.answer.strip()[:60]!r} ({ok})",
            f"{'':36s} TTFT {self.ttft_ms:7.0f} ms  TPOT {self.tpot_ms:6.1f} ms  KV held "
            f"{self.kv_bytes / 2**20:6.2f} MiB of {self.full_kv_bytes / 2**20:.2f} MiB full ({100 * ratio:.0f} %)",
        ]


def runs(budget: int, with_torch: bool) -> list[tuple[str, CompressionConfig]]:
    """The demo's configurations in order: the full caches first, then the compressed ones."""
    out = [("genai", CompressionConfig()), ("openvino", CompressionConfig())]
    for backend, method, options in PRODUCT_RUNS + (REFERENCE_RUNS if with_torch else ()):
        cfg = CompressionConfig() if method == "full" else CompressionConfig(method, budget, options=dict(options))
        out.append((backend, cfg))
    return out


def label(backend: str, cfg: CompressionConfig) -> str:
    name = {"genai": "native", "openvino": "ours (op)", "torch": "torch reference"}[backend]
    opts = "".join(f" {k}={v}" for k, v in sorted(cfg.options.items()))
    tail = "" if cfg.method == "full" else f" @{cfg.budget}"
    return f"{name} {cfg.method}{opts}{tail}"


def run_demo(tokens: int, budget: int, with_torch: bool, say: Callable[[str], None] = print) -> list[DemoRow]:
    """Run every configuration on one passkey prompt of about ``tokens`` tokens; print as it goes."""
    from ov_kvcrush.serving.backends import make_engine, resolve_model

    settings = GenerationSettings(max_new_tokens=NEW_TOKENS)
    plan = runs(budget, with_torch)
    backends = dict.fromkeys(b for b, _ in plan)
    models = {b: resolve_model(b, None) for b in backends}
    (_, first), *others = models.items()
    say(f"model: {first}" + "".join(f" ({b}: {m})" for b, m in others if m != first))
    shared: dict[str, Any] = {}  # one engine a backend, the method switched per row where it can be
    sample = None
    rows = []
    for backend, cfg in plan:
        engine = shared.get(backend)
        if engine is None or not engine.capabilities.switches_compression:  # native: fixed per pipeline
            engine = shared[backend] = make_engine(backend, models[backend], cfg)
        else:
            engine.set_compression(cfg)
        if sample is None:
            sample = passkey_prompt(tokens, lambda t, e=engine: len(e.encode(t)), seed=7)
            say(f"passkey prompt: {len(engine.encode(sample.prompt))} tokens, key {sample.answer}\n")
        r = engine.generate(sample.prompt, settings)
        row = DemoRow(
            label(backend, cfg), r.text, bool(sample.score(r.text)), r.ttft_ms, r.tpot_ms, r.kv_bytes, r.full_kv_bytes
        )
        rows.append(row)
        for line in row.lines():
            say(line)
    say(
        "\nnative and our op hold KV in u8 (their CPU default; native's keys per channel, ours per token), "
        "the torch reference in the model's fp32: "
        "compare ratios across backends, bytes within one."
    )
    return rows
