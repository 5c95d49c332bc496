"""The front page's promises, as a newcomer meets them: its Python example runs as written and
prints what it says, and the page stays a front page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"

pytestmark = pytest.mark.model


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def section(text: str, heading: str) -> str:
    """The text under ``heading`` up to the next heading of its level."""
    start = text.index(heading + "\n")
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end >= 0 else len(text)]


@pytest.mark.slow
def test_the_python_example_runs_and_prints_the_text_and_the_metrics(capsys):
    """Run as written, as a script's main module (in this interpreter: a fresh one's start and
    imports are test_user_errors' and the demo's)."""
    (example,) = python_blocks(section(README.read_text(), "## From Python"))  # the serve section's needs a server
    exec(compile(example, "README.md (From Python)", "exec"), {"__name__": "__main__"})
    text, metrics = capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)
    assert text.strip()  # the generated answer
    ttft, tpot, kv, full = (float(x) for x in metrics.split())
    assert ttft > 0 and tpot > 0 and kv > 0 and full > 0


def test_the_front_page_stays_short_and_links_what_it_moved():
    text = README.read_text()
    assert len(text.split()) <= 1500
    for page in ("docs/usage.md", "docs/library.md", "docs/engines.md", "docs/results.md", "docs/architecture.md"):
        assert f"]({page})" in text and (README.parent / page).is_file(), page
    picture = re.search(r"!\[[^\]]*\]\(([^)]+)\)", text).group(1)
    assert (README.parent / picture).is_file()
