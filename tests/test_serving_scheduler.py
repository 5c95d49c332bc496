"""The continuous-batching scheduler alone, against a simulated pool (no model).

The simulation holds, per request, the blocks a full cache of its fed tokens takes on every head
(``rows`` blocks per ``block_size`` tokens) and fails the test the moment a step would take more
blocks than the pool has: the oracle for "a step never overruns the pool". Every request must
finish, none may fail when it fits alone, and every block must come back.
"""

from __future__ import annotations

import math
import random

import pytest

from ov_kvcrush.errors import UserError
from ov_kvcrush.serving.scheduler import Phase, Scheduler, SchedulerLimits, Slot

ROWS, BS = 6, 16


class SimulatedPool:
    """Blocks held per request (a full cache of the tokens fed), with a hard limit."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.fed: dict[int, int] = {}
        self.peak = 0

    def held(self) -> int:
        return sum(ROWS * math.ceil(n / BS) for n in self.fed.values())

    def free(self) -> int:
        return self.limit - self.held()

    def feed(self, rid: int, n: int) -> None:
        self.fed[rid] = self.fed.get(rid, 0) + n
        assert self.held() <= self.limit, f"the step overran the pool: {self.held()} > {self.limit} blocks"
        self.peak = max(self.peak, self.held())

    def release(self, slot: Slot) -> None:
        self.fed.pop(slot.request_id, None)


def limits(pool: int, seqs: int = 64, batched: int = 64, chunked: bool = True) -> SchedulerLimits:
    return SchedulerLimits(seqs, batched, chunked, pool, ROWS, BS)


def serve(sched: Scheduler, pool: SimulatedPool, new_tokens: dict[int, int], max_steps: int = 10_000):
    """Run plans to the end; returns (finished ids in order, failed ids, the plans' decode sizes)."""
    generated = dict.fromkeys(new_tokens, 0)
    prompt = {s.request_id: len(s.tokens) for s in sched.waiting}
    finished, failed, batch = [], [], []
    for _ in range(max_steps):
        if not sched.has_work:
            return finished, failed, batch
        plan = sched.plan()
        failed += [s.request_id for s in plan.failed]
        for s in plan.failed:
            pool.release(s)
        for s in plan.preempted:  # recomputed later: prompt + generated tokens
            s.tokens = list(range(prompt[s.request_id] + generated[s.request_id]))
        if plan.prefill:
            slot, n = plan.prefill
            assert n <= sched.limits.max_num_batched_tokens - len(plan.decode)
            pool.feed(slot.request_id, n)
            sched.prefilled(slot, n)
        batch.append(len(plan.decode))
        for slot in plan.decode:
            pool.feed(slot.request_id, 1)
            generated[slot.request_id] += 1
            if generated[slot.request_id] >= new_tokens[slot.request_id]:
                sched.finish(slot)
                pool.release(slot)
                finished.append(slot.request_id)
    raise AssertionError("the scheduler did not finish")


def make(sched: Scheduler, rid: int, prompt: int, new: int) -> Slot:
    slot = Slot(rid, list(range(prompt)), new)
    sched.add(slot)
    return slot


def test_requests_wait_for_the_pool_and_all_finish():
    # a pool for about two requests of 200 + 40 tokens; eight arrive at once
    pool = SimulatedPool(ROWS * 2 * math.ceil(240 / BS) + ROWS)
    sched = Scheduler(limits(pool.limit), pool.free, pool.release)
    slots = [make(sched, i, 200, 40) for i in range(8)]
    finished, failed, batch = serve(sched, pool, {i: 40 for i in range(8)})
    assert failed == []
    assert sorted(finished) == list(range(8))
    assert pool.held() == 0  # every block came back
    assert max(batch) >= 2  # requests did share decode steps
    assert sum(s.waited for s in slots) >= 5  # the pool made most of them wait
    assert finished[:2] == [0, 1]  # first come, first served


def test_decode_growth_preempts_the_latest_request_which_comes_back():
    # two prompts fit, their decode growth does not: the later one is preempted, then recomputed
    pool = SimulatedPool(ROWS * (2 * math.ceil(100 / BS) + 2))
    sched = Scheduler(limits(pool.limit), pool.free, pool.release)
    first, second = make(sched, 0, 100, 60), make(sched, 1, 100, 60)
    finished, failed, _ = serve(sched, pool, {0: 60, 1: 60})
    assert failed == [] and finished == [0, 1]
    assert second.preemptions >= 1 and first.preemptions == 0
    assert pool.held() == 0


def test_prompt_chunks_respect_the_token_budget_and_decode_rows():
    pool = SimulatedPool(10**6)
    sched = Scheduler(limits(pool.limit, batched=32), pool.free, pool.release)
    make(sched, 0, 10, 50)
    sched.plan()  # request 0 prefills
    sched.prefilled(sched.running[0], 10)
    make(sched, 1, 100, 5)
    plan = sched.plan()
    assert [s.request_id for s in plan.decode] == [0]
    assert plan.prefill is not None and plan.prefill[1] == 31  # 32 tokens per step, one of them a decode


def chunks_of(sched: Scheduler, slot: Slot) -> list[int]:
    """The prompt chunks the scheduler feeds ``slot`` alone, to its prompt's end."""
    out = []
    while slot.done < slot.prompt_end:
        plan = sched.plan()
        assert plan.prefill is not None and plan.prefill[0] is slot
        out.append(plan.prefill[1])
        sched.prefilled(slot, plan.prefill[1])
    sched.finish(slot)
    return out


def test_a_chunk_ends_where_a_held_prompt_is_copied_and_a_held_start_goes_on_in_chunks():
    """A held prompt (serving/kept.py): turn one's chunks end at its copy point; turn two, after
    the held start, is the method's prompt in chunks (as from the start, cut at the next copy
    point), where after a kept cache the rest comes in one step. Turn two's history sent cold is
    cut at turn one's copy point too: its chunks after it are the held turn's."""
    pool = SimulatedPool(10**6)
    sched = Scheduler(limits(pool.limit, batched=64), pool.free, pool.release)
    turn = make(sched, 0, 150, 4)
    turn.hold_at = 100
    assert chunks_of(sched, turn) == [64, 36, 50]
    turn = Slot(1, list(range(300)), 4, done=100, held_prompt=True, hold_at=250)
    sched.add(turn)
    assert chunks_of(sched, turn) == [64, 64, 22, 50]
    cold = Slot(3, list(range(300)), 4, hold_at=250, cuts=(100,))
    sched.add(cold)
    assert chunks_of(sched, cold) == [64, 36, 64, 64, 22, 50]
    kept = Slot(2, list(range(300)), 4, done=100)  # a kept cache's next turn: the rest in one step
    sched.add(kept)
    assert chunks_of(sched, kept) == [200]


def test_without_chunking_a_prompt_comes_whole_and_a_longer_one_is_refused():
    pool = SimulatedPool(10**6)
    sched = Scheduler(limits(pool.limit, batched=64, chunked=False), pool.free, pool.release)
    make(sched, 0, 60, 4)
    assert sched.plan().prefill[1] == 60
    with pytest.raises(UserError, match="max_num_batched_tokens=64"):
        make(sched, 1, 65, 4)


def test_a_request_that_cannot_fit_alone_is_refused_when_added():
    sched = Scheduler(limits(ROWS * 10), lambda: ROWS * 10, lambda s: None)
    with pytest.raises(UserError, match=r"does not fit the KV pool even alone.*holds 60"):
        make(sched, 0, 150, 20)  # 170 tokens: 11 blocks per head
    make(sched, 1, 140, 20)  # 160 tokens: 10 blocks per head, fits


def test_max_num_seqs_bounds_the_running_requests():
    pool = SimulatedPool(10**6)
    sched = Scheduler(limits(pool.limit, seqs=2), pool.free, pool.release)
    for i in range(5):
        make(sched, i, 20, 30)
    most = 0
    for _ in range(200):
        if not sched.has_work:
            break
        plan = sched.plan()
        most = max(most, len(sched.running))
        if plan.prefill:
            pool.feed(plan.prefill[0].request_id, plan.prefill[1])
            sched.prefilled(*plan.prefill)
        for s in plan.decode:
            s.max_new_tokens -= 1
            if s.max_new_tokens == 0:
                sched.finish(s)
    assert most == 2 and not sched.has_work


@pytest.mark.parametrize("seed", range(5))
def test_random_arrivals_never_overrun_the_pool(seed):
    rng = random.Random(seed)
    pool = SimulatedPool(ROWS * rng.randint(20, 60))
    sched = Scheduler(limits(pool.limit, batched=rng.choice([16, 48, 200])), pool.free, pool.release)
    new, slots = {}, []
    for i in range(12):
        prompt, n = rng.randint(1, 200), rng.randint(1, 60)
        try:
            slots.append(make(sched, i, prompt, n))
            new[i] = n
        except UserError:
            assert ROWS * math.ceil((prompt + n) / BS) > pool.limit
    finished, failed, _ = serve(sched, pool, new)
    assert failed == [] and sorted(finished) == sorted(new)
    assert pool.held() == 0 and all(s.phase is Phase.DONE for s in slots)


class KeptReserve:
    """Blocks held by kept caches (no request's), which the scheduler may reclaim."""

    def __init__(self, pool: SimulatedPool, caches: list[int]) -> None:
        self.pool = pool
        self.caches = caches  # blocks each kept cache holds, least recently used first
        self.asked: list[int] = []

    def held(self) -> int:
        return sum(self.caches)

    def reclaim(self, blocks: int) -> int:
        self.asked.append(blocks)
        freed = 0
        while freed < blocks and self.caches:
            freed += self.caches.pop(0)
        return freed


def test_kept_caches_are_reclaimed_before_any_request_is_preempted_or_kept_waiting():
    """A pool mostly held by kept caches: requests still run one after another without a
    preemption or a wait on blocks, and only as many caches go as the steps need."""
    pool = SimulatedPool(limit=120)
    reserve = KeptReserve(pool, [40, 40, 30])  # 10 blocks free; the request needs 24 to start
    sched = Scheduler(limits(120), lambda: pool.free() - reserve.held(), pool.release, reserve.reclaim)
    a = make(sched, 1, 40, 10)  # 3 blocks per head (18), a block per head for its decode (6)
    finished, failed, _ = serve(sched, pool, {1: 10})
    assert finished == [1] and not failed
    assert a.preemptions == 0 and not a.waited
    assert reserve.asked and reserve.caches == [40, 30]  # the least recently used one was enough


def test_without_a_reclaim_a_pool_held_by_others_keeps_the_request_waiting():
    """The oracle of the test above: the same pool whose blocks nobody gives back."""
    pool = SimulatedPool(limit=120)
    sched = Scheduler(limits(120), lambda: pool.free() - 110, pool.release)
    make(sched, 1, 40, 10)
    plan = sched.plan()
    assert plan.prefill is None and sched.waiting[0].waited
