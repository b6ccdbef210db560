"""Child processes that do not outlive flintgen."""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Make the kernel SIGKILL this process when its parent dies (Linux
    ``PR_SET_PDEATHSIG``; also when the parent is SIGKILLed), and exit now if
    the parent is already gone (it may die before this runs)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: best effort only
        return
    if os.getppid() != parent_pid:
        os._exit(1)


def _init_worker(parent_pid: int) -> None:
    """Pool worker start: die with the parent, even when it is SIGKILLed."""
    die_with_parent(parent_pid)


def run_spawned(fn, jobs, workers: int | None = None, *, return_exceptions: bool = False, on_done=None) -> list:
    """``fn(*job)`` for every job of ``jobs`` in spawned worker processes (``workers``, default one per CPU core;
    ``fn`` importable by name, the jobs picklable) that die with this process. Returns the results in job order;
    a job's exception is raised (after the pool is shut down) or, with ``return_exceptions``, returned in its
    place. ``on_done()`` is called as each job ends (a progress bar)."""
    import concurrent.futures as cf
    import multiprocessing

    jobs = list(jobs)
    with cf.ProcessPoolExecutor(max_workers=max(1, min(workers or os.cpu_count() or 2, len(jobs) or 1)),
                                mp_context=multiprocessing.get_context("spawn"),
                                initializer=_init_worker, initargs=(os.getpid(),)) as pool:
        futs = [pool.submit(fn, *job) for job in jobs]
        for f in cf.as_completed(futs):
            if on_done is not None:
                on_done()
    out = []
    for f in futs:
        e = f.exception()
        if e is not None and not return_exceptions:
            raise e
        out.append(e if e is not None else f.result())
    return out
