"""Work that must not outlive an interrupted run: staging folders and child processes.

An export writes into a staging folder beside its result and renames it into place when done.
If the run is stopped (Ctrl-C, SIGTERM from a job runner, a closed terminal), :func:`staging_dir`
still removes the folder and :func:`run_child` ends the child it started (SIGTERM becomes a
``SystemExit`` while staging, so cleanup runs; a child also dies with a parent that was killed
outright). A folder left by a run that was killed before it could clean up (SIGKILL, power loss)
carries its owner's pid, and :func:`remove_stale` deletes it at the next start once that process
is gone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

OWNER_FILE = ".owner-pid"
#: a staging folder without an owner file (killed before writing it) is stale after this long
ORPHAN_AGE_S = 600.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(parent: Path, prefix: str) -> list[Path]:
    """Delete the staging folders ``parent/prefix*`` whose owner process is gone; returns them."""
    removed = []
    if not parent.is_dir():
        return removed
    for folder in parent.glob(f"{prefix}*"):
        if not folder.is_dir():
            continue
        owner = folder / OWNER_FILE
        try:
            stale = not _alive(int(owner.read_text().strip()))
        except (OSError, ValueError):  # no readable owner: stale once it is old enough
            try:
                stale = time.time() - folder.stat().st_mtime > ORPHAN_AGE_S
            except OSError:
                continue
        if stale:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """Within the block, SIGTERM raises ``SystemExit(143)`` (so ``finally`` and cleanup run)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def staging_dir(parent: Path, prefix: str) -> Iterator[Path]:
    """A fresh folder ``parent/prefix*`` owned by this process, removed when the block ends
    (normally, by an exception, Ctrl-C or SIGTERM). Stale ones of earlier runs go first."""
    parent.mkdir(parents=True, exist_ok=True)
    remove_stale(parent, prefix)
    with _sigterm_as_exit(), tempfile.TemporaryDirectory(dir=parent, prefix=prefix) as tmp:
        (Path(tmp) / OWNER_FILE).write_text(str(os.getpid()))
        yield Path(tmp)


def _die_with_parent() -> None:  # runs in the child before exec (Linux: PR_SET_PDEATHSIG)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def run_child(cmd: Sequence[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` (stdout and stderr together, as text); the child ends if this process stops."""
    proc = subprocess.Popen(
        list(cmd), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=_die_with_parent
    )
    try:
        out, _ = proc.communicate()
    except BaseException:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)
