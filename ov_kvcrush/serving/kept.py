"""Finished requests' caches kept for their conversation's next turn.

An OpenAI-style API is stateless: each turn resends the whole conversation. A finished request's
sequence (its compressed cache and the ids it holds) is kept here; a later request whose tokens
begin with the same ids continues from it, so only its new tokens are prefilled (the loop's
``cache`` argument: :meth:`~ov_kvcrush.engines.openvino_model.SequenceCache.keep_prefix`).

Unlike native prefix caching, which shares full-precision blocks of identical prefixes between
requests, a kept cache is one conversation's own *compressed* state: it is taken by one request
at a time, holds only what the method kept, and continues where that conversation left off.

**What is kept.** The full cache drops nothing, so its sequence is kept as the turn left it.
A compressing method's cache holds what it chose for *this* turn's question, and the next
question may need what it dropped (SnapKV chose from turn one's question: issue 73's chats forgot
the password). So for those a kept cache is a **held prompt**: the start of the turn's prompt
as fed before the method's selection (its first chunk, up to :meth:`KVPool.held_prompt_tokens`),
copied when that chunk is done (:func:`hold_prompt`) and put back in place of the compressed
cache when the request ends (:func:`keep_held`). The next turn continues that prompt in chunks
and the method selects once at its end with the new question in view: the steps a cold request
of the same history takes, cut at the same place, so the same cache and answer. It costs the
held tokens' full-precision blocks between turns, and the prompt's last tokens and the answer are
prefilled again.

Kept caches are the pool's first reserve: the scheduler reclaims them, least recently used
first, before it would preempt a running request, so keeping one never fails a request.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from ov_kvcrush.engines.openvino_model import SequenceCache
from ov_kvcrush.op.kvcache import KVPool
from ov_kvcrush.op.plugin import PluginError
from ov_kvcrush.op.snapshot import SequenceSnapshot, read_snapshot, write_snapshot
from ov_kvcrush.op.step_inputs import fast_prompt_cut
from ov_kvcrush.validation import check_int


@dataclass
class HeldPrompt:
    """A prompt's start as its sequence held it before the method's selection."""

    ids: list[int]
    snapshot: SequenceSnapshot


def hold_point(pool: KVPool, prompt_tokens: int, held: int, first_step: int) -> int:
    """Where a prompt of ``prompt_tokens`` tokens, continuing ``held`` held ones, is copied for
    the next turn: the pool's :meth:`~KVPool.held_prompt_tokens`; down to whole fast steps
    (:func:`fast_prompt_cut`) where the prompt's first step (at most ``first_step`` tokens) ends
    there, so that step stays a fast one and no step is added; past the first step, down to
    whole blocks only (a snapshot then holds no block's unused end, so a held prompt is the same
    bytes however it was reached), so the next turn prefills at most a block of it again;
    ``held`` itself when the turn adds too little to move it (its held start is the next turn's
    too); 0: nowhere (a prompt too short to hold)."""
    cut = pool.held_prompt_tokens(prompt_tokens)
    point = fast_prompt_cut(cut) if held == 0 and cut <= first_step else cut - cut % pool.block_size
    return point if point > held else held


def turn_cuts(
    pool: KVPool, turn_prompts: Sequence[int], prompt_tokens: int, held: int, first_step: int
) -> tuple[tuple[int, ...], int]:
    """Where a conversation's prompt of ``prompt_tokens`` tokens is cut into chunks, and where it
    is held: after the held points of its earlier turns (whose prompts had ``turn_prompts``
    tokens, each continuing the held start of the one before, as :func:`hold_point` chose them
    when those turns ran, with the same ``first_step``), at its own. ``held``: the tokens a kept
    cache continues.

    A turn continued from a held prompt feeds its history in these chunks: the earlier turns'
    and its own. So the same history sent cold, cut here too, feeds the same chunks and computes
    the same cache bit for bit (a u8 store is read exactly in a token's own step, through its
    rounding after: other cuts compute other numbers), and answers alike."""
    cuts: list[int] = []
    start = 0
    for n in turn_prompts:
        start = hold_point(pool, n, start, first_step)
        if start and start not in cuts:
            cuts.append(start)
    own = hold_point(pool, prompt_tokens, max(start, held), first_step)
    return tuple(c for c in cuts if held < c < prompt_tokens), own


def hold_prompt(cache: SequenceCache, ids: list[int]) -> HeldPrompt:
    """The held prompt of ``cache``'s sequence, which holds ``ids`` as chunks of a longer prompt."""
    return HeldPrompt(list(ids), read_snapshot(cache.sequence))


def keep_held(cache: SequenceCache, held: HeldPrompt | None) -> None:
    """Leave ``cache`` holding ``held`` in place of what its request's method kept (nothing when
    there is none, or the pool has no room for it now)."""
    if held is None:
        cache.reset()
        return
    try:
        write_snapshot(cache.sequence, held.snapshot)
    except PluginError:  # the pool is full: the next turn prefills cold
        cache.reset()
        return
    cache.ids, cache.scored = held.ids, 0


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def continued_prefix(held: list[int], ids: list[int], min_shared: int, slack: int) -> int:
    """How many of ``ids`` a request continues from a cache holding ``held`` (0: it is not the
    next turn): it shares all of them but the last ``slack``, at least ``min_shared``, and has
    tokens of its own after them."""
    n = shared_prefix(held, ids)
    return n if max(min_shared, len(held) - slack) <= n < len(ids) else 0


class KeptCaches:
    """At most ``capacity`` kept caches of one pool, least recently used first out.

    A request takes a kept cache when its tokens begin with the cache's: all of them but the last
    ``slack`` (the re-tokenised end of an answer may differ from the tokens generated), at least
    ``min_shared`` (a chat template's common head alone is not a conversation's history), and
    it has tokens of its own after them. The same prompt sent again does not take the cache of
    its earlier answer: it is a new question, not the next turn."""

    def __init__(self, pool: KVPool, capacity: int = 64, min_shared: int = 64, slack: int = 4) -> None:
        check_int("capacity", capacity, 0, 1 << 16)
        check_int("min_shared", min_shared, 1, 1 << 24)
        check_int("slack", slack, 0, 1 << 10)
        self.pool = pool
        self.capacity = capacity
        self.min_shared = min_shared
        self.slack = slack
        self._caches: OrderedDict[int, SequenceCache] = OrderedDict()
        self._lock = threading.Lock()
        self.reclaimed = 0  # caches released under pool pressure

    def __len__(self) -> int:
        return len(self._caches)

    def continues(self, cache: SequenceCache, ids: list[int]) -> int:
        """How many of ``ids`` a request continues from ``cache`` (0: it is not the next turn)."""
        return continued_prefix(cache.ids, ids, self.min_shared, self.slack)

    def take(self, ids: list[int]) -> SequenceCache | None:
        """The kept cache ``ids`` continues furthest, removed from the store: its request owns it
        until it is put back."""
        with self._lock:
            best, best_len = None, 0
            for key, cache in self._caches.items():
                n = self.continues(cache, ids)
                if n > best_len:
                    best, best_len = key, n
            return self._caches.pop(best) if best is not None else None

    def put(self, cache: SequenceCache) -> None:
        """Keep a finished request's cache (the most recently used); past ``capacity`` the least
        recently used one is released."""
        if not cache.ids or self.capacity == 0:
            cache.sequence.free()
            return
        with self._lock:
            self._caches[id(cache)] = cache
            while len(self._caches) > self.capacity:
                self._caches.popitem(last=False)[1].sequence.free()

    def blocks(self) -> int:
        """Full-precision blocks' worth the kept caches hold."""
        with self._lock:
            caches = list(self._caches.values())
        total = 0
        for c in caches:
            st = c.sequence.stats()
            total += -(-st.kv_bytes // st.block_bytes) if st.block_bytes else 0
        return total

    def reclaim(self, blocks: int) -> int:
        """Release least recently used caches until ``blocks`` blocks' worth went back (or none
        is left); the blocks freed. The scheduler calls it before it preempts a request."""
        freed = 0
        while freed < blocks:
            with self._lock:
                if not self._caches:
                    break
                cache = self._caches.popitem(last=False)[1]
            st = cache.sequence.stats()
            freed += -(-st.kv_bytes // st.block_bytes) if st.block_bytes else 0
            cache.sequence.free()
            self.reclaimed += 1
        return freed

    def clear(self) -> None:
        self.reclaim(1 << 62)
