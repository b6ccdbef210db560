"""Tickets of a work pool (cute DSL): units handed out one at a time in
arrival order, for the streaming QKV GEMV's pool (flintgen.configs.qkv_stream_plan).

A CTA draws a unit with a relaxed ``atom.inc`` (ptx.atomic_inc_relaxed) on the pool's ticket counter
(values count up from 0; a value >= ``limit`` means the pool is empty). The
draw's latency (an L2 round trip, longer under the stream's load) is hidden
by drawing ahead: lane ``q % LANES`` of warp 0 draws the ticket of pool copy
``q`` ``DRAW_AHEAD`` ring iterations before the copy is issued and stores it
to slot ``q % QUEUE`` of a shared-memory queue at the end of the iteration
before the issue, so the ring's barrier makes it visible to every thread::

    iteration  i - 3 (= the draw)  i - 2   i - 1 (store)   i (issue: every thread reads it)
    lane q % 4: tick <- atom                 tick -> queue

Each of the LANES drawing lanes holds one ticket in a register from its draw
to its store, two iterations later, and draws again two iterations after
that: no instruction touches the atomic's result before the store, so the
round trip may take up to two iterations without stalling the ring (the
draw is ``atom.inc``, not ``add``, for the same reason: ptx.atomic_inc_relaxed).

A CTA's draws count up in copy order (a draw and the next one, by another
lane, are an iteration's barrier apart: the same counter's atomics in that
order), so once one is past the pool every later one is: a lane stops drawing
after storing such a value (a few more draws may already be in flight). The
counter is reset for the next launch by the last CTA to leave
(flintgen.device.arrivals.leave): every draw of a CTA precedes its acq_rel
count, and the next launch draws only after its grid-dependency wait.

``tick`` is a 1-entry register tensor: the drawing lane's pending ticket.
``queue`` holds QUEUE int32 (a power of two above the ring's lookahead + 1:
a slot is rewritten only after every read of its previous ticket).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from flintgen.configs.qkv_stream_plan import POOL_DRAW_AHEAD as DRAW_AHEAD, POOL_DRAW_LANES as LANES, POOL_QUEUE as QUEUE
from flintgen.device import ptx

__all__ = ["DRAW_AHEAD", "LANES", "QUEUE", "start", "step", "read"]


@cute.jit
def start(tick, queue0, tid):
    """No ticket pending, the queue zeroed (read before its first tickets land, never used)."""
    tick[0] = Int32(0)
    if tid < QUEUE:
        ptx.sts_i32(queue0 + Int32(tid * 4), Int32(0))


@cute.jit
def step(tick, queue0, counter, q: Int32, limit: cutlass.Constexpr[int], tid):
    """Once per ring iteration (every thread calls it; lanes of warp 0 act): lane ``(q - 2) % LANES``
    stores the ticket of pool copy ``q - 2`` (drawn two iterations ago) and lane ``q % LANES`` draws the
    ticket of pool copy ``q`` unless its last one (copy ``q - LANES``, stored) was past the pool.
    Iterations with ``q < 0`` do nothing (the pool's first copy is further ahead)."""
    if q >= 0:
        if q >= 2:
            if tid == (q - 2) & (LANES - 1):
                ptx.sts_i32(queue0 + Int32(((q - 2) & (QUEUE - 1)) * 4), tick[0])
        if tid == q & (LANES - 1):
            if tick[0] < limit:
                tick[0] = ptx.atomic_inc_relaxed(counter)


def read(queue0, q):
    """Pool copy ``q``'s unit (>= the pool's size: none), stored before the last barrier (``q`` < 0: some
    slot, in range)."""
    return ptx.lds_i32(queue0 + Int32((q & (QUEUE - 1)) * 4))
