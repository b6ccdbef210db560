"""Merge N runs of one benchmarks.qkv table (<dir>/run<i>/<name>.json) into one markdown table:
per (spec, M, design, what) each run's µs, the spread (max - min), the median, the floor, % of floor and
the median's difference from the reference design's (default ``production``).

    python tools/merge_runs.py DIR NAME [--ref DESIGN]
"""

from __future__ import annotations

import json
import os
import statistics
import sys


def main() -> None:
    root, name = sys.argv[1], sys.argv[2]
    ref = sys.argv[sys.argv.index("--ref") + 1] if "--ref" in sys.argv else "production"
    runs = sorted(d for d in os.listdir(root) if d.startswith("run") and os.path.exists(os.path.join(root, d, f"{name}.json")))
    table: dict = {}
    floors: dict = {}
    meta = None
    for r in runs:
        data = json.load(open(os.path.join(root, r, f"{name}.json")))
        meta = meta or data.get("meta")
        for row in data["rows"]:
            c = row["case"]
            key = (c["spec"], c["M"], c["design"], c["what"])
            table.setdefault(key, []).append(row["flintgen_us"])
            floors[key] = row["floor_us"]
    med = {k: statistics.median(v) for k, v in table.items()}
    n = len(runs)
    head = ("| spec | M | design | what | " + " | ".join(f"run {i + 1} µs" for i in range(n))
            + " | spread | median µs | floor µs | % of floor | Δ vs " + ref + " |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for key in sorted(table, key=lambda k: (k[0], k[1], k[3], k[2] != ref, k[2])):
        v = table[key]
        base = med.get((key[0], key[1], ref, key[3]))
        delta = f"{med[key] - base:+.2f}" if base is not None else "—"
        print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | " + " | ".join(f"{x:.2f}" for x in v)
              + f" | {max(v) - min(v):.2f} | {med[key]:.2f} | {floors[key]:.2f} | {100 * floors[key] / med[key]:.0f}% | {delta} |")
    if meta:
        print(f"\nmeta (last run): {json.dumps(meta)}")


if __name__ == "__main__":
    main()
