"""An interrupted export leaves nothing behind: on SIGTERM the staging folder is removed and the
child (optimum-cli) ends with the parent; after a SIGKILL the child still ends, and the next run
removes the folder the dead one left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ov_kvcrush.models.staging import OWNER_FILE, remove_stale

PARENT = """
import sys
from pathlib import Path
from ov_kvcrush.models.staging import run_child, staging_dir
with staging_dir(Path(sys.argv[1]), ".tmp-export-") as d:
    (d / "work").write_text("half written")
    child = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(120)"
    run_child([sys.executable, "-c", child, sys.argv[2]])
"""


def _wait_for(condition, what: str, timeout: float = 60.0) -> None:
    """Poll ``condition`` (a state change of another process) until it holds."""
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not reaped) counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _start(tmp_path: Path) -> tuple[subprocess.Popen, int]:
    pidfile = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path / "models"), str(pidfile)])
    _wait_for(lambda: pidfile.is_file() and pidfile.read_text().strip(), "the child to start")
    return parent, int(pidfile.read_text())


def test_sigterm_removes_the_staging_folder_and_ends_the_child(tmp_path):
    parent, child = _start(tmp_path)
    assert list((tmp_path / "models").glob(".tmp-export-*"))
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(60) == 128 + signal.SIGTERM
    _wait_for(lambda: not _alive(child), "the child to end")
    assert list((tmp_path / "models").glob(".tmp-export-*")) == []


def test_after_sigkill_the_child_ends_and_the_next_run_removes_the_folder(tmp_path):
    parent, child = _start(tmp_path)
    parent.kill()
    parent.wait(60)
    _wait_for(lambda: not _alive(child), "the child to end with its killed parent")
    left = list((tmp_path / "models").glob(".tmp-export-*"))
    assert len(left) == 1 and (left[0] / "work").is_file()
    live = tmp_path / "models" / ".tmp-export-live"
    live.mkdir()
    (live / OWNER_FILE).write_text(str(os.getpid()))  # a run in progress: kept
    assert remove_stale(tmp_path / "models", ".tmp-export-") == left
    assert not left[0].exists() and live.is_dir()
