"""Tickets of a work pool (cute DSL): units handed out one at a time in
arrival order, for the streaming QKV GEMV's pool (flintgen.configs.qkv_stream_plan).

A CTA draws a unit with a relaxed ``atom.add`` on the pool's ticket counter
(values count up from 0; a value >= ``limit`` means the pool is empty). The
draw's latency (an L2 round trip) is hidden by drawing ahead: thread 0 draws
the ticket of pool copy ``q`` ``DRAW_AHEAD`` ring iterations before the
copy is issued, holds it in a register for two iterations and stores it to
slot ``q % QUEUE`` of a shared-memory queue at the end of the iteration
before the issue, so the ring's barrier makes it visible to every thread::

    iteration  i - 3 (= the draw)  i - 2   i - 1 (store)   i (issue: every thread reads it)
    tick:      [0] <- atom          [1]     -> queue

A CTA's draws count up, so once one is past the pool every later one is:
thread 0 stops drawing after storing the first such value (a few more may
already be in flight). The counter is reset for the next launch by the last
CTA to leave (flintgen.device.arrivals.leave): every draw of a CTA precedes
its acq_rel count, and the next launch draws only after its grid-dependency
wait.

``tick`` is a 3-entry register tensor of thread 0: the last two draws and
whether the pool ran out. ``queue`` holds QUEUE int32 (a power of two above
the ring's lookahead + 1: a slot is rewritten only after every read of its
previous ticket).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from flintgen.configs.qkv_stream_plan import POOL_DRAW_AHEAD as DRAW_AHEAD, POOL_QUEUE as QUEUE
from flintgen.device import ptx

__all__ = ["DRAW_AHEAD", "QUEUE", "start", "step", "read"]


@cute.jit
def start(tick, queue0, tid):
    """Thread 0's pipeline empty, the queue zeroed (read before its first tickets land, never used)."""
    if tid == 0:
        tick[0] = Int32(0)
        tick[1] = Int32(0)
        tick[2] = Int32(0)
    if tid < QUEUE:
        ptx.sts_i32(queue0 + Int32(tid * 4), Int32(0))


@cute.jit
def step(tick, queue0, counter, q: Int32, limit: cutlass.Constexpr[int], tid):
    """Thread 0, once per ring iteration: store the ticket of pool copy ``q - 2`` (drawn two
    iterations ago; ``limit`` once the pool ran out) and draw the ticket of pool copy ``q``.
    Iterations with ``q < 0`` do nothing (the pool's first copy is further ahead)."""
    if tid == 0:
        if q >= 0:
            if q >= 2:
                ptx.sts_i32(queue0 + Int32(((q - 2) & (QUEUE - 1)) * 4), tick[1])
                if tick[1] >= limit:
                    tick[2] = Int32(1)
            tick[1] = tick[0]
            drawn = Int32(limit)
            if tick[2] == 0:
                drawn = ptx.atomic_add_relaxed(counter, Int32(1))
            tick[0] = drawn


def read(queue0, q):
    """Pool copy ``q``'s unit (>= the pool's size: none), stored before the last barrier (``q`` < 0: some
    slot, in range)."""
    return ptx.lds_i32(queue0 + Int32((q & (QUEUE - 1)) * 4))
