"""Which requests a continuous-batching step runs, over one block pool.

Pure bookkeeping: no model, no OpenVINO. The pipeline (:mod:`ov_kvcrush.serving.pipeline`) asks
:meth:`Scheduler.plan` before every step and runs what it returns in one inference: at most one
prompt chunk and the decode token of every sequence past its prompt.

The pool is counted in the op's blocks (``block_size`` tokens of one KV head of one layer); a
sequence growing by one block of tokens takes ``rows = layers × kv_heads`` of them. The rules:

* **Decode first.** Every decoding sequence may open a new block on every head this step, so the
  step needs ``rows`` free blocks per decoding sequence. When the pool has fewer, the latest
  admitted request is preempted (its blocks go back, it waits at the head of the queue and its
  prompt plus the tokens it generated are prefilled again later), until the step fits. A lone
  request whose step does not fit fails: it does not fit the pool even alone (with the full
  cache, only when its last block is full: every head holds every token, so a token that fits
  the last block fits).
* **Admission, first come first served**, while fewer than ``max_num_seqs`` run: the next
  request starts when its whole prompt (every method holds the prompt until its selection at
  the prompt's end) and one decode block per head fit beside the decoding sequences' reserve.
  One request is prefilled at a time, in chunks of at most ``max_num_batched_tokens`` minus the
  decoding sequences (``chunked`` = openvino_genai's ``dynamic_split_fuse``; off: whole prompts).
  A whole prompt's first step is cut to whole tiles (``first_chunk``: the op's fast step) and
  the rest follows.
* **One step for what follows a prompt.** A request may continue a sequence that holds the
  start of its tokens (a chat's next turn), or ask a question after a context the method
  compresses first (``question_at``). The method's prompt, from a sequence's start or after a
  held prompt's earlier chunks, is what comes in chunks and is selected once, at its end (a chunk
  ends where the pipeline copies a held prompt, ``hold_at``, and where the conversation's earlier
  turns held theirs, ``cuts``: a history sent cold feeds the chunks its kept turns fed); a turn
  after a kept cache, or the question, is fed in one step, as one chunk of a longer prompt would be.
* **Refusal** happens when a request is added, never later: a prompt that cannot fit the pool
  alone (or, for the full cache, prompt + new tokens), or one longer than
  ``max_num_batched_tokens`` without chunking.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from ov_kvcrush.errors import UserError

#: openvino_genai.SchedulerConfig's defaults, used when no scheduler config is given
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 256


class Phase(Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


@dataclass(frozen=True)
class SchedulerLimits:
    """What bounds a step: sequences, tokens per step and the pool (``pool_blocks`` 0: unlimited)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    chunked: bool
    pool_blocks: int
    rows: int  # blocks one block of tokens takes: layers × KV heads
    block_size: int
    #: the method keeps every token (the full cache): a request needs its whole length's blocks
    holds_everything: bool = True
    #: the most tokens one step of the method's scoring pass (KVzip) feeds right after a prompt:
    #: room a request needs beside its whole prompt (0: no pass)
    scoring_tokens: int = 0
    #: how much of a whole prompt its first step feeds (the rest follows); ``None``: all of it
    first_chunk: Callable[[int], int] | None = None


@dataclass(eq=False)
class Slot:
    """One request's progress, its one copy: its tokens, how many its sequence holds, its phase.

    The pipeline appends what it generates to ``generated`` and reports what it feeds
    (:meth:`Scheduler.prefilled`, :meth:`Scheduler.decoded`); a preemption starts ``tokens``
    over as the prompt and the tokens generated so far (:meth:`Scheduler._preempt`)."""

    request_id: int
    tokens: list[int]  # to prefill: the prompt, plus the tokens generated before a preemption
    max_new_tokens: int
    #: tokens its sequence holds: of ``tokens``, then one more per decode step (more than 0 at
    #: the start: it continues a sequence holding ``tokens``' start, a chat's earlier turns)
    done: int = 0
    phase: Phase = Phase.WAITING
    preemptions: int = 0
    #: it could not start when its turn came: the pool (or max_num_seqs) was full
    waited: bool = False
    error: str = ""
    generated: list[int] = field(default_factory=list)
    prompt_tokens: int = -1  # the prompt's length (``tokens``' when the slot is made)
    #: the token a question starts at, after a context that is the method's prompt; None: no question
    question_at: int | None = None
    #: tokens its sequence held when it started (``done`` then): what follows them comes in one step
    held_at_start: int = -1
    #: what it held at the start is a held prompt's earlier chunks (unselected): the rest is the
    #: method's prompt, in chunks, as from the start
    held_prompt: bool = False
    #: where a chunk ends so that the pipeline copies the prompt's start there (a held prompt for
    #: the next turn); 0: no copy (any more)
    hold_at: int = 0
    #: where chunks of the method's prompt end too, ascending: the held points of the
    #: conversation's earlier turns (:func:`~ov_kvcrush.serving.kept.turn_cuts`)
    cuts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0:
            self.prompt_tokens = len(self.tokens)
        if self.held_at_start < 0:
            self.held_at_start = self.done

    @property
    def prompt(self) -> list[int]:
        return self.tokens[: self.prompt_tokens]

    @property
    def prompt_end(self) -> int:
        """Where the method's prompt ends: it is selected (and scored by its pass) there."""
        return len(self.tokens) if self.question_at is None else self.question_at

    @property
    def fed(self) -> list[int]:
        """The token ids its sequence holds, in order."""
        return [*self.prompt, *self.generated][: self.done]

    @property
    def next_cut(self) -> int:
        """Where the next chunk must end (a held point ahead: :attr:`cuts`, :attr:`hold_at`); 0: nowhere."""
        return min((c for c in (*self.cuts, self.hold_at) if c > self.done), default=0)

    @property
    def remaining_prompt(self) -> int:
        return len(self.tokens) - self.done


@dataclass
class StepPlan:
    """One step: a prompt chunk (slot, tokens) or none, the decoding slots, and what changed."""

    prefill: tuple[Slot, int] | None = None
    decode: list[Slot] = field(default_factory=list)
    preempted: list[Slot] = field(default_factory=list)
    failed: list[Slot] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return self.prefill is None and not self.decode


class Scheduler:
    """First-come-first-served admission, chunked prefill and preemption over one pool.

    Args:
        limits: the step and pool limits.
        free_blocks: the pool's free blocks now (``None``: unlimited); called after preemptions.
        release: frees a preempted slot's blocks (its sequence is reset).
        reclaim: frees at least the given blocks from what no request holds (kept caches), if it
            can; the blocks freed. Asked before any request is preempted or made to wait.
    """

    def __init__(
        self,
        limits: SchedulerLimits,
        free_blocks: Callable[[], int | None],
        release: Callable[[Slot], None],
        reclaim: Callable[[int], int] | None = None,
    ) -> None:
        self.limits = limits
        self._free_blocks = free_blocks
        self.release = release
        self.reclaim = reclaim
        self.waiting: deque[Slot] = deque()
        self.running: list[Slot] = []  # in admission order

    def free_blocks(self, want: int = 0) -> int | None:
        """The pool's free blocks, after reclaiming kept caches' blocks toward ``want`` free."""
        free = self._free_blocks()
        if free is not None and free < want and self.reclaim is not None and self.reclaim(want - free):
            free = self._free_blocks()
        return free

    # -- requests -------------------------------------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        """Blocks a sequence holding ``tokens`` tokens on every head takes."""
        return self.limits.rows * math.ceil(tokens / self.limits.block_size)

    def check_fits(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Refuse a request the pool (or a step) can never serve, naming the limit."""
        lim = self.limits
        if not lim.chunked and prompt_tokens > lim.max_num_batched_tokens:
            raise UserError(
                f"prompt ({prompt_tokens} tokens) exceeds max_num_batched_tokens={lim.max_num_batched_tokens} "
                "and dynamic_split_fuse is off: raise max_num_batched_tokens or turn dynamic_split_fuse on"
            )
        if not lim.pool_blocks:
            return
        held = prompt_tokens + (max_new_tokens if lim.holds_everything else lim.scoring_tokens)
        need = self.blocks_for(held) + (0 if lim.holds_everything else lim.rows)
        if need > lim.pool_blocks:
            what = (
                "prompt + max_new_tokens"
                if lim.holds_everything
                else "the prompt and a scoring pass step"
                if lim.scoring_tokens
                else "the prompt"
            )
            raise UserError(
                f"request does not fit the KV pool even alone: {what} ({held} tokens) needs {need} blocks, "
                f"the pool holds {lim.pool_blocks} (max_blocks={lim.pool_blocks}: raise num_kv_blocks / cache_size)"
            )

    def add(self, slot: Slot) -> None:
        self.check_fits(slot.remaining_prompt, slot.max_new_tokens)
        self.waiting.append(slot)

    def finish(self, slot: Slot) -> None:
        """The slot is done (finished, failed or cancelled): it leaves the queues."""
        slot.phase = Phase.DONE
        if slot in self.running:
            self.running.remove(slot)
        elif slot in self.waiting:
            self.waiting.remove(slot)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- a step ---------------------------------------------------------------------------------
    def plan(self) -> StepPlan:
        lim = self.limits
        out = StepPlan()
        decoding = [s for s in self.running if s.phase is Phase.DECODE]
        free = self.free_blocks(lim.rows * len(decoding))
        # decode: every decoding sequence's possible new block per head, preempting to make room
        while free is not None:
            decoding = [s for s in self.running if s.phase is Phase.DECODE]
            if lim.rows * len(decoding) <= free:
                break
            victim = self.running[-1]
            if len(self.running) == 1:
                if not self.opens_block(victim):
                    break  # its next token fits its last block
                victim.error = (
                    f"the KV pool ({lim.pool_blocks} blocks) is full: this request's next step needs "
                    f"{lim.rows} more blocks and no other request holds any"
                )
                self.finish(victim)
                out.failed.append(victim)
            else:
                self._preempt(victim)
                out.preempted.append(victim)
            free = self.free_blocks()
        out.decode = [s for s in self.running if s.phase is Phase.DECODE]
        reserve = lim.rows * len(out.decode)
        avail = None if free is None else free - reserve

        # prefill: the request being prefilled, or the next one that fits
        current = next((s for s in self.running if s.phase is Phase.PREFILL), None)
        if current is None and self.waiting and len(self.running) < lim.max_num_seqs:
            nxt = self.waiting[0]
            need = self.blocks_for(nxt.remaining_prompt + lim.scoring_tokens) + lim.rows
            if avail is not None and need > avail:
                free = self.free_blocks(need + reserve)
                avail = None if free is None else free - reserve
            if avail is None or need <= avail:
                self.waiting.popleft()
                nxt.phase = Phase.PREFILL
                self.running.append(nxt)
                current = nxt
            else:
                nxt.waited = True
        elif current is None and self.waiting:
            self.waiting[0].waited = True
        if current is not None:
            chunk = self.next_chunk(current, len(out.decode))
            if avail is not None and self.blocks_for(chunk) > avail:
                free = self.free_blocks(self.blocks_for(chunk) + reserve)
                avail = None if free is None else free - reserve
            if avail is not None:
                bs = lim.block_size
                open_slots = -current.done % bs  # room left in the last block of every head
                chunk = min(chunk, open_slots + (avail // lim.rows) * bs)
            if chunk > 0:
                out.prefill = (current, chunk)
        return out

    def opens_block(self, slot: Slot) -> bool:
        """Whether ``slot``'s next decode token may open a block on some head: always for a method
        (its heads hold different counts), for the full cache when its last block is full."""
        return not self.limits.holds_everything or slot.done % self.limits.block_size == 0

    def next_chunk(self, slot: Slot, decoding: int) -> int:
        """How many of ``slot``'s tokens its next step feeds, before the pool's room: the method's
        prompt from a sequence's start in chunks beside ``decoding`` decode tokens (a whole
        prompt's first step cut to ``first_chunk``); what follows a held start, or the method's
        prompt, in one step."""
        lim = self.limits
        end = slot.prompt_end if slot.done < slot.prompt_end else len(slot.tokens)
        chunk = end - slot.done
        if (slot.held_at_start == 0 or slot.held_prompt) and end == slot.prompt_end:  # the method's prompt
            if lim.chunked:
                chunk = min(chunk, lim.max_num_batched_tokens - decoding)
            cut = slot.next_cut
            if cut:  # a chunk ends where a held prompt is (or was) copied
                chunk = min(chunk, cut - slot.done)
            elif slot.done == 0 and chunk == end and lim.first_chunk is not None:  # the whole prompt's first step
                chunk = lim.first_chunk(chunk)
        return chunk

    def make_room(self, slot: Slot) -> list[Slot]:
        """Preempt the latest admitted other requests until one step of a scoring pass after
        ``slot``'s prompt has room (``scoring_tokens``, and a block per head for its start);
        returns those preempted. ``check_fits`` made sure the slot fits alone."""
        blocks = self.blocks_for(self.limits.scoring_tokens) + self.limits.rows
        out: list[Slot] = []
        while (free := self.free_blocks(blocks)) is not None and free < blocks:
            others = [s for s in self.running if s is not slot]
            if not others:
                break
            self._preempt(others[-1])
            out.append(others[-1])
        return out

    def prefilled(self, slot: Slot, tokens: int) -> None:
        """``tokens`` more of the slot's prompt were fed; past its end the slot decodes."""
        slot.done += tokens
        if slot.done >= len(slot.tokens):
            slot.phase = Phase.DECODE

    def decoded(self, slot: Slot) -> None:
        """A decode step fed the slot's last generated token."""
        slot.done += 1

    def _preempt(self, slot: Slot) -> None:
        """Its blocks go back; it waits at the head of the queue to prefill what it had fed again."""
        self.running.remove(slot)
        self.release(slot)
        slot.tokens = [*slot.prompt, *slot.generated]
        slot.question_at = None  # all of it is the prompt now
        slot.done = slot.held_at_start = 0
        slot.held_prompt = False
        slot.phase = Phase.WAITING
        slot.preemptions += 1
        self.waiting.appendleft(slot)
