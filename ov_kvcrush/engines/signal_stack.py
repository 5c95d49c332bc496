"""A thread's alternate signal stack that outlives OpenVINO's CPU plugins.

Every CPU plugin instance OpenVINO makes (one per ``ov.Core``, and one per openvino_genai
pipeline) gives the thread that makes it a new alternate signal stack (``SigAltStackSetup``, for
the large signal frames of AMX). Destroyed, the plugin unmaps that stack, but it restores the
stack it replaced only if its own is still the thread's. So two plugins destroyed in the order
they were made leave the thread's alternate stack pointing at unmapped memory: the next signal
Python handles on it (Ctrl-C, faulthandler's) kills the process, or writes its frame over
whatever was mapped there since. Two genai engines, made and dropped one after the other (an
evaluation, a test run), are enough.

:func:`own_signal_stack`, called after a plugin is made, puts a stack of ours on top (one per
thread, never unmapped): a plugin destroyed later never finds its own stack current, so it only
unmaps it. Our own op compiles on one Core that lives as long as the process
(:func:`ov_kvcrush.op.plugin.shared_core`), so only openvino_genai's pipelines need this.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading

#: room for an AMX signal frame (about 11 KiB) and the handlers' own frames, many times over
STACK_BYTES = 256 * 1024


class _Stack(ctypes.Structure):  # struct stack_t (Linux)
    _fields_ = [("ss_sp", ctypes.c_void_p), ("ss_flags", ctypes.c_int), ("ss_size", ctypes.c_size_t)]


#: each thread's stack, by thread id: anonymous mappings kept as long as the process (a thread id
#: reused by a later thread reuses its stack; the earlier thread is gone)
_stacks: dict[int, mmap.mmap] = {}
_lock = threading.Lock()


def own_signal_stack() -> bool:
    """Make this thread's alternate signal stack ours (allocated on first use, then reused).
    False where there is nothing to do (not Linux) or the call failed (nothing changed)."""
    if sys.platform != "linux":
        return False
    with _lock:
        memory = _stacks.get(threading.get_ident())
        if memory is None:
            memory = mmap.mmap(-1, STACK_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            _stacks[threading.get_ident()] = memory
    address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.sigaltstack(ctypes.byref(_Stack(address, 0, STACK_BYTES)), None) == 0


def current_signal_stack() -> tuple[int, int]:
    """``(address, bytes)`` of this thread's alternate signal stack (``(0, 0)``: none, or not Linux)."""
    if sys.platform != "linux":
        return 0, 0
    now = _Stack()
    if ctypes.CDLL(None).sigaltstack(None, ctypes.byref(now)) != 0 or now.ss_flags & 2:  # SS_DISABLE
        return 0, 0
    return now.ss_sp or 0, now.ss_size
