"""Our GGUF header reader against the gguf library's ``GGUFReader`` (the oracle), on the embedded
SmolLM2 file, and on files that are not GGUF or end early."""

from __future__ import annotations

import struct

import pytest

from ov_kvcrush.engines.base import model_context
from ov_kvcrush.models.embedded import embedded_gguf_path
from ov_kvcrush.models.gguf_metadata import GGUFFormatError, context_length, read_metadata


def test_every_field_is_what_gguf_reader_reads():
    from gguf import GGUFReader

    path = embedded_gguf_path()
    theirs = {k: f.contents() for k, f in GGUFReader(str(path)).fields.items() if not k.startswith("GGUF.")}
    ours = read_metadata(path)
    assert list(ours) == list(theirs)  # the same keys, in file order
    for key, value in theirs.items():
        assert ours[key] == value and type(ours[key]) is type(value), key
    assert len(ours["tokenizer.ggml.tokens"]) == 49152


def test_reading_stops_once_done_says_so():
    path = embedded_gguf_path()
    seen = read_metadata(path, lambda fields: "general.architecture" in fields)
    assert list(seen)[-1] == "general.architecture" and "tokenizer.ggml.tokens" not in seen
    assert context_length(path) == read_metadata(path)["llama.context_length"] == model_context(path) == 8192


def test_a_file_cut_short_or_not_gguf_is_a_format_error(tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(embedded_gguf_path().read_bytes()[:100_000])  # inside the vocabulary
    with pytest.raises(GGUFFormatError, match="ends early"):
        read_metadata(cut)
    assert context_length(cut) == 8192  # the architecture's keys come before the cut
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGML" + bytes(20))
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        read_metadata(other)
    assert model_context(other) == 0
    old = tmp_path / "v1.gguf"
    old.write_bytes(b"GGUF" + struct.pack("<I", 1) + bytes(16))
    with pytest.raises(GGUFFormatError, match="version 1"):
        read_metadata(old)
