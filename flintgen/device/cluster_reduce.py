"""Reduce-scatter of split-K partial sums inside a thread-block cluster, through
distributed shared memory (cute DSL).

Provenance: written for flintgen's streaming QKV GEMV (its ``cluster``
finish, flintgen.configs.qkv_stream_plan.StreamConfig).

The ``splits`` CTAs of a cluster (ranks 0 .. splits - 1, in K order) each
hold fp32 partial sums of the same tile over their own part of K, in the
same register layout: thread ``tid`` holds values ``v[p][k]`` of token slice
``p`` (``k < slice_values``). Rank ``p`` finishes slice ``p``:

1. ``send``: every CTA stores its values of each other rank's slice into
   that rank's receive buffer (``st.shared::cluster``, 16 bytes a store);
2. the cluster barrier (``barrier.cluster.arrive.release`` /
   ``wait.acquire``, every thread of every CTA) makes them visible;
3. ``gather``: rank ``p`` adds the ``splits`` parts of slice ``p`` in rank
   (= K) order, its own from registers.

No global workspace, counter or poll, and nothing to reset for the next
launch. The cluster barrier is the last access to another CTA's shared
memory, so a CTA may exit once it has passed it.

Receive buffer of a CTA, fp32 ``[splits - 1, slice_values / 4, threads, 4]``
(its size: flintgen.configs.qkv_stream_plan.StreamPlan.recv_bytes):
sender ``r``'s part lands in slot ``(r - p - 1) mod splits`` of receiver
``p``; a thread's 4 consecutive values are one 16-byte access and the
threads' accesses adjacent (conflict-free).

Every choice by rank is a select, not a branch: the ranks run the same code.
"""

from __future__ import annotations

from cutlass import Int32

from flintgen.device import ptx


def _check(splits: int, slice_values: int) -> None:
    if splits < 2 or slice_values % 4:
        raise ValueError(f"cluster_reduce: splits = {splits} must be >= 2 and slice_values = {slice_values} a "
                         "multiple of 4 (16-byte stores)")


def pick(rank, per_rank):
    """``per_rank[rank]`` (Float32 values, ``rank`` an Int32 known only at run time) by selects."""
    out = per_rank[0]
    for p in range(1, len(per_rank)):
        out = ptx.select_f32(Int32(rank == p), per_rank[p], out)
    return out


def _slot_addr(buf, slot, k4: int, tid, threads: int, slice_values: int):
    """Shared address (CTA window) of float4 ``k4`` of ``tid`` in slot ``slot``."""
    return buf + ((slot * (slice_values // 4) + k4) * threads + tid) * 16


def send(buf, values, rank, tid, threads: int):
    """Store this CTA's values of every other rank's slice into that rank's buffer.
    ``buf``: the receive buffer's shared address (Uint32, the same in every CTA);
    ``values[p][k]``: this thread's k-th value of slice ``p``."""
    splits, n = len(values), len(values[0])
    _check(splits, n)
    for d in range(1, splits):
        p = (rank + d) % splits                         # the receiver
        slot = Int32(splits - 1 - d)                    # = (rank - p - 1) mod splits
        remote = ptx.mapa(buf, p)
        vals = [pick(p, [values[q][k] for q in range(splits)]) for k in range(n)]
        for k4 in range(n // 4):
            ptx.st_cluster_f32x4(_slot_addr(remote, slot, k4, tid, threads, n), *vals[4 * k4:4 * k4 + 4])


def gather(buf, values, rank, tid, threads: int):
    """Slice ``rank``'s sums: rank 0's part + rank 1's + ... (K order), this CTA's
    from ``values[rank]``, the others' from ``buf`` (after the cluster barrier)."""
    splits, n = len(values), len(values[0])
    _check(splits, n)
    own = [pick(rank, [values[q][k] for q in range(splits)]) for k in range(n)]
    parts = []
    for q in range(splits):
        # slot (q - rank - 1) mod splits; q == rank has none (clamped: read, then not selected)
        slot = Int32(q + splits - 1) - rank
        slot = slot - Int32(splits) * Int32(slot >= splits)
        slot = slot - Int32(slot == splits - 1)
        got = []
        for k4 in range(n // 4):
            got += list(ptx.lds_f32x4(_slot_addr(buf, slot, k4, tid, threads, n)))
        parts.append([ptx.select_f32(Int32(rank == q), own[k], got[k]) for k in range(n)])
    y = parts[0]
    for part in parts[1:]:
        y = [a + b for a, b in zip(y, part)]
    return y
