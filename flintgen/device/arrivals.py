"""Arrival counters of split work (cute DSL): the split-KV merge of decode
attention and the streaming QKV GEMV's spread finish. Contributors count on a
counter with an acq_rel atomic after a barrier (CUTLASS's semaphore pattern);
a CTA that needs every contribution polls it (``wait_count``), and the CTAs
that consumed them count their departures, the last resetting it to 0 for the
next launch (``depart``). Waiting assumes the grid's CTAs are all resident or
will run (a persistent grid; every CTA publishes before it waits)."""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32

from flintgen.device import ptx


@cute.jit
def wait_count(counter, target, tid):
    """Thread 0 polls ``counter`` (acquire) until it reaches ``target``; the
    barrier hands what it acquired to the CTA."""
    if tid == 0:
        while ptx.ld_acquire_i32(counter) < target:
            ptx.nanosleep(Int32(32))
    cute.arch.sync_threads()


@cute.jit
def depart(counter, last, tid):
    """A merging CTA is done: count it; the one that brings the counter to
    ``last`` (every merger counted) resets it to 0."""
    if tid == 0:
        if ptx.atomic_add_acq_rel(counter, Int32(1)) == last:
            ptx.stg_i32_relaxed(counter, Int32(0))
