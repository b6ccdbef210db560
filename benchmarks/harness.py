"""Shared benchmark harness: CUDA-graph replay timing, the read-bandwidth floor
measured in the same process, peers, and results as JSON + markdown.

Method (see the device tool's METHOD.md): every timed callable is captured
``calls`` times into one CUDA graph; the graph is replayed ``replays`` times,
each replay timed with CUDA events; the reported time is the median replay
divided by ``calls``. The floor is bytes / read bandwidth, the bandwidth being
a 4 GiB ``torch.sum`` timed with events (median of 20) in the same process.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch


def elapsed_s(fn: Callable[[], object]) -> float:
    """GPU seconds of ``fn()`` on the current stream, from CUDA events."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e-3


def read_bandwidth(gib: float = 4.0, iters: int = 20) -> float:
    """Device read bandwidth in bytes/s: a reduction over ``gib`` GiB of fp32."""
    n = int(gib * (1 << 30)) // 4
    x = torch.ones(n, dtype=torch.float32, device="cuda")
    for _ in range(3):
        x.sum()
    times = [elapsed_s(x.sum) for _ in range(iters)]
    del x
    torch.cuda.empty_cache()
    return n * 4 / statistics.median(times)


def captured(call: Callable[[int], object], n_calls: int, warmup_calls: int) -> "torch.cuda.CUDAGraph":
    """``call(i % n_calls)`` for i < ``warmup_calls`` run eagerly on a side stream, then ``call(i)`` for i < n_calls
    captured in one CUDA graph on it, replayed 5 times: the graph, ready to time."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(warmup_calls):
            call(i % n_calls)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for i in range(n_calls):
            call(i)
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    return g


def time_graph(fn: Callable[[], object], calls: int = 20, replays: int | None = None, warmup: int = 3,
               budget_s: float = 0.4) -> dict:
    """Median µs per call of ``fn`` over CUDA-graph replays (plus spread).

    ``replays`` defaults to what fits ``budget_s`` of GPU time, within 20..200.
    """
    g = captured(lambda i: fn(), calls, warmup)
    if replays is None:
        replays = int(min(200, max(20, budget_s / max(elapsed_s(g.replay), 1e-6))))
    per_call = sorted(elapsed_s(g.replay) * 1e6 / calls for _ in range(replays))
    return {"median_us": statistics.median(per_call), "p10_us": per_call[len(per_call) // 10],
            "p90_us": per_call[9 * len(per_call) // 10]}


def replay_calls(call: Callable[[int], object], n_calls: int = 20, replays: int = 50) -> float:
    """``call(i)`` for i < n_calls, run once eagerly on a side stream, then captured in one CUDA graph, replayed 5
    times and timed over ``replays`` more: the median µs per call. The last replay's effects stay (stamp buffers)."""
    g = captured(call, n_calls, n_calls)
    return statistics.median(elapsed_s(g.replay) for _ in range(replays)) * 1e6 / n_calls


def write_report(name: str, text: str, fallback_dir: str | None = None) -> None:
    """A markdown report: ``$OUT/<name>.md`` (the device tool brings $OUT back) or, without $OUT,
    ``fallback_dir/<name>.md`` when given; always printed."""
    out = os.environ.get("OUT") or fallback_dir
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{name}.md"), "w") as f:
            f.write(text)
    print(text)


@dataclass
class Row:
    """One measured case: our time (None where flintgen refused the shape),
    the floor, and peers' times (µs)."""

    case: dict
    flintgen_us: float | None
    floor_us: float | None = None
    peers_us: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    @property
    def pct_of_floor(self) -> float | None:
        return 100.0 * self.floor_us / self.flintgen_us if self.floor_us and self.flintgen_us else None


def device_info() -> dict:
    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"device": p.name, "sms": p.multi_processor_count, "torch": torch.__version__,
            "cuda": torch.version.cuda}


def list_prebuilt(root: str, dirs, append: bool = False) -> int:
    """Write (or ``append``) the cache entry directories ``dirs`` to ``root``/prebuilt.txt, the subset of the
    cache a GPU run needs carried. Returns how many distinct ones."""
    dirs = sorted(set(dirs))
    with open(os.path.join(root, "prebuilt.txt"), "a" if append else "w") as f:
        f.write("".join(os.path.relpath(d, root) + "\n" for d in dirs))
    return len(dirs)


def prebuild_into(todo, target, root: str) -> int:
    """Build ``todo`` ((spec, kernel name, variant) triples) for ``target`` into the cache at ``root``, one process
    per CPU core, and list the entries they need in ``root``/prebuilt.txt (to carry that subset alone to a GPU
    machine). Returns the number of entries."""
    from flintgen.cli import _build_one
    from flintgen.procutil import run_spawned

    root = os.path.abspath(root)
    done = run_spawned(_build_one, [(s, k, v, target, root) for s, k, v in todo])
    return list_prebuilt(root, [r[-1] for r in done])


def commit() -> str:
    if os.environ.get("FLINTGEN_COMMIT"):
        return os.environ["FLINTGEN_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_results(name: str, rows: list[Row], bandwidth: float, notes: str = "",
                  out_dir: str | None = None, meta: dict | None = None) -> str:
    """Write ``<name>.json`` and ``<name>.md`` under $OUT (device runs) or
    benchmarks/results/; returns the markdown table. ``meta``: date, commit,
    device and its fields from earlier runs (tables merged on a machine
    without a GPU) instead of this process's."""
    out_dir = out_dir or os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out_dir, exist_ok=True)
    meta = {"benchmark": name, **(meta or {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit(),
        **device_info()}), "read_bandwidth_TBps": bandwidth / 1e12, "notes": notes}
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump({"meta": meta, "rows": [dict(asdict(r), pct_of_floor=r.pct_of_floor) for r in rows]}, f,
                  indent=1)
    peers = sorted({p for r in rows for p in r.peers_us})
    case_keys = list(rows[0].case) if rows else []
    head = case_keys + ["flintgen µs", "floor µs", "% of floor"] + [f"{p} µs" for p in peers]
    lines = [f"# {name}", "",
             f"{meta['date']} · {meta['device']} ({meta['sms']} SMs) · torch {meta['torch']} · commit "
             f"{meta['commit']} · read bandwidth {meta['read_bandwidth_TBps']:.2f} TB/s (4 GiB sum, same process)",
             "", "CUDA-graph replay, median per call. " + notes, "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r.case[k]) for k in case_keys]
        cells += [f"{r.flintgen_us:.2f}" if r.flintgen_us is not None else "—",
                  f"{r.floor_us:.2f}" if r.floor_us else "—",
                  f"{r.pct_of_floor:.0f}%" if r.pct_of_floor else "—"]
        cells += [f"{r.peers_us[p]:.2f}" if p in r.peers_us else "—" for p in peers]
        lines.append("| " + " | ".join(cells) + " |")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(md)
    return md
