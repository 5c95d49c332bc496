"""Export: input validation, cache reuse/rebuild logic, and the tokenizer repair on the real model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import cli, gguf_parsed_once, run_main

from ov_kvcrush.errors import UserError
from ov_kvcrush.models import export

ROUND_TRIP_TEXTS = [
    "Hello world, two  spaces and a tab\there.",
    "Line one\nLine two\n\n  indented line\n",
    "Digits 0123456789 and 3.14159, 1,000,000 and -42",
    "Accents: café, naïve, Ångström, señor, Dvořák, ç à é î ö ü ß",
    " leading space and trailing spaces   ",
]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["export", "--model", "/nonexistent/model"], "does not exist"),
        (
            ["export", "--weight-format", "int3"],
            "--weight-format='int3' is invalid: allowed int8, fp16, fp32",
        ),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(args, needle, capsys):
    code, _, err = run_main(capsys, *args)
    assert code == 2
    assert needle in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_cli_directory_that_is_not_a_causal_lm(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    code, _, err = run_main(capsys, "export", "--model", str(tmp_path))
    assert code == 2 and "not a causal language model" in err
    assert "Traceback" not in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run_main(capsys, "export", "--model", str(empty))
    assert code == 2 and "no config.json" in err


def test_cli_not_a_gguf(tmp_path, capsys):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"NOPE" + b"\0" * 16)
    code, _, err = run_main(capsys, "export", "--model", str(fake))
    assert code == 2 and "bad magic" in err


@pytest.mark.slow
def test_subcommands_are_listed_and_bench_refuses_bad_input(capsys):
    """The listing in a fresh interpreter, the refusals through the entry point's ``main``."""
    proc = cli("--help")
    for name in ("export", "demo", "generate", "chat", "eval", "bench"):
        assert name in proc.stdout
    code, _, err = run_main(capsys, "bench", "--backends", "nope")
    assert code == 2 and "backend" in err and "genai" in err
    code, _, err = run_main(capsys, "bench", "--methods", "bogus")
    assert code == 2 and "method" in err and "bogus" in err
    code, _, err = run_main(capsys, "bench", "--methods", "kvcrush:block_size=-3")
    assert code == 2 and "block_size" in err
    code, _, err = run_main(capsys, "bench", "--backends", "torch", "--device", "cuda:7")
    assert code == 2 and "device" in err and "Traceback" not in err


def test_export_reuses_complete_and_rebuilds_partial(tmp_path, monkeypatch):
    """Cache logic with the heavy steps replaced: a complete export is reused untouched, a partial
    or corrupt one (missing marker, truncated file) is rebuilt; the GGUF → HF conversion is cached
    separately and done once."""
    calls = []
    monkeypatch.setenv("OV_KVCRUSH_CACHE", str(tmp_path / "cache"))

    def fake_hf(gguf, out):
        calls.append("hf")
        Path(out).mkdir(parents=True)
        (Path(out) / "config.json").write_text("{}")

    def fake_optimum(hf_dir, out, weight_format):
        calls.append("optimum")
        assert (hf_dir / "config.json").is_file()
        out.mkdir(parents=True)
        for name in export.IR_FILES:
            (out / name).write_text(f"{name} {weight_format}")

    monkeypatch.setattr(export, "gguf_to_hf", fake_hf)
    monkeypatch.setattr(export, "_run_optimum", fake_optimum)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 32)
    out = tmp_path / "ir"
    assert export.export_model(gguf, output=out, progress=False) == out
    assert export.is_complete(out) and calls == ["hf", "optimum"]
    export.export_model(gguf, output=out, progress=False)
    assert calls == ["hf", "optimum"], "a complete export must be reused"
    (out / "openvino_model.bin").write_text("trunc")  # corrupt: size differs from the marker
    assert not export.is_complete(out)
    export.export_model(gguf, output=out, progress=False)
    assert calls == ["hf", "optimum", "optimum"] and export.is_complete(out), "the HF checkpoint is cached"
    (out / export.EXPORT_MARKER).unlink()  # partial: no marker
    export.export_model(gguf, output=out, progress=False)
    assert len(calls) == 4 and export.is_complete(out)
    hf = export.hf_checkpoint(gguf, progress=False)
    (hf / "config.json").write_text("{} ")  # a corrupt checkpoint is rebuilt, never trusted
    assert export.hf_checkpoint(gguf, progress=False) == hf and calls[-1] == "hf"
    assert not list(tmp_path.glob(".tmp-export-*")), "temporary export dirs must be cleaned up"
    assert not list((tmp_path / "cache" / "models").glob(".tmp-*")), "temporary HF dirs must be cleaned up"


def test_default_output_is_in_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("OV_KVCRUSH_CACHE", str(tmp_path))
    src = export.resolve_source(None)
    assert src.kind == "gguf" and src.path.name == export.EMBEDDED_MODEL_FILE
    out = export.default_output_dir(src, "int8")
    assert out.parent == tmp_path / "models" and "int8" in out.name


def test_resolve_source_rejects_missing():
    with pytest.raises(UserError, match="does not exist"):
        export.resolve_source("/no/such/dir")


@pytest.mark.model
def test_exported_model_is_complete(model_dir):
    assert export.is_complete(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["eos_token_id"] == 2


@pytest.fixture(scope="module")
def gguf_tokenizer():
    """The oracle: the tokenizer transformers builds in memory from the GGUF (encodes correctly,
    but prepends <|im_start|> and breaks after save/reload)."""
    from transformers import AutoTokenizer

    path = export.embedded_gguf_path()
    with gguf_parsed_once():
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_repaired_tokenizer_round_trip(model_dir, gguf_tokenizer, text):
    import openvino_genai as ov_genai
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(model_dir)  # the repaired tokenizer, reloaded from disk
    ids = saved(text, add_special_tokens=True).input_ids
    oracle = gguf_tokenizer(text, add_special_tokens=False).input_ids
    assert ids == oracle, "reloaded tokenizer must encode like the GGUF vocabulary/merges"
    assert saved.decode(ids) == text
    assert saved.unk_token_id not in ids and max(ids) < 49152
    assert (saved.bos_token, saved.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert len(saved) == 49152, "no added tokens past the vocabulary"
    ov_tok = ov_genai.Tokenizer(str(model_dir))  # what the exported OpenVINO tokenizer models do
    ov_ids = [int(i) for i in ov_tok.encode(text, add_special_tokens=False).input_ids.data[0]]
    assert ov_ids == ids
    assert ov_tok.decode(ov_ids) == text


@pytest.mark.slow
@pytest.mark.model
def test_broken_tokenizer_is_what_we_repair(gguf_tokenizer, tmp_path):
    """The defect itself, so the repair stays justified: without it, spaces become <|endoftext|>."""
    from transformers import AutoTokenizer

    gguf_tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    ids = reloaded("a b c", add_special_tokens=False).input_ids
    assert reloaded.decode(ids) != "a b c"


@pytest.mark.model
def test_a_tokenizer_that_does_not_reload_faithfully_is_refused(gguf_tokenizer, tmp_path):
    """The guard behind every GGUF conversion: the unrepaired tokenizer is refused, the repaired passes."""
    gguf_tokenizer.save_pretrained(tmp_path / "broken")
    with pytest.raises(UserError, match="does not reload faithfully"):
        export.check_saved_tokenizer(gguf_tokenizer, tmp_path / "broken", "m.gguf")
    fixed = export.repair_tokenizer(gguf_tokenizer, 49152)
    fixed.save_pretrained(tmp_path / "fixed")
    export.check_saved_tokenizer(fixed, tmp_path / "fixed", "m.gguf")


def test_the_cache_keeps_the_newest_export_of_each_model_and_format(tmp_path, monkeypatch, capsys):
    """An export replaces the cache's older ones of what it exports in its format: a GGUF's of the
    same file name (another copy, an older content or recipe), a directory's of the same
    directory; never another format's, another model's that shares a name, or a folder the cache
    did not name. ``ov-kvcrush export --list`` and ``--clear`` show and empty the cache."""
    import json

    from ov_kvcrush.cli.main import main as cli

    monkeypatch.setenv("OV_KVCRUSH_CACHE", str(tmp_path))
    root = tmp_path / "models"
    made = {
        "smollm2-int8-aaaaaaaaaaaa": ("gguf", "/old/site-packages/smollm2.gguf"),
        "smollm2-int8-bbbbbbbbbbbb": ("gguf", "/new/site-packages/smollm2.gguf"),
        "smollm2-fp32-cccccccccccc": ("gguf", "/new/site-packages/smollm2.gguf"),
        "smollm2-hf-dddddddddddd": (None, "/new/site-packages/smollm2.gguf"),
        "gemma3-int8-eeeeeeeeeeee": ("gguf", "/new/site-packages/gemma3.gguf"),
        "model-int8-ffffffffffff": ("hf", "/a/model"),
        "model-int8-999999999999": ("hf", "/b/model"),
        "my-export": ("hf", "/c/mine"),
    }
    for name, (kind, source) in made.items():
        (root / name).mkdir(parents=True)
        (root / name / "openvino_model.bin").write_bytes(b"x" * 1024)
        marker = export.CHECKPOINT_MARKER if kind is None else export.EXPORT_MARKER
        (root / name / marker).write_text(json.dumps({"source": source, **({"kind": kind} if kind else {})}))
    assert export.prune_older(root / "smollm2-int8-bbbbbbbbbbbb") == [root / "smollm2-int8-aaaaaaaaaaaa"]
    assert export.prune_older(root / "model-int8-999999999999") == []  # another directory named alike
    assert export.prune_older(tmp_path / "elsewhere-int8-bbbbbbbbbbbb") == []  # outside the cache
    kept = sorted(set(made) - {"smollm2-int8-aaaaaaaaaaaa"})
    assert sorted(p.name for p in root.iterdir()) == kept
    assert cli(["export", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(str(root / n) in listed for n in kept) and f"in {len(kept)} cached models" in listed
    assert cli(["export", "--clear"]) == 0
    assert "removed 0.0 MiB" in capsys.readouterr().out and list(root.iterdir()) == []


def test_every_copy_of_a_gguf_shares_one_export(tmp_path):
    """A GGUF's cached export is keyed by its content, not where it lies (two checkouts' copies of
    the embedded model share one export); a directory's by its path."""
    a, b = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for p in (a, b):
        p.parent.mkdir()
        p.write_bytes(b"GGUF" + bytes(range(256)) * 9000)
    assert export.default_output_dir(export.ModelSource(a, "gguf"), "int8") == export.default_output_dir(
        export.ModelSource(b, "gguf"), "int8"
    )
    b.write_bytes(b"GGUF" + bytes(range(255, -1, -1)) * 9000)
    assert export.default_output_dir(export.ModelSource(a, "gguf"), "int8") != export.default_output_dir(
        export.ModelSource(b, "gguf"), "int8"
    )
