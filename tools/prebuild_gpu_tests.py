"""The binaries of GPU test targets, built here (no GPU) for sm_90a / 132 SMs into $FLINTGEN_CACHE_DIR, with their
entries listed in prebuilt.txt (to carry them alone):

    FLINTGEN_CACHE_DIR=$PWD/.aotcache-t python tools/prebuild_gpu_tests.py [PART ...]

PARTs: ``window-clusters`` and ``ab-tests`` (also ab-sanitize's): gpu_run.sh's targets of those names, both when no
PART is given; ``qkv-configs``: tests/test_qkv.py's other launch configs and tests/test_qkv_fp8.py's hand-picked
specs; and ``qkv:NAME,NAME..``: what ``flintgen.get_kernel(SPECS[NAME], "qkv")`` loads for
tests/test_qkv.py's SPECS (the production op's every token tile, with and without debug, and its RMSNorm), for the
GPU tests of tests/test_qkv.py, test_qkv_tokens.py and test_qkv_fp8.py (a Pair needs NAME and NAME_fp8; NAME_t64,
where SPECS has no such name, is SPECS[NAME] with max_tokens 64); ``kv-evict``: test_decode_attention_shapes'
test_kv_evict_first_gpu (its forced configs).

(``python tests/test_qkv_stream.py --prebuild DIR`` covers the streaming tests' whole set; the decode tests'
fixtures build theirs on a GPU machine with the DSL.)
"""

from __future__ import annotations

import os
import sys

sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "tests")]
PARTS = ("window-clusters", "ab-tests")


def plan(parts=PARTS):
    """{variant name: (kernel def, spec, variant)} of the parts' tests."""
    import test_decode_attention_fp8 as fp8
    import test_decode_attention_grid as grid
    import test_qkv
    import test_qkv_stream as stream

    from flintgen.configs.qkv_config import TOKEN_TILES, token_tile, token_tiles
    from flintgen.kernels import get_def
    from flintgen.kernels.base import Target

    t = Target("sm_90a", 132)
    todo = {}

    def add(kdef, spec, v):
        todo[v.name] = (kdef, spec, v)

    attn, rms, qkv = get_def("decode_attention"), get_def("rms_norm"), stream.KDEF

    def add_tiles(spec, tiles, cfg=None, debug=(False, True)):
        for tile in tiles:
            for d in debug:
                add(qkv, spec, qkv.variant(spec, config=cfg, max_m=tile, target=t, debug=d))

    def add_norm(spec):
        for v in rms.variants(spec, t):
            add(rms, spec, v)

    def add_other_configs(keep=lambda cfg: True):
        """test_qkv's other launch configs (the cluster design, debug and not) that ``keep`` takes."""
        for name, cfg, m in test_qkv.OTHER_CONFIGS:
            if keep(cfg):
                spec = test_qkv.SPECS[name]
                add_tiles(spec, [tt for tt in TOKEN_TILES if m <= tt <= 8], cfg)
                add_norm(spec)

    for part in parts:
        if part.startswith("qkv:"):                   # the production op of test_qkv's SPECS
            for name in part[4:].split(","):   # NAME_t64 not in SPECS: SPECS[NAME] with max_tokens 64 (a test's replace)
                spec = (test_qkv.SPECS[name] if name in test_qkv.SPECS
                        else test_qkv.SPECS[name.removesuffix("_t64")].replace(max_tokens=64))
                add_tiles(spec, token_tiles(spec.max_tokens))
                add_norm(spec)
        elif part == "qkv-configs":                    # test_qkv's other launch configs; test_qkv_fp8's hand specs
            import test_qkv_fp8

            add_other_configs()
            for spec in (test_qkv_fp8.HAND, test_qkv_fp8.HAND8):
                add_tiles(spec, token_tiles(spec.max_tokens))
                add_norm(spec)
        elif part == "stream-fp8":                     # test_stream_fp8_cache_bit_exact: each case's tile, both caches
            for name, m, cfg in stream.FP8:
                for spec in (stream._spec(name), stream._spec(name).replace(kv_cache_dtype="fp8_e4m3")):
                    add_tiles(spec, [token_tile(m)], cfg)
                    add_norm(spec)
        elif part == "window-clusters":
            for specs, batches in ((grid.CAP_SPECS, grid.CLUSTER_PLAN + grid.CAP_PLAN),
                                   (fp8.CAP_SPECS, grid.CLUSTER_PLAN + fp8.CAP_PLAN)):
                for spec in specs:
                    op = attn.bind(spec, t, grid._no_load)
                    for b in batches:
                        add(attn, spec, op._variants[True][b])
        elif part == "kv-evict":   # test_kv_evict_first_gpu: each case's forced config
            import test_decode_attention_shapes as shp
            from flintgen.configs import decode_attention_config as dac

            real = dac.launch_config
            for gqa, d, w, s, m, mf, lens in shp.EVICT_CASES:
                cfg = shp._evict_cfg(gqa, d, w, s, m, mf)
                spec = shp.shape_spec(gqa, d, 16, kv=2, max_batch=len(lens))
                dac.launch_config = lambda **kw: cfg
                try:
                    for v in attn.variants(spec, t):
                        add(attn, spec, v)
                finally:
                    dac.launch_config = real
        elif part == "ab-tests":
            for cfg, _, max_tokens in stream.CONFIGS:   # ab-tests' and ab-sanitize's -k: ids holding gt or l
                if "gt" in stream._cfg_id(cfg) or "l" in stream._cfg_id(cfg):
                    add_tiles(stream._ring_spec(max_tokens)[1], token_tiles(max_tokens), cfg)
            add_other_configs(lambda cfg: cfg.l2_prefetch)   # the cluster design with L2 prefetch (Case.run: debug)
        else:
            raise SystemExit(f"prebuild_gpu_tests: unknown part {part!r}: {', '.join(PARTS)}, qkv-configs, stream-fp8, kv-evict or "
                             "qkv:NAME,NAME..")
        if part == "ab-tests":   # graph replay / back to back [tma], and their warmup
            for name in ("bf16_4096", "flint_bf16"):
                spec = stream._spec(name)
                add_tiles(spec, TOKEN_TILES, stream.KINDS["tma"], (False,))
                add_tiles(spec, TOKEN_TILES, None, (False,))
                add_norm(spec)
    return t, todo


def main():
    from benchmarks.harness import prebuild_into
    from flintgen import cache

    t, todo = plan(sys.argv[1:] or PARTS)
    root = cache.default_root()
    print(f"{len(todo)} variants -> {root}", flush=True)
    n = prebuild_into([(spec, kdef.name, v) for kdef, spec, v in todo.values()], t, root)
    print(f"built; {n} entries listed in {os.path.join(root, 'prebuilt.txt')}")


if __name__ == "__main__":
    main()
