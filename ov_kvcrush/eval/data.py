"""Custom evaluation data: a JSONL file of ``{"prompt": str, "answers": [str, ...]}`` objects.

Each line is one sample; it scores 1 when the generated text contains any answer
(case-insensitive), else 0. Blank lines are skipped; any other bad line stops the run with an
error naming the file, the line number and the problem, before the model is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

from ov_kvcrush.errors import UserError, decode_text
from ov_kvcrush.eval.tasks import Sample

#: Task name custom samples are reported under.
DATA_TASK = "data"


class DataError(UserError):
    """A line of a ``--data`` file is not a valid sample; the message names the line."""


def read_jsonl(path: str | Path) -> list[Sample]:
    """Read custom samples; raises :class:`DataError` at the first invalid line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"--data file not found: {path}")
    samples: list[Sample] = []
    text = decode_text(path.read_bytes(), f"--data file {path}")
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise DataError(f"{where}: expected a JSON object with 'prompt' and 'answers', got {type(obj).__name__}")
        prompt = obj.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise DataError(f"{where}: 'prompt' must be a non-empty string, got {_show(prompt)}")
        answers = obj.get("answers")
        if not isinstance(answers, list) or not answers:
            raise DataError(f"{where}: 'answers' must be a non-empty list of strings, got {_show(answers)}")
        for i, a in enumerate(answers):
            if not isinstance(a, str) or not a.strip():
                raise DataError(f"{where}: 'answers'[{i}] must be a non-empty string, got {_show(a)}")
        question = obj.get("question", "")
        if not isinstance(question, str) or (question and (not prompt.endswith(question) or question == prompt)):
            raise DataError(f"{where}: 'question' must be the text the prompt ends with, got {_show(question)}")
        samples.append(
            Sample(task=DATA_TASK, prompt=prompt, answers=tuple(answers), meta={"line": number}, question=question)
        )
    if not samples:
        raise DataError(f"{path}: no samples (every line is blank)")
    return samples


def _show(value: object) -> str:
    if value is None:
        return "nothing (missing)"
    text = json.dumps(value) if isinstance(value, (str, int, float, bool, list, dict)) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
