"""The binaries of gpu_run.sh's window-clusters, ab-tests, ab-sanitize and tail-tests targets, built here (no GPU) for
sm_90a / 132 SMs into $FLINTGEN_CACHE_DIR, with their entries listed in prebuilt.txt (to carry them alone):

    FLINTGEN_CACHE_DIR=$PWD/.aotcache-t python tools/prebuild_gpu_tests.py

(``python tests/test_qkv_stream.py --prebuild DIR`` covers the streaming tests' whole set; the decode tests'
fixtures build theirs on a GPU machine with the DSL.)
"""

from __future__ import annotations

import os
import sys

sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "tests")]


def plan():
    """{variant name: (kernel def, spec, variant)} of the four targets' tests."""
    import test_decode_attention_fp8 as fp8
    import test_decode_attention_grid as grid
    import test_qkv
    import test_qkv_stream as stream

    from flintgen.configs.qkv_config import TOKEN_TILES, token_tiles
    from flintgen.kernels import get_def
    from flintgen.kernels.base import Target

    t = Target("sm_90a", 132)
    todo = {}

    def add(kdef, spec, v):
        todo[v.name] = (kdef, spec, v)

    attn, rms, qkv = get_def("decode_attention"), get_def("rms_norm"), stream.KDEF
    for specs, batches in ((grid.CAP_SPECS, grid.CLUSTER_PLAN + grid.CAP_PLAN),
                           (fp8.CAP_SPECS, grid.CLUSTER_PLAN + fp8.CAP_PLAN)):
        for spec in specs:
            op = attn.bind(spec, t, grid._no_load)
            for b in batches:
                add(attn, spec, op._variants[True][b])
    for cfg, _, max_tokens in stream.CONFIGS:         # ab-tests' and ab-sanitize's -k: ids holding gt or l
        if "gt" in stream._cfg_id(cfg) or "l" in stream._cfg_id(cfg):
            spec = stream._ring_spec(max_tokens)[1]
            for tile in token_tiles(max_tokens):
                for debug in (False, True):
                    add(qkv, spec, qkv.variant(spec, config=cfg, max_m=tile, target=t, debug=debug))
    for name in ("bf16_4096", "flint_bf16"):          # graph replay / back to back [tma] / [tail], and their warmup
        spec = stream._spec(name)
        for tile in TOKEN_TILES:
            for kind in ("tma", "tail"):
                add(qkv, spec, qkv.variant(spec, config=stream.KINDS[kind], max_m=tile, target=t))
            add(qkv, spec, qkv.variant(spec, max_m=tile, target=t))
        for v in rms.variants(spec, t):
            add(rms, spec, v)
    # tail-tests: two phases (test_stream_finish_numerics' and the fp8 test's tail configs; Case.run: debug too)
    for name, _, cfg in stream.FINISH_CASES + stream.FP8:
        if cfg.tail_heads:
            specs = [stream._spec(name)]
            if (name, cfg) in {(n, c) for n, _, c in stream.FP8}:
                specs.append(specs[0].replace(kv_cache_dtype="fp8_e4m3"))
            for spec in specs:
                for tile in TOKEN_TILES:
                    for debug in (False, True):
                        add(qkv, spec, qkv.variant(spec, config=cfg, max_m=tile, target=t, debug=debug))
                for v in rms.variants(spec, t):
                    add(rms, spec, v)
    for name, cfg, m in test_qkv.OTHER_CONFIGS:       # the cluster design with L2 prefetch (Case.run: debug)
        if cfg.l2_prefetch:
            spec = test_qkv.SPECS[name]
            for tile in (tt for tt in TOKEN_TILES if m <= tt <= 8):
                for debug in (False, True):
                    add(qkv, spec, qkv.variant(spec, config=cfg, max_m=tile, target=t, debug=debug))
            for v in rms.variants(spec, t):
                add(rms, spec, v)
    return t, todo


def main():
    from benchmarks.harness import prebuild_into
    from flintgen import cache

    t, todo = plan()
    root = cache.default_root()
    print(f"{len(todo)} variants -> {root}", flush=True)
    n = prebuild_into([(spec, kdef.name, v) for kdef, spec, v in todo.values()], t, root)
    print(f"built; {n} entries listed in {os.path.join(root, 'prebuilt.txt')}")


if __name__ == "__main__":
    main()
