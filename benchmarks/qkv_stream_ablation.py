"""Where the streaming QKV GEMV's time goes (issue 18): the GEMV kernel alone,
CUDA-graph replay, with one part of templates/qkv_stream.py.j2 removed per
variant (a text patch of the rendered module; results are wrong, only the
time matters):

* ``ref``        the production binary of the spec's tile (stream_config with its heads: at 64 tokens
                 the wgmma ring, 6 stages, heads finished in two 32-token slices after the ranges)
* ``no_mma``     no MMAs (the ring is still filled and waited on)
* ``no_sync``    no per-unit barrier (stages are refilled while others may read them)
* ``no_xn``      xn's slices not copied (weights only through the ring)
* ``no_finish``  no head completes: no merge, no epilogue (partials and counters still written)
* ``no_wait``    spread finish: a slice's finisher does not wait for its head's last unit (the merge and
                 epilogue run at once, on whatever partials are there): the finish's wait for stragglers
* ``one_part``   spread finish: the merge reads one contributor's partial instead of every contributor's

Each patch replaces whole lines of the rendered module and must match once
(tests/test_qkv_stream.py::test_ablation_patches_apply keeps them in step
with the template: once the template's unit loop moved one level in, the
earlier substring patches had ``no_mma`` match a line's tail and move the
partial stores into the loop, and ``no_sync`` match nothing; no published run
used them so: run 1 of results/qkv_stream_ablation.md predates the move,
run 2 switched the template instead).

    python -m benchmarks.qkv_stream_ablation [--ms 1,64] [--prebuild DIR]

Specs: flint-bf16 (hidden 2048) and hidden 4096 32/8, BF16, at M = 1 (8-token tile,
streaming forced) and M = 64. Table into $OUT/qkv_stream_ablation.md (or stdout).
"""

from __future__ import annotations

import os
import sys

from flintgen import cache, codegen, toolchain
from flintgen.configs.qkv_stream_plan import stream_config
from flintgen.kernels.qkv import QKVDef

_IN_LOOP = " " * 24   # the unit loop's body in the rendered module
PATCHES = {
    "ref": [],
    "no_mma": [(f"\n{_IN_LOOP}self.mma_unit(acc, ring0 + (j % STAGES) * STAGE_BYTES, warp, g, t)\n", "\n")],
    "no_sync": [(f"\n{_IN_LOOP}cute.arch.sync_threads()\n", "\n")],
    "no_xn": [("self.issue_xn(xn, stage, un, tid, live, m)", "self.issue_xn(xn, stage, un, tid, Int32(0), m)")],
    "no_finish": [("if ptx.lds_i32(ptx.smem_addr(flag)) == HEAD_UNITS:",
                   "if ptx.lds_i32(ptx.smem_addr(flag)) == HEAD_UNITS + 1000000000:"),
                  ("if tok0 < finishers * SLICE_TOKENS:", "if tok0 < -1:")],
    "no_wait": [("arrivals.wait_count(counter, Int32(HEAD_UNITS), tid)", "cute.arch.sync_threads()")],
    "one_part": [("for k in cutlass.range_constexpr(MAX_CONTRIB):", "for k in cutlass.range_constexpr(1):"),
                 ("MERGE_SLOTS = min(MAX_CONTRIB, MERGE_FLOATS", "MERGE_SLOTS = min(1, MERGE_FLOATS"),
                 ("for s0 in cutlass.range_constexpr(0, MAX_CONTRIB, MERGE_SLOTS):",
                  "for s0 in cutlass.range_constexpr(0, 1, MERGE_SLOTS):")],
}
KDEF = QKVDef()


def config_of(spec, m):
    """The op's configuration of the tile (64 tokens: spread finish where the heads allow; M = 1: the 64-token
    ring's configuration without it, forced onto the 8-token tile)."""
    heads = spec.q_heads_per_rank + 2 * spec.kv_heads_per_rank
    return stream_config("bf16", 64, spec.head_dim, hidden=spec.hidden_size, heads=heads if m > 8 else 0)


def patched_source(spec, v, tag):
    """The rendered module of ``v`` with ``tag``'s patches (each must occur exactly once)."""
    src = codegen.render(v.kernel, KDEF.template_of(v), dict(KDEF.render_params(spec, v)))
    for old, new in PATCHES[tag]:
        if src.count(old) != 1:
            raise RuntimeError(f"{tag}: {old!r} occurs {src.count(old)} times")
        src = src.replace(old, new)
    if tag != "ref":
        src = src.replace("class QKVStream:", f"class QKVStream:  # ablation {tag}", 1)
    return src


def entry(spec, v, tag, target, root=None):
    src = patched_source(spec, v, tag)
    key = cache.key_of(cache.key_material(v, src, target))
    return cache.Entry(v, KDEF.template_of(v), src, target, key, root or cache.default_root())


def cases():
    from benchmarks.qkv import base_specs

    flint, big = base_specs()
    specs = [flint.replace(weight_format="bf16", name="flint-bf16", max_tokens=64), big.replace(max_tokens=64)]
    ms = (1, 64)
    if "--ms" in sys.argv:
        ms = tuple(int(x) for x in sys.argv[sys.argv.index("--ms") + 1].split(","))
        if not set(ms) <= {1, 64}:
            raise SystemExit(f"qkv_stream_ablation: --ms {','.join(map(str, ms))}: the cases are M = 1 and 64")
    return [(s, m) for s in specs for m in ms]


def main():
    root = None
    if "--prebuild" in sys.argv:
        root = os.path.abspath(sys.argv[sys.argv.index("--prebuild") + 1])
        target = toolchain.resolve_target(arch="sm_90a", num_sms=132)
        for spec, m in cases():
            v = KDEF.variant(spec, config=config_of(spec, m), max_m=8 if m <= 8 else 64, target=target)
            for tag in PATCHES:
                cache.get_or_build(entry(spec, v, tag, target, root), fallback=False)
        print(f"prebuilt {len(cases()) * len(PATCHES)} ablation binaries into {root}")
        return
    import torch

    from benchmarks.harness import time_graph, write_report
    from benchmarks.qkv import Layers, copies_for, make_weights, weight_bytes
    from flintgen.kernels.qkv import QKVOp

    target = toolchain.resolve_target()
    lines = ["| spec | M | " + " | ".join(f"{t} µs" for t in PATCHES) + " | floor µs |", "|---|---|" + "---|" * (len(PATCHES) + 1)]
    bw = None
    from benchmarks.harness import read_bandwidth

    bw = read_bandwidth()
    for spec, m in cases():
        cfg = config_of(spec, m)
        v = KDEF.variant(spec, config=cfg, max_m=8 if m <= 8 else 64, target=target)
        op = QKVOp(KDEF, spec, target, lambda vv: None, config=cfg)
        weights = make_weights(spec, copies_for(spec))
        lay = Layers(spec, m, weights)
        row = []
        for tag in PATCHES:
            fn = cache.get_or_build(entry(spec, v, tag, target)).function
            row.append(time_graph(lambda: fn(*lay.stream_args(lay.weights(), op, v)))["median_us"])
        lines.append(f"| {spec.name} | {m} | " + " | ".join(f"{x:.2f}" for x in row)
                     + f" | {weight_bytes(spec) / bw * 1e6:.2f} |")
        print(lines[-1], flush=True)
        torch.cuda.synchronize()
    text = ("# qkv_stream_ablation\n\n" + (__doc__ or "").split("\n\n")[0] + "\n\nRead bandwidth "
            f"{bw / 1e12:.2f} TB/s.\n\n" + "\n".join(lines) + "\n")
    write_report("qkv_stream_ablation", text)


if __name__ == "__main__":
    main()
