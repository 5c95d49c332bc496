"""A method's scoring pass (KVzip) on our op, over one sequence: what the engine runs after a
prompt (or a chat turn) and what continuous batching runs after a request's last prompt chunk.

The method says what to feed (:meth:`~ov_kvcrush.methods.MethodConfig.scoring_pass_inputs`:
a repeat request, the chat template's generation prompt, then a chunk of the context); each step
is one inference in the sequence's scoring mode (the CPU op's, or the GPU plugin's sequence: it
attends, scores the chunk's held tokens and drops its own), and the sequence then selects over
every layer. Both callers share this module so that a
request served in a batch is compressed exactly as one served alone.
"""

from __future__ import annotations

from typing import Any

from ov_kvcrush.engines.base import generation_prefix


class ScoringPass:
    """The scoring pass of an engine's method (its tokenizer, template and model inputs)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._prefix: list[int] | None = None

    def encode(self, text: str) -> list[int]:
        """``text`` as ids, without a template."""
        return [int(i) for i in self.engine.tokenizer.encode(text, add_special_tokens=False).input_ids.data[0]]

    @property
    def prefix(self) -> list[int]:
        """What the chat template puts before an answer (made once)."""
        if self._prefix is None:
            tok = self.engine.tokenizer

            def render(messages: list[dict]) -> str:
                return tok.apply_chat_template(messages, add_generation_prompt=True)

            templated = bool(getattr(tok, "chat_template", ""))
            self._prefix = generation_prefix(render if templated else None, self.encode)
        return self._prefix

    def due(self, sequence: Any) -> bool:
        """Whether the method has a pass and ``sequence`` holds more than its budget (the
        sliding-window layers keep their ring and do not count)."""
        method = self.engine.method
        if not method.scoring_pass:
            return False
        layers = [i for i, w in enumerate(self.engine.windows) if not w]
        held = int(sequence.head_tokens()[layers].sum())
        return method.scoring_pass_due(held, len(layers), self.engine.shape.kv_heads)

    def step_bound(self) -> int:
        """The room a pass needs in the pool beside the sequence, per head: what one step feeds at
        most, and what the pool holds beside it for the step (the GPU plugin's view); 0 for a
        method without a pass."""
        method = self.engine.method
        if not method.scoring_pass:
            return 0
        return self.engine.pool.scoring_room(method.scoring_step_bound(self.encode, self.prefix))

    def run(self, request: Any, sequence: Any, context: list[int], first: int) -> None:
        """Score ``context`` (the sequence's tokens from position ``first`` to the last it holds)
        and select. On an inference error the pass ends without a selection (the cache stays as
        it was) and the error propagates."""
        steps = self.engine.method.scoring_pass_inputs(context, self.encode, self.prefix)
        past = first + len(context)
        try:
            for step in steps:
                sequence.score_positions(first + step.lo, first + step.hi)
                self.engine.run_step(request, [step.ids], [sequence], [past])
        except RuntimeError:
            sequence.end_scoring_pass(select=False)
            raise
        sequence.end_scoring_pass()


__all__ = ["ScoringPass"]
