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
from helpers import python_with_all_cores, run_main

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
    family's check above); past it, every engine refuses the request before any work. The
    engines are made in a child given every core (``helpers.python_with_all_cores``: the CPU
    plugin's compile of this model at bf16 dies in a process of one core on a CPU with AMX)."""
    hf, ir = exports["mistral"]
    script = f"""
        import json
        from ov_kvcrush.config import GenerationSettings
        from ov_kvcrush.engines.genai import GenAIEngine
        from ov_kvcrush.engines.torch_engine import TorchEngine
        from ov_kvcrush.errors import UserError
        from ov_kvcrush.serving.openvino_engine import OpenVINOEngine

        for engine in (OpenVINOEngine({str(ir)!r}), TorchEngine({str(hf)!r}), GenAIEngine({str(ir)!r})):
            try:
                engine.generate("word " * {MISTRAL_WINDOW + 50}, GenerationSettings(max_new_tokens=4))
                print(json.dumps([engine.max_context, None]))
            except UserError as e:
                print(json.dumps([engine.max_context, str(e)]))
    """
    done = python_with_all_cores(script)
    assert done.returncode == 0, done.stderr[-3000:]
    got = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("[")]
    assert len(got) == 3, done.stdout
    for context, error in got:
        assert context == MISTRAL_WINDOW
        assert error and f"exceeds the model's context of {MISTRAL_WINDOW} tokens" in error


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
    for name in ("qwen3", "gpt_oss"):
        hf, ir = exports[name]
        code, out, err = run_main(capsys, "export", "--model", str(hf), "--weight-format", "fp32")
        assert code == 0, err[-2000:]
        assert out.strip().splitlines()[-1] == str(ir)
        refused = "note: backends openvino and torch will refuse it: " in err
        assert refused == (name == "gpt_oss"), err[-500:]


def test_gemma2_soft_capping_is_applied_where_the_export_drops_it(exports, tmp_path):
    """optimum's Gemma 2 IR has no attention soft-capping (its SDPA takes none), so native runs
    the model uncapped; our op caps from config.json. The family's own cap (50) barely touches
    its tiny logits, so here the cap is 0.3: our logits at the prompt and at every decode step
    are transformers' (eager, capped), native's are not, the torch engine's greedy tokens are
    transformers' (device GPU caps too: ``test_gpu_plugin_gemma.py``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ov_kvcrush.config import GenerationSettings
    from ov_kvcrush.engines.torch_engine import TorchEngine
    from ov_kvcrush.serving.openvino_engine import OpenVINOEngine

    hf, ir = exports["gemma2"]
    for src, dst in ((ir, tmp_path / "ir"), (hf, tmp_path / "hf")):
        shutil.copytree(src, dst)
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, "attn_logit_softcapping": 0.3}))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    prompt = list(tokenizer(coverage.prompt_text(tokenizer), add_special_tokens=False).input_ids)
    engine = OpenVINOEngine(tmp_path / "ir", kv_precision="f32", properties=coverage.F32)
    try:
        got, _ = coverage.op_steps(engine, prompt, 6)
    finally:
        engine.close()
    fed = [int(x.argmax()) for x in got[:-1]]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        want = model.eval()(torch.tensor([prompt + fed])).logits[0, len(prompt) - 1 :].numpy()
    native, _ = coverage.native_steps(tmp_path / "ir" / "openvino_model.xml", prompt, 6, "f32", feed=fed)
    ours = coverage.relative_error(got, want)
    assert ours < 1e-4
    assert coverage.relative_error(native, want) > 100 * ours  # native drops the cap
    text = tokenizer.decode(prompt)
    torch_engine = TorchEngine(tmp_path / "hf")
    ids = torch_engine.encode(text)
    mine = torch_engine.generate(text, GenerationSettings(max_new_tokens=6, ignore_eos=True)).token_ids
    with torch.no_grad():
        greedy = model.generate(torch.tensor([ids]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert list(mine) == greedy[0, len(ids) :].tolist()


def test_the_pass_refuses_attention_sinks_naming_the_layer(exports):
    """gpt-oss's SDPA takes a sixth input, its sinks: converted anyway, its logits would be off
    (0.4 % here) with no error; the pass refuses it, whatever the engines' family check says."""
    from ov_kvcrush.transformations import ConversionError, convert_model

    from ov_kvcrush.op import plugin

    _, ir = exports["gpt_oss"]
    core = plugin.shared_core()
    with pytest.raises(ConversionError, match=r"layer 0: .* takes attention sinks"):
        convert_model(core.read_model(ir / "openvino_model.xml"), plugin.loaded_path())
