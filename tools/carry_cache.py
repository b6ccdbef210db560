"""Copy the cache entries that one or more prebuilds listed (each root's prebuilt.txt) into one folder to
carry to a GPU machine, and say how big it is (the device tool carries 64 MiB in all, the runtime stage
included):

    python tools/carry_cache.py DST SRC [SRC ...]

Entries are copied whole (kernel.ptx too: a loaded entry's files are hash-checked against its meta.json);
DST/prebuilt.txt lists every entry copied. Exits 1 when a listed entry is missing.
"""

from __future__ import annotations

import os
import shutil
import sys


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python tools/carry_cache.py DST SRC [SRC ...]", file=sys.stderr)
        return 2
    dst, srcs = os.path.abspath(argv[0]), [os.path.abspath(s) for s in argv[1:]]
    listed, missing = [], []
    for src in srcs:
        if not os.path.isfile(os.path.join(src, "prebuilt.txt")):
            print(f"{src} has no prebuilt.txt: build into it with a --prebuild (or tools/prebuild_gpu_tests.py) first",
                  file=sys.stderr)
            return 2
        with open(os.path.join(src, "prebuilt.txt")) as f:
            for rel in (line.strip() for line in f):
                if rel and rel not in (r for _, r in listed):
                    (listed if os.path.isdir(os.path.join(src, rel)) else missing).append((src, rel))
    for src, rel in listed:
        out = os.path.join(dst, rel)
        if not os.path.isdir(out):
            shutil.copytree(os.path.join(src, rel), out)
    with open(os.path.join(dst, "prebuilt.txt"), "w") as f:
        f.write("".join(rel + "\n" for _, rel in listed))
    for src, rel in missing:
        print(f"missing: {os.path.join(src, rel)}", file=sys.stderr)
    print(f"{len(listed)} entries, {_size(dst) / 2**20:.1f} MiB in {dst}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
