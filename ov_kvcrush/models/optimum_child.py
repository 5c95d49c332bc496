"""``python -m ov_kvcrush.models.optimum_child ARGS``: ``optimum-cli ARGS``, for the model types we checked
past optimum-intel's transformers cap; ``... --batch JOBS.json``: several exports in one process
(importing optimum takes ~8 s of a tiny model's ~11 s export), each job's outcome written to its
``status`` file.

optimum-intel 2.2 caps its Gemma export configs (Gemma 3's text model included) at transformers
5.0 and refuses 5.5 outright, although its Gemma 2 patcher traces Gemma 3 correctly there: the
exported IR's logits equal transformers' own on a prompt longer than the sliding window
(``tests/test_gemma3.py`` checks it on every run). The cap is lifted for ``gemma3_text``, and
for Gemma, Gemma 2, GLM and EXAONE 4, whose exports give transformers' logits too
(``tests/test_model_families.py``);
every other model type keeps optimum's own check (a config deriving from Gemma 3's without a
cap of its own would inherit the lifted one; none is used here). Runs in a child process, so
nothing here touches the caller's optimum.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

# Imported where used, inside functions: what pulls in optimum, heavy to import, so that importing
# this module stays light.

#: optimum-intel export configs whose transformers cap is lifted, by model type.
UNCAPPED = ("gemma3_text", "gemma2", "glm", "gemma", "exaone4")


def lift_caps() -> None:
    """Drop ``MAX_TRANSFORMERS_VERSION`` from the export configs of :data:`UNCAPPED` model types."""
    from optimum.exporters.tasks import TasksManager

    for model_type in UNCAPPED:
        tasks = TasksManager._SUPPORTED_MODEL_TYPE.get(model_type, {}).get("openvino", {})
        for constructor in tasks.values():
            config_class = getattr(constructor, "func", constructor)
            # a class attribute on the (shared) base: set on this class only
            config_class.MAX_TRANSFORMERS_VERSION = None


def run_batch(jobs_file: Path, optimum_main) -> None:
    """Each job ``{"argv": [...], "status": path}``: run it, then write ``ok`` or the error's tail."""
    for job in json.loads(jobs_file.read_text()):
        sys.argv = ["optimum-cli", *job["argv"]]
        try:
            optimum_main()
            status = "ok"
        except BaseException as exc:  # one family's failure must not stop the others
            if isinstance(exc, KeyboardInterrupt):
                raise
            status = "".join(traceback.format_exception(exc)[-6:])
        Path(job["status"]).write_text(status)


def main(argv: list[str]) -> None:
    import optimum.exporters.openvino  # noqa: F401  (registers the openvino export configs)
    from optimum.commands.optimum_cli import main as optimum_main

    lift_caps()
    if argv[:1] == ["--batch"]:
        run_batch(Path(argv[1]), optimum_main)
        return
    sys.argv = ["optimum-cli", *argv]
    optimum_main()


if __name__ == "__main__":
    main(sys.argv[1:])
