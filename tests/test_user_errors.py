"""The README's promise, checked as a user meets it: bad input to any subcommand or to the API gives
one line naming what is wrong (exit code 2 on the CLI, a ``ConfigError``/``UserError`` from the
API), before any work is done, and never a traceback."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import cli, run_main

from ov_kvcrush.config import CompressionConfig
from ov_kvcrush.errors import ConfigError, UserError


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "prompt.txt").write_text("What is the capital of France?")
    (d / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (d / "data.jsonl").write_bytes(b'{"prompt": "caf\xe9", "answers": ["x"]}\n')
    (d / "a_file").write_text("x")
    (d / "a_dir").mkdir()
    return d


def cases(d):
    prompt = str(d / "prompt.txt")
    h2o = ["generate", "--backend", "torch", "--method", "h2o", "--budget", "256"]
    static = ["bench", "--backends", "hf-static-compiled", "--methods", "full", "--lengths", "512"]
    return [
        # (argv, words the one line must contain)
        (["export", "--weight-format", "int3"], "--weight-format"),
        (["demo", "--tokens", "0"], "--tokens=0"),
        (["generate", "--method", "magic", "--prompt-file", prompt], "method='magic'"),
        (["generate", "--prompt-file", str(d / "latin1.txt")], "not UTF-8"),
        (["generate", "--prompt-file", prompt, "--json", str(d / "a_dir")], "is a directory"),
        (["generate", "--prompt-file", prompt, "--json", str(d / "a_file" / "out.json")], "is a file"),
        ([*h2o, "--option", "name=x", "--prompt-file", prompt], "name='x'"),
        ([*h2o, "--option", "needs_budget=false", "--prompt-file", prompt], "needs_budget=False"),
        (["eval", "--methods", "quest+2bit"], "quest+2bit"),
        (["eval", "--data", str(d / "data.jsonl")], "not UTF-8"),
        (["eval", "--json", str(d / "a_dir")], "is a directory"),
        (["chat", "--method", "h2o"], "budget"),
        (["bench", "--lengths", "64", "--dry-run"], "lengths=64"),
        (["bench", "--lengths", "8192", "--dry-run"], "context"),
        (["bench", "--backends", "openvino", "--methods", "kvcrush:block_size=17", "--dry-run"], "block_size=17"),
        (["bench", "--backends", "torch", "--device", "bogus", "--dry-run"], "device='bogus'"),
        (["bench", "--device", "cuda", "--dry-run"], "device='cuda'"),
        (["bench", "--model", str(d / "missing"), "--dry-run"], "does not exist"),
        (["bench", "--plot", str(d / "plot.txt"), "--dry-run"], "--plot"),
        (["bench", "--backends", "torch", "--model", "random:llama-9", "--dry-run"], "llama-3-8b"),
        (["bench", "--backends", "genai,torch", "--model", "random:tiny-llama", "--dry-run"], "backends='genai'"),
        ([*static, "--model", "random:tiny-llama", "--dry-run"], "cuda"),
        (["eval", "--backend", "openvino", "--methods", "quest"], "on backend openvino"),
        (["generate", "--backend", "genai", "--model", "random:tiny-llama", "--prompt-file", prompt], "torch only"),
    ]


def assert_one_line(argv, needle, code: int, stderr: str) -> None:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert code == 2, (argv, code, stderr[-2000:])
    assert len(lines) == 1 and "Traceback" not in stderr, (argv, stderr[-2000:])
    assert needle in lines[0], (argv, lines[0])


def test_every_subcommand_answers_bad_input_with_one_line_and_exit_code_2(files, capsys):
    for argv, needle in cases(files):
        code, _, err = run_main(capsys, *argv)
        assert_one_line(argv, needle, code, err)


#: one case of each kind (refused by the parser, by a dry run's plan, by the engine's checks)
FRESH = ("--weight-format", "lengths=64", "on backend openvino")


@pytest.mark.slow
def test_bad_input_is_one_line_in_a_fresh_interpreter_too(files):
    """As a user meets it: nothing an import prints, and the process's own exit code."""
    runs = [case for case in cases(files) if case[1] in FRESH]
    assert len(runs) == len(FRESH)
    with ThreadPoolExecutor(max_workers=3) as pool:  # each is a fresh interpreter: run them at once
        procs = list(pool.map(lambda case: cli(*case[0], stdin=""), runs))
    for (argv, needle), proc in zip(runs, procs, strict=True):
        assert_one_line(argv, needle, proc.returncode, proc.stderr)


@pytest.mark.slow
@pytest.mark.model
def test_a_damaged_model_is_one_line_naming_it(model_dir, tmp_path, capfd):
    """A GGUF with a good header but cut short, and an IR whose XML is cut short: through the entry
    point's ``main``, with what the native libraries write to the process's own stderr captured too."""
    from ov_kvcrush.models.export import embedded_gguf_path

    gguf = tmp_path / "cut.gguf"
    with open(embedded_gguf_path(), "rb") as src:
        gguf.write_bytes(src.read(2_000_000))
    ir = tmp_path / "ir"
    ir.mkdir()
    for f in model_dir.iterdir():
        if f.is_file():
            (ir / f.name).symlink_to(f)
    (ir / "openvino_model.xml").unlink()
    (ir / "openvino_model.xml").write_bytes((model_dir / "openvino_model.xml").read_bytes()[:5000])
    prompt = tmp_path / "p.txt"
    prompt.write_text("Hi")
    for backend, model in [("torch", gguf), ("genai", ir), ("openvino", ir)]:
        code, _, err = run_main(
            capfd, "generate", "--backend", backend, "--model", str(model), "--prompt-file", str(prompt)
        )
        lines = [ln for ln in err.splitlines() if ln.strip() and "converting" not in ln]
        assert code == 2 and "Traceback" not in err, (backend, err[-2000:])
        assert str(model) in lines[-1] and "complete" in lines[-1], (backend, lines)


def test_output_paths_are_settled_before_the_work(tmp_path):
    from ov_kvcrush.outputs import PLOT_SUFFIXES, prepare_output, write_text

    deep = prepare_output("--json", tmp_path / "new" / "deeper" / "out.json")
    assert deep.parent.is_dir() and not deep.exists()  # the folder is made, the file waits for the result
    write_text(deep, "{}")
    assert deep.read_text() == "{}" and [p.name for p in deep.parent.iterdir()] == ["out.json"]
    (tmp_path / "file").write_text("x")
    for path, needle in [(tmp_path, "is a directory"), (tmp_path / "file" / "o.json", "is a file")]:
        with pytest.raises(UserError, match=needle):
            prepare_output("--json", path)
    with pytest.raises(UserError, match=r"\.png"):
        prepare_output("--plot", tmp_path / "plot.txt", PLOT_SUFFIXES)
    assert prepare_output("--json", None) is None


@pytest.mark.slow
def test_bench_defaults_pass_their_own_dry_run(capsys):
    code, out, err = run_main(capsys, "bench", "--dry-run")
    assert code == 0, err
    assert "8000" in out


def test_unexpected_errors_are_one_line_unless_debug(monkeypatch, capsys):
    from ov_kvcrush.cli import main as cli_module

    def boom(args):
        raise RuntimeError("native layer said:\n  at some.cpp:12\nthe real reason")

    monkeypatch.setattr(cli_module, "cmd_export", boom)
    assert cli_module.main(["export"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "ov-kvcrush export: unexpected error: RuntimeError: the real reason (run with --debug for the traceback)"
    ]
    for argv in (["--debug", "export"], ["export", "--debug"]):
        with pytest.raises(RuntimeError):
            cli_module.main(argv)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"options": {1: 2}}, "options"),
        ({"options": {"name": "x"}}, "name"),
        ({"options": {"needs_budget": False}}, "needs_budget"),
    ],
)
def test_compression_config_names_the_bad_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        CompressionConfig("h2o", 256, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"model": 123}, "model"),
        ({"backend": ["genai"]}, "backend"),
        ({"backend": "openvino", "kv_precision": ["f16"]}, "kv_precision"),
        ({"properties": "x"}, "properties"),
        ({"backend": "torch", "scheduler_config": "x"}, "scheduler_config"),
        ({"backend": "genai", "colour": "red"}, "colour"),
    ],
)
def test_pipeline_constructor_names_the_bad_argument(kwargs, field):
    from ov_kvcrush import LLMPipeline

    with pytest.raises(UserError, match=field):
        LLMPipeline(**kwargs)


@pytest.mark.model
def test_pipeline_generate_names_the_bad_argument(model_dir):
    from ov_kvcrush import LLMPipeline

    pipe = LLMPipeline(model_dir, backend="genai")
    for call, field in [
        (lambda: pipe.generate(None), "inputs"),
        (lambda: pipe.generate(123), "inputs"),
        (lambda: pipe.generate("hi", generation_config="x"), "generation_config"),
        (lambda: pipe.generate("hi", generation_config={"colour": 1}), "generation_config.colour"),
        (lambda: pipe.generate("hi", streamer=5), "streamer"),
        (lambda: pipe.generate("hi", max_new_tokens=65536), "context"),
        (lambda: pipe.generate("word " * 9000, max_new_tokens=4), "context"),
        (lambda: pipe.generate("word " * 8000, max_new_tokens=400), "context"),
    ]:
        with pytest.raises(UserError, match=field):
            call()
    # a mapping of settings works like GenerationSettings
    assert pipe.generate("Say hi.", generation_config={"max_new_tokens": 3}).token_ids


def test_a_config_error_crosses_a_process_boundary_whole():
    """Pickled and back (a worker process's error, as the GPU path's and the bench's workers send
    them): the same type, field, value and message."""
    import pickle

    allowed = "a positive multiple of 32"
    err = pickle.loads(pickle.dumps(ConfigError("budget", 300, allowed)))
    assert type(err) is ConfigError and (err.field, err.value, err.allowed) == ("budget", 300, allowed)
    assert str(err) == "budget=300 is invalid: allowed a positive multiple of 32"
