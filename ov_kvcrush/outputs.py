"""Files the CLI writes: checked, and their folder created, before any work; written atomically.

A run that takes minutes must not end in a traceback because ``--json`` pointed into a missing
folder, under a file or at a directory: :func:`prepare_output` settles the path up front (one
line naming the flag and the problem otherwise). :func:`write_atomic` writes through a temporary
file in the same folder and renames it, so a reader never finds a half-written result.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from ov_kvcrush.errors import UserError, decode_text

#: Picture formats the plots are written in (by the file's suffix).
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def prepare_output(flag: str, path: str | Path | None, suffixes: tuple[str, ...] = ()) -> Path | None:
    """The output file ``path`` of ``flag`` (``None`` passes through), its folder created.

    Refused with one line: a path that is a directory, a parent that is a file, a folder that
    cannot be created or written, a suffix not in ``suffixes`` (when given).
    """
    if path is None:
        return None
    p = Path(path).expanduser()
    if not str(path).strip():
        raise UserError(f"{flag} is empty: allowed a file path")
    if p.is_dir():
        raise UserError(f"{flag} {p} is a directory: allowed a file path")
    if suffixes and p.suffix.lower() not in suffixes:
        raise UserError(f"{flag} {p}: allowed a file ending in {', '.join(suffixes)}")
    for folder in (p.parent, *p.parent.parents):
        if folder.exists():
            if not folder.is_dir():
                raise UserError(f"{flag} {p}: {folder} is a file, not a folder")
            break
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{flag} {p}: cannot create the folder {p.parent} ({exc.strerror})") from None
    if not os.access(p.parent, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {p}: the folder {p.parent} is not writable")
    return p


def write_atomic(path: Path, write: Callable[[Path], None]) -> Path:
    """Call ``write`` on a temporary file beside ``path``, then rename it to ``path``."""
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_text(path: Path, text: str) -> Path:
    """``text`` into ``path``, atomically (UTF-8)."""
    return write_atomic(path, lambda p: p.write_text(text, encoding="utf-8"))


def read_prompt_file(path: str) -> str:
    """The text of ``--prompt-file`` (``-``: standard input), decoded with an error naming the flag."""

    if path == "-":
        data, where = sys.stdin.buffer.read(), "standard input"
    else:
        p = Path(path).expanduser()
        if not p.is_file():
            raise UserError(f"--prompt-file does not exist: {p}")
        data, where = p.read_bytes(), str(p)
    return decode_text(data, f"--prompt-file {where}")
