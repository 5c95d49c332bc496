"""Turn the embedded GGUF (or any local HF causal LM) into an OpenVINO IR with tokenizer models.

Pipeline: GGUF → transformers (dequantised weights) → repaired tokenizer → ``optimum-cli export
openvino`` (stateful, SDPA) → IR + ``openvino_tokenizer.xml`` / ``openvino_detokenizer.xml``.

Why the tokenizer repair: transformers 5.x writes the tokenizer of this GGUF as a
``CodeLlamaTokenizer`` whose decoder is SentencePiece-style (``▁`` replace + byte fallback), whose
post-processor prepends ``<|im_start|>`` as BOS, whose EOS is ``<|im_start|>`` and which carries
five added tokens past the vocabulary (``▁<PRE>`` …). Reloaded from disk, every space then encodes
as ``<|endoftext|>``. SmolLM2 is a byte-level BPE (GPT-2 style): the repair keeps the BPE model and
the ByteLevel pre-tokenizer and restores a ByteLevel decoder and post-processor, the real special
tokens (BOS ``<|im_start|>``, EOS/PAD ``<|im_end|>``, UNK ``<|endoftext|>``) and drops the
out-of-vocabulary added tokens.

The result is cached under the user cache dir (XDG) keyed by source and weight format; a
``.complete`` marker with the expected file list is written last, so a partial or corrupt export is
detected and rebuilt.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from ov_kvcrush.errors import UserError
from ov_kvcrush.models.embedded import DEFAULT_MODEL, EMBEDDED_MODELS, embedded_gguf_path, embedded_name
from ov_kvcrush.models.gguf_tokenizer import read_gguf_vocab, spm_tokenizer, turn_end_ids
from ov_kvcrush.models.staging import run_child, staging_dir
from ov_kvcrush.paths import cache_root

# Imported where used, inside functions: what pulls in tokenizers, tqdm, transformers, heavy to
# import, so that importing this module stays light.

EMBEDDED_MODEL_FILE = EMBEDDED_MODELS[DEFAULT_MODEL].file
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
WEIGHT_FORMATS = ("int8", "fp16", "fp32")
DEFAULT_WEIGHT_FORMAT = "int8"
IR_FILES = (
    "openvino_model.xml",
    "openvino_model.bin",
    "openvino_tokenizer.xml",
    "openvino_tokenizer.bin",
    "openvino_detokenizer.xml",
    "openvino_detokenizer.bin",
    "config.json",
)
#: written last into a finished export (its files and sizes): a folder without it is rebuilt
EXPORT_MARKER = ".ov_kvcrush_complete.json"
# Bump when the export recipe changes, so stale caches are rebuilt rather than trusted.
_RECIPE_VERSION = 1


@dataclass(frozen=True)
class ModelSource:
    """A resolved model to export: a GGUF file or a local HF model directory."""

    path: Path
    kind: str  # "gguf" | "hf"

    @property
    def name(self) -> str:
        return self.path.stem if self.kind == "gguf" else self.path.name


def resolve_source(model: str | os.PathLike | None) -> ModelSource:
    """Validate ``--model``: None or an embedded model's name (``gemma3-270m``) means that GGUF;
    otherwise a GGUF file or HF directory.

    Raises :class:`UserError` naming the path and what is wrong with it.
    """
    name = embedded_name(model)
    if name is not None:
        return ModelSource(embedded_gguf_path(name), "gguf")
    assert model is not None
    path = Path(model).expanduser()
    if not path.exists():
        raise UserError(f"model path does not exist: {path} (or name an embedded model: {', '.join(EMBEDDED_MODELS)})")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise UserError(f"model file must be a .gguf file or an HF model directory, got: {path}")
        with path.open("rb") as fh:
            if fh.read(4) != b"GGUF":
                raise UserError(f"not a GGUF file (bad magic): {path}")
        return ModelSource(path.resolve(), "gguf")
    config = path / "config.json"
    if not config.is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return resolve_source(ggufs[0])
        raise UserError(f"not a Hugging Face model directory (no config.json): {path}")
    try:
        cfg = json.loads(config.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"unreadable config.json in {path}: {exc}") from None
    archs = cfg.get("architectures") or []
    if not any(a.endswith("ForCausalLM") or a.endswith("ForConditionalGeneration") for a in archs):
        raise UserError(
            f"not a causal language model: {path} (config.json architectures={archs!r}, "
            "expected a *ForCausalLM architecture)"
        )
    return ModelSource(path.resolve(), "hf")


def source_digest(source: ModelSource) -> str:
    """What a cached export of ``source`` is keyed by, with the recipe's version: a GGUF file by
    its content (its name, size and first and last MiB: every checkout's copy of the embedded
    model shares one export), a directory by its path, size and time."""
    st = source.path.stat()
    if source.kind == "gguf":
        with source.path.open("rb") as fh:
            head = fh.read(1 << 20)
            fh.seek(max(0, st.st_size - (1 << 20)))
            tail = fh.read()
        key = f"{source.path.name}|{st.st_size}|{hashlib.sha256(head + tail).hexdigest()}|{_RECIPE_VERSION}"
    else:
        key = f"{source.path}|{st.st_size}|{int(st.st_mtime)}|{_RECIPE_VERSION}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def default_output_dir(source: ModelSource, weight_format: str) -> Path:
    """Cache location keyed by the source's identity (:func:`source_digest`) and the weight format."""
    return cache_root() / "models" / f"{source.name}-{weight_format}-{source_digest(source)}"


def is_complete(out: Path) -> bool:
    """True when ``out`` holds a finished export: marker present and every listed file non-empty."""
    marker = out / EXPORT_MARKER
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    for name, size in info.get("files", {}).items():
        f = out / name
        if not f.is_file() or f.stat().st_size != size:
            return False
    return set(IR_FILES) <= set(info.get("files", {}))


def repair_tokenizer(hf_tokenizer, vocab_size: int):
    """Return a fast tokenizer with byte-level decoding and the real special tokens.

    ``hf_tokenizer`` is the tokenizer transformers built from the GGUF. Only GPT-2 style byte-level
    BPE tokenizers (ByteLevel pre-tokenizer) are touched; anything else is returned unchanged,
    since its GGUF conversion is not affected by this defect.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        return hf_tokenizer
    spec = json.loads(backend.to_str())
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") != "ByteLevel" or spec.get("model", {}).get("type") != "BPE":
        return hf_tokenizer
    spec["normalizer"] = None
    spec["decoder"] = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": True,
    }
    spec["post_processor"] = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": False,
        "use_regex": True,
    }
    spec["model"]["byte_fallback"] = False
    spec["model"]["fuse_unk"] = False
    spec["added_tokens"] = [t for t in spec.get("added_tokens", []) if t["id"] < vocab_size]
    fixed = Tokenizer.from_str(json.dumps(spec))
    vocab = fixed.get_vocab()

    def special(*candidates: str) -> str | None:
        return next((c for c in candidates if c in vocab), None)

    bos = special("<|im_start|>", "<|begin_of_text|>", "<s>")
    eos = special("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "</s>")
    unk = special("<|endoftext|>", "<unk>")
    return PreTrainedTokenizerFast(
        tokenizer_object=fixed,
        bos_token=bos,
        eos_token=eos,
        pad_token=eos,
        unk_token=unk,
        chat_template=hf_tokenizer.chat_template,
        clean_up_tokenization_spaces=False,
    )


def gguf_to_hf(gguf: Path, out: Path) -> None:
    """Load a GGUF with transformers (dequantised) and save an HF checkpoint + repaired tokenizer.

    A SentencePiece vocabulary (``tokenizer.ggml.model == "llama"``: Gemma 3) is rebuilt from the
    GGUF's own pieces and scores (:mod:`ov_kvcrush.models.gguf_tokenizer`); transformers' conversion of
    it segments per syllable. A byte-level BPE one (SmolLM2) is repaired by :func:`repair_tokenizer`.
    """
    # transformers' own progress bars (de-quantizing, loading, writing shards) and warnings would
    # nest under the export's one bar: kept, and shown only if the conversion fails
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            _gguf_to_hf(gguf, out)
    except BaseException:
        sys.stderr.write(said.getvalue()[-4000:])
        raise


def _gguf_to_hf(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer  # seconds to import

    vocab = read_gguf_vocab(gguf)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if vocab.model == "llama":
        tok = spm_tokenizer(vocab)
        stops = turn_end_ids(vocab)
        model.config.eos_token_id = vocab.eos_id
        model.generation_config.eos_token_id = stops if len(stops) > 1 else vocab.eos_id
        model.generation_config.bos_token_id = vocab.bos_id
        model.generation_config.pad_token_id = vocab.pad_id
    else:
        tok = repair_tokenizer(AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name), model.config.vocab_size)
        if tok.eos_token_id is not None:
            # The GGUF's eos id is the chat turn end; keep config and generation config consistent.
            model.config.eos_token_id = tok.eos_token_id
            model.generation_config.eos_token_id = tok.eos_token_id
            model.generation_config.pad_token_id = tok.pad_token_id
    # Newer transformers (5.17+) mark a model loaded from GGUF as quantized, although its weights
    # are dequantised floats, and then refuse to save it: what is saved is a plain checkpoint.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    model.save_pretrained(out)
    tok.save_pretrained(out)
    check_saved_tokenizer(tok, out, gguf.name)


#: Text whose encoding must survive save/reload (words, digits, punctuation, accents, spaces).
TOKENIZER_PROBE = "The pass key is 52445. Remember it!  Naïve café, 3.14 — done.\n\tEnd"


def check_saved_tokenizer(tokenizer, out: Path, source: str) -> None:
    """Refuse a checkpoint whose saved tokenizer encodes differently from the one in memory.

    transformers' GGUF conversion does not always write a tokenizer that reloads the same (seen:
    a Gemma 3 GGUF's SentencePiece tokenizer reloads as a per-character Unigram), and a model fed
    such ids talks nonsense without any error. Better a clear refusal than a silent one.
    """
    from transformers import AutoTokenizer

    want = tokenizer(TOKENIZER_PROBE, add_special_tokens=False).input_ids
    got = AutoTokenizer.from_pretrained(out)(TOKENIZER_PROBE, add_special_tokens=False).input_ids
    if got != want:
        raise UserError(
            f"the tokenizer converted from {source} does not reload faithfully ({len(want)} tokens in memory, "
            f"{len(got)} after save/reload), so the model would be fed wrong ids; convert the model to a Hugging "
            "Face directory with a working tokenizer and pass that directory as --model"
        )


#: the same for a converted checkpoint
CHECKPOINT_MARKER = ".ov_kvcrush_hf_complete.json"


def _hf_complete(out: Path) -> bool:
    """True when ``out`` holds a finished HF checkpoint written by :func:`hf_checkpoint`."""
    marker = out / CHECKPOINT_MARKER
    if not marker.is_file():
        return False
    try:
        files = json.loads(marker.read_text()).get("files", {})
    except (OSError, json.JSONDecodeError):
        return False
    return bool(files) and all((out / n).is_file() and (out / n).stat().st_size == sz for n, sz in files.items())


def hf_checkpoint(model: str | os.PathLike | None = None, force: bool = False, progress: bool = True) -> Path:
    """The Hugging Face checkpoint of ``model`` (default: the embedded GGUF), for the torch engine.

    A local HF directory is returned as is. A GGUF is converted once (dequantised weights and the
    repaired tokenizer, as for the OpenVINO export) and cached beside the IR exports, keyed like
    them by the file's identity; the same staged write + completion marker guards against a
    half-written checkpoint being trusted.
    """
    source = resolve_source(model)
    if source.kind == "hf":
        return source.path
    out = cache_root() / "models" / f"{source.name}-hf-{source_digest(source)}"
    if not force and _hf_complete(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"converting {source.path.name} to a Hugging Face checkpoint (once) ...", file=sys.stderr)
    with staging_dir(out.parent, ".tmp-hf-") as tmp:
        stage = tmp / "hf"
        gguf_to_hf(source.path, stage)
        files = {p.name: p.stat().st_size for p in stage.iterdir() if p.is_file()}
        (stage / CHECKPOINT_MARKER).write_text(json.dumps({"source": str(source.path), "files": files}, indent=1))
        if out.exists():
            shutil.rmtree(out)
        stage.rename(out)
    prune_older(out)
    return out


def _optimum_args(hf_dir: Path, out: Path, weight_format: str) -> list[str]:
    return [
        "export",
        "openvino",
        "--model",
        str(hf_dir),
        "--task",
        "text-generation-with-past",
        "--weight-format",
        weight_format,
        str(out),
    ]


def _run_optimum(hf_dir: Path, out: Path, weight_format: str) -> None:
    _optimum_child(_optimum_args(hf_dir, out, weight_format))


def _optimum_child(args: list[str]) -> None:
    # optimum-cli, with the transformers cap lifted for the families we checked (see there)
    cmd = [sys.executable, "-m", "ov_kvcrush.models.optimum_child", *args]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = run_child(cmd, env)  # ends with this process (Ctrl-C, SIGTERM)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.strip().splitlines()[-15:])
        raise RuntimeError(f"optimum-cli export failed (exit {proc.returncode}):\n{tail}")


@dataclass(frozen=True)
class _Job:
    """One export in progress: where its staged IR goes and where it lands."""

    source: ModelSource
    hf_dir: Path
    stage: Path
    out: Path


def _output_dir(source: ModelSource, weight_format: str, output: str | os.PathLike | None) -> Path:
    out = Path(output).expanduser() if output is not None else default_output_dir(source, weight_format)
    if out.exists() and not out.is_dir():
        raise UserError(f"--output exists and is not a directory: {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def _finish(job: _Job, weight_format: str) -> Path:
    """Check the staged IR, write its completion marker and rename it into place."""
    missing = [f for f in IR_FILES if not (job.stage / f).is_file()]
    if missing:
        raise RuntimeError(f"export produced no {', '.join(missing)} in {job.stage}")
    files = {p.name: p.stat().st_size for p in job.stage.iterdir() if p.is_file()}
    meta = {
        "source": str(job.source.path),
        "kind": job.source.kind,
        "weight_format": weight_format,
        "recipe": _RECIPE_VERSION,
        "files": files,
    }
    (job.stage / EXPORT_MARKER).write_text(json.dumps(meta, indent=1))
    if job.out.exists():
        shutil.rmtree(job.out)
    job.stage.rename(job.out)
    prune_older(job.out)
    return job.out


def _family(out: Path) -> str | None:
    """``{model}-{format}-`` of a cached export or checkpoint (``{model}-hf-``), or ``None`` for
    a folder the cache did not name."""
    name, dash, digest = out.name.rpartition("-")
    return name + dash if dash and len(digest) == 12 and "-" in name else None


def _source_of(out: Path) -> tuple[str, str] | None:
    """``(kind, source path)`` a cached export or checkpoint records (``None``: no record)."""
    for marker in (EXPORT_MARKER, CHECKPOINT_MARKER):
        try:
            info = json.loads((out / marker).read_text())
        except (OSError, json.JSONDecodeError):
            continue
        source = str(info.get("source", ""))
        return info.get("kind", "gguf" if source.endswith(".gguf") else "hf"), source
    return None


def prune_older(kept: Path) -> list[Path]:
    """Remove the cache's older exports of what ``kept`` exports, in its weight format: the cache
    keeps the newest of each, not one per upgrade. A GGUF's are those of the same file name (its
    content or the recipe changed); a directory's, those of the same directory. Another model
    that shares a name, a folder outside the cache, or a user's ``--output`` is never touched."""
    family, root, source = _family(kept), cache_root() / "models", _source_of(kept)
    if family is None or kept.parent != root or source is None:
        return []
    kind, path = source

    def same(p: Path) -> bool:
        other = _source_of(p)
        if other is None:
            return False
        return Path(other[1]).name == Path(path).name if kind == "gguf" else other[1] == path

    gone = [p for p in root.iterdir() if p.is_dir() and p != kept and _family(p) == family and same(p)]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def cached_models() -> list[tuple[Path, int]]:
    """The cache's exports and converted checkpoints, each with its size in bytes."""
    root = cache_root() / "models"
    if not root.is_dir():
        return []
    return [
        (p, sum(f.stat().st_size for f in p.rglob("*") if f.is_file()))
        for p in sorted(root.iterdir())
        if p.is_dir() and not p.name.startswith(".tmp-")
    ]


def clear_cache() -> int:
    """Remove every cached export and checkpoint; the bytes freed."""
    freed = 0
    for path, size in cached_models():
        shutil.rmtree(path, ignore_errors=True)
        freed += size
    return freed


def export_model(
    model: str | os.PathLike | None = None,
    weight_format: str = DEFAULT_WEIGHT_FORMAT,
    output: str | os.PathLike | None = None,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Export ``model`` (default: the embedded GGUF) to an OpenVINO IR directory and return it.

    Reuses a complete export; rebuilds a partial or corrupt one. The work happens in a temporary
    sibling directory that is renamed into place only when finished, so an interrupted export
    never leaves something that looks complete.
    """
    if weight_format not in WEIGHT_FORMATS:
        raise UserError(f"--weight-format={weight_format!r} is invalid: allowed {', '.join(WEIGHT_FORMATS)}")
    source = resolve_source(model)
    out = _output_dir(source, weight_format, output)
    if not force and is_complete(out):
        return out

    from tqdm import tqdm

    steps = ["load GGUF + repair tokenizer", "optimum-intel export", "verify"]
    if source.kind == "hf":
        steps[0] = "use HF directory"
    bar = tqdm(total=len(steps), desc="export", unit="step", disable=not progress)
    with staging_dir(out.parent, ".tmp-export-") as tmp:
        bar.set_postfix_str(steps[0])
        hf_dir = hf_checkpoint(source.path, progress=False) if source.kind == "gguf" else source.path
        job = _Job(source, hf_dir, tmp / "ir", out)
        bar.update()
        bar.set_postfix_str(steps[1])
        _run_optimum(hf_dir, job.stage, weight_format)
        bar.update()
        bar.set_postfix_str(steps[2])
        _finish(job, weight_format)
        bar.update()
    bar.close()
    return out


def export_models(models: list[Path], weight_format: str = DEFAULT_WEIGHT_FORMAT) -> dict[Path, Path | str]:
    """Export several local HF checkpoints in one optimum process (its import is most of a small
    model's export time), each cached as :func:`export_model` caches it.

    Returns, per checkpoint, its IR directory, or the export's error (one model failing does not
    stop the others).
    """
    if weight_format not in WEIGHT_FORMATS:
        raise UserError(f"weight_format={weight_format!r} is invalid: allowed {', '.join(WEIGHT_FORMATS)}")
    done: dict[Path, Path | str] = {}
    todo = []
    for model in models:
        source = resolve_source(model)
        if source.kind != "hf":
            raise UserError(f"export_models takes Hugging Face directories, got {source.path}")
        out = default_output_dir(source, weight_format)
        if is_complete(out):
            done[model] = out
        else:
            todo.append((model, source, out))
    if not todo:
        return done
    parent = todo[0][2].parent
    with staging_dir(parent, ".tmp-export-") as tmp:
        jobs = [_Job(source, source.path, tmp / f"ir{i}", out) for i, (_, source, out) in enumerate(todo)]
        spec = [
            {"argv": _optimum_args(j.hf_dir, j.stage, weight_format), "status": str(tmp / f"status{i}")}
            for i, j in enumerate(jobs)
        ]
        (tmp / "jobs.json").write_text(json.dumps(spec))
        _optimum_child(["--batch", str(tmp / "jobs.json")])
        for (model, _, _), job, js in zip(todo, jobs, spec, strict=True):
            status = Path(js["status"]).read_text() if Path(js["status"]).is_file() else "not run"
            try:
                done[model] = _finish(job, weight_format) if status == "ok" else status.strip().splitlines()[-1]
            except RuntimeError as exc:
                done[model] = str(exc)
    return done


def ensure_default_model(weight_format: str = DEFAULT_WEIGHT_FORMAT, progress: bool = True) -> Path:
    """The exported embedded model, exporting it on first use."""
    return export_model(None, weight_format=weight_format, progress=progress)
