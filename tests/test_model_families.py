"""Every decoder family of the coverage table, checked end to end (``ov_kvcrush/tools/model_coverage.py``).

Each family's tiny checkpoint is exported as users export it; our op's logits must equal the
unmodified IR's and native ``openvino_genai``'s tokens, every op method's tokens the torch
engine's, and a family we refuse is refused by both engines before any work. The committed
results and both tables (README, ``docs/models.md``) are held to what the checks find now.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
from helpers import run_main

from ov_kvcrush.engines.model_family import layer_windows, sliding_context
from ov_kvcrush.errors import UserError
from ov_kvcrush.models.families import FAMILIES, FAMILY_NAMES, MISTRAL_WINDOW
from ov_kvcrush.tools import model_coverage as coverage
from ov_kvcrush.tools import model_coverage_table as coverage_table

pytestmark = pytest.mark.model

COMMITTED = {r["family"]: r for r in json.loads(coverage_table.RESULTS.read_text())["families"]}
#: the families the quick suite (``make test-fast``) checks; the slow run checks them all
QUICK = ("llama3", "mistral", "gemma2")


@pytest.fixture(scope="session")
def exports():
    """Family -> (checkpoint, IR): built and exported once per machine (``make setup`` does it)."""
    return coverage_table.exports()


def _marks(name: str) -> list:
    return [] if name in QUICK else [pytest.mark.slow]


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n)) for n in FAMILY_NAMES])
def test_the_family_gives_its_committed_coverage(exports, name):
    hf, ir = exports[name]
    report = coverage.check(name, ir, hf)
    want = COMMITTED[name]
    assert report.refused == want["refused"]
    assert report.export == want["export"]
    assert coverage_table.status(report.to_json()) == coverage_table.status(want)
    assert report.methods == want["methods"]
    if report.runs:  # the thresholds, and transformers' logits through the export
        assert report.ir_vs_transformers < 1e-4
        assert report.full_f32 <= coverage.TOLERANCE["f32"] and report.full_u8 <= coverage.TOLERANCE["u8"]
        assert report.prompt_u8_vs_f32 == 0.0  # the prompt attends its own tokens exactly: the f32 first token
        assert report.genai_tokens


def test_at_least_ten_families_run_and_every_other_is_refused():
    statuses = [coverage_table.status(r) for r in COMMITTED.values()]
    assert statuses.count("runs") >= 10
    assert set(statuses) <= {"runs", "refused"}
    assert set(COMMITTED) == set(FAMILY_NAMES)


@pytest.mark.parametrize("name", [f.name for f in FAMILIES if f.refused])
def test_a_refused_family_is_refused_by_both_engines_before_any_work(exports, name):
    from ov_kvcrush.engines.torch_engine import TorchEngine
    from ov_kvcrush.serving.openvino_engine import OpenVINOEngine

    hf, ir = exports[name]
    reason = re.escape(COMMITTED[name]["refused"][:40])
    if not isinstance(ir, str):  # exported (where optimum cannot, there is no IR to refuse)
        with pytest.raises(UserError, match=f"model type .* refused: {reason}"):
            OpenVINOEngine(ir)
    with pytest.raises(UserError, match=f"model type .* refused: {reason}"):
        TorchEngine(hf)


def test_an_unverified_model_type_is_refused_naming_the_verified_ones(exports, tmp_path):
    from ov_kvcrush.engines.torch_engine import TorchEngine
    from ov_kvcrush.serving.openvino_engine import OpenVINOEngine

    hf, ir = exports["llama3"]
    for src, dst in ((ir, tmp_path / "ir"), (hf, tmp_path / "hf")):
        shutil.copytree(src, dst)
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, "model_type": "mpt"}))
    with pytest.raises(UserError, match=r"model type 'mpt' has not been verified .*verified: llama, qwen2"):
        OpenVINOEngine(tmp_path / "ir")
    with pytest.raises(UserError, match=r"model type 'mpt' has not been verified"):
        TorchEngine(tmp_path / "hf")


def test_a_window_on_every_layer_caps_every_engines_context(exports):
    """Mistral's window on every layer: within it, the method runs on every layer (exact, the
    family's check above); past it, every engine refuses the request before any work."""
    from ov_kvcrush.config import GenerationSettings
    from ov_kvcrush.engines.genai import GenAIEngine
    from ov_kvcrush.engines.torch_engine import TorchEngine
    from ov_kvcrush.serving.openvino_engine import OpenVINOEngine

    hf, ir = exports["mistral"]
    long_prompt = "word " * (MISTRAL_WINDOW + 50)
    for engine in (OpenVINOEngine(ir), TorchEngine(hf), GenAIEngine(ir)):
        assert engine.max_context == MISTRAL_WINDOW
        with pytest.raises(UserError, match=f"exceeds the model's context of {MISTRAL_WINDOW} tokens"):
            engine.generate(long_prompt, GenerationSettings(max_new_tokens=4))


def test_sliding_windows_are_read_as_transformers_applies_them():
    layers = {"num_hidden_layers": 4, "sliding_window": 64}
    assert layer_windows({"model_type": "mistral", **layers}) == [64] * 4
    assert sliding_context({"model_type": "mistral", **layers}) == 64
    assert layer_windows({"model_type": "qwen2", "use_sliding_window": False, **layers}) == [0] * 4
    kinds = ["sliding_attention", "full_attention"] * 2
    assert layer_windows({"model_type": "gemma3_text", "layer_types": kinds, **layers}) == [64, 0, 64, 0]
    assert sliding_context({"model_type": "gemma3_text", "layer_types": kinds, **layers}) == 0
    assert layer_windows({"model_type": "llama", "num_hidden_layers": 2}) == [0, 0]


def test_the_tables_are_generated_from_the_committed_results():
    results = json.loads(coverage_table.RESULTS.read_text())
    for page, form in coverage_table.PAGES.items():
        text = page.read_text()
        assert coverage_table.with_table(text, coverage_table.table(results, form)) == text, page


def test_ov_kvcrush_export_takes_a_family_checkpoint_and_says_if_it_is_refused(exports, capsys):
    for name in ("qwen3", "gemma2"):
        hf, ir = exports[name]
        code, out, err = run_main(capsys, "export", "--model", str(hf), "--weight-format", "fp32")
        assert code == 0, err[-2000:]
        assert out.strip().splitlines()[-1] == str(ir)
        refused = "note: backends openvino and torch will refuse it: " in err
        assert refused == (name == "gemma2"), err[-500:]


def test_the_pass_refuses_attention_sinks_naming_the_layer(exports):
    """gpt-oss's SDPA takes a sixth input, its sinks: converted anyway, its logits would be off
    (0.4 % here) with no error; the pass refuses it, whatever the engines' family check says."""
    from ov_kvcrush.transformations import ConversionError, convert_model

    from ov_kvcrush.op import plugin

    _, ir = exports["gpt_oss"]
    core = plugin.shared_core()
    with pytest.raises(ConversionError, match=r"layer 0: .* takes attention sinks"):
        convert_model(core.read_model(ir / "openvino_model.xml"), plugin.loaded_path())
