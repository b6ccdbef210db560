"""Time alternative launch configs of decode attention against each other
(results/decode_attention_sweep.md: one section per run, naming the commit
whose ROWS it timed; ROWS below is the latest question asked).

    python -m benchmarks.decode_attention_sweep --build   # CPU: compile every candidate into the cache
    python -m benchmarks.decode_attention_sweep           # GPU: time them (CUDA-graph replay)

Each candidate is forced by patching the heuristic for a spec of its own, so
the normal variant/cache machinery compiles and loads it.
"""

from __future__ import annotations

import argparse
import contextlib

import flintgen
from benchmarks.decode_attention import shape_spec
from flintgen.configs import decode_attention_config as dac
from flintgen.configs.decode_attention_config import DecodeAttentionConfig as C

FLINT = flintgen.get_preset("flint")
TP2 = FLINT.replace(tp_size=2)
WIDE = FLINT.replace(num_q_heads=64, num_kv_heads=8)
FULL = dict(layer_types=("full",), sliding_window=None)
SLIDE = dict(layer_types=("sliding",))

def model_shape(q_heads, kv_heads, head_dim, window=None):
    """A full-attention (or, with ``window``, all-sliding) spec of one
    model's per-rank heads, 16-token pages, no sinks."""
    kinds = dict(layer_types=("sliding",), sliding_window=window) if window else FULL
    return FLINT.replace(name=f"{q_heads}-{kv_heads}-d{head_dim}", num_q_heads=q_heads, num_kv_heads=kv_heads,
                         head_dim=head_dim, page_size=16, sinks=False, tp_size=1, **kinds)


# Run 13: the head_dim-96 / -256 rules (derived by bytes) and long windows,
# on the models benchmark's weak rows. d256: Gemma-3-1B 4/1 (1 pair at B=1, 8
# at B=8), Gemma-2-9B 16/8 (8 pairs at B=1, 64 at B=8); d96: Phi-3-mini 32/32
# (32 pairs at B=1) and its TP-4 rank 8/8 (8 pairs); d64: SmolLM2 32/32 at B=1.
G3, G2, PHI3, PHI3_TP4, SMOL = (model_shape(4, 1, 256), model_shape(16, 8, 256), model_shape(32, 32, 96),
                                model_shape(8, 8, 96), model_shape(32, 32, 64))


def d256(splits, stages, cpsm=1, **kw):
    return C(splits, 4, stages, 1, False, cpsm, 256, kw.pop("gqa", 4), **kw)


def d96(splits, stages, min_pages, gqa=1, cpsm=2, **kw):
    return C(splits, 4, stages, min_pages, False, cpsm, 96, gqa, **kw)


M4 = dict(merge_ctas=4, merge_from=40)
ONE_PAIR_256 = [d256(132, 2, **M4), d256(132, 2), d256(66, 2, **M4), d256(66, 3, **M4), d256(33, 3)]
EIGHT_PAIRS_256 = [d256(16, 2, gqa=2), d256(16, 3, gqa=2), d256(8, 3, gqa=2), d256(33, 2, gqa=2, cpsm=0)]
ROWS_13 = {
    **{f"g3 4/1 d256 B=1 L={L // 1024}k": (G3, 1, L, None, ONE_PAIR_256) for L in (1024, 8192, 32768)},
    "g3 4/1 d256 B=8 L=8k": (G3, 8, 8192, None, [d256(16, 2), d256(16, 3), d256(8, 3), d256(33, 2, cpsm=0)]),
    **{f"g2 16/8 d256 B=1 L={L // 1024}k": (G2, 1, L, None, EIGHT_PAIRS_256) for L in (1024, 32768)},
    "g2 16/8 d256 B=8 L=8k": (G2, 8, 8192, None, [d256(2, 3, gqa=2), d256(2, 2, gqa=2), d256(1, 3, gqa=2)]),
    "g2 16/8 d256 B=1 L=32k w4096": (model_shape(16, 8, 256, 4096), 1, 32768, 4096, EIGHT_PAIRS_256),
    "g3 4/1 d256 B=32 L=8k w1024": (model_shape(4, 1, 256, 1024), 32, 8192, 1024, [
        d256(4, 3), d256(4, 2), d256(2, 3), d256(8, 2, cpsm=0)]),
    **{f"phi3 32/32 d96 B=1 L={L // 1024}k": (PHI3, 1, L, None, [
        d96(8, 4, 3), d96(8, 3, 2), d96(8, 4, 1), d96(4, 4, 3), d96(16, 3, 1, cpsm=0)]) for L in (1024, 32768)},
    **{f"phi3-tp4 8/8 d96 B=1 L={L // 1024}k": (PHI3_TP4, 1, L, None, [
        d96(33, 3, 1), d96(16, 3, 1), d96(33, 4, 1), d96(16, 4, 1, cpsm=1)]) for L in (1024, 32768)},
    "smol 32/32 d64 B=1 L=1k": (SMOL, 1, 1024, None, [
        C(8, 4, 6, 4, False, 2, 64, 1), C(8, 4, 6, 1, False, 2, 64, 1), C(8, 4, 4, 1, False, 2, 64, 1),
        C(4, 4, 6, 1, False, 2, 64, 1)]),
    # A window past the cluster band (33 slices) on the full-attention rule, Flint's 16/2 heads.
    "16/2 d128 B=8 L=8k w512": (TP2.replace(**SLIDE, sliding_window=512), 8, 8192, 512, [
        C(8, 8, 2, 2, False, 1), C(8, 8, 2, 1, False, 1), C(4, 8, 2, 1, False, 1), C(16, 4, 3, 1, False, 2)]),
}


# Run 14: min_pages 1 (as at <= 8 pairs) in the bands above, where run 13
# found it faster at short contexts (d96 32 pairs, d64 32 pairs, a d128
# window of 512 at 16 pairs); the same rows at 8k check nothing is lost.
QWEN3, PHI3_TP2, OSS = model_shape(16, 8, 128), model_shape(16, 16, 96), model_shape(64, 8, 64)
ROWS_14 = {
    **{f"16/2 d128 B=8 L={L // 1024}k": (TP2.replace(**FULL), 8, L, None, [
        C(8, 8, 2, 2, False, 1), C(8, 8, 2, 1, False, 1)]) for L in (1024, 8192)},
    **{f"qwen3 16/8 d128 B=8 L={L // 1024}k": (QWEN3, 8, L, None, [
        C(4, 4, 3, 2, False, 2, 128, 2), C(4, 4, 3, 1, False, 2, 128, 2)]) for L in (1024, 8192)},
    **{f"phi3-tp2 16/16 d96 B=1 L={L // 1024}k": (PHI3_TP2, 1, L, None, [
        C(16, 4, 3, 3, False, 2, 96, 1), C(16, 4, 3, 1, False, 2, 96, 1), C(8, 4, 4, 1, False, 1, 96, 1)])
       for L in (1024, 32768)},
    **{f"phi3 32/32 d96 B=1 L={L // 1024}k": (PHI3, 1, L, None, [
        C(8, 4, 4, 1, False, 2, 96, 1), C(8, 4, 4, 2, False, 2, 96, 1)]) for L in (1024, 8192)},
    **{f"smol 32/32 d64 B=1 L={L // 1024}k": (SMOL, 1, L, None, [
        C(8, 4, 6, 4, False, 2, 64, 1), C(8, 4, 6, 1, False, 2, 64, 1)]) for L in (8192, 32768)},
    **{f"oss 64/8 d64 B=4 L={L // 1024}k": (OSS, 4, L, None, [
        C(8, 4, 6, 4, False, 2, 64, 8), C(8, 4, 6, 1, False, 2, 64, 8)]) for L in (1024, 8192)},
}

# Run 15: head_dim 64 at 9..16 pairs (gpt-oss 64/8 at B=2), min_pages 4 vs 1.
ROWS = {f"oss 64/8 d64 B=2 L={L // 1024}k": (OSS, 2, L, None, [
    C(16, 4, 4, 4, False, 2, 64, 8), C(16, 4, 4, 1, False, 2, 64, 8)]) for L in (1024, 8192)}


@contextlib.contextmanager
def forced(cfg):
    real = dac.launch_config
    dac.launch_config = lambda **kw: cfg
    try:
        yield
    finally:
        dac.launch_config = real


def _spec(row, i, base, batch):
    return base.replace(name=f"sweep-{row}-{i}", max_batch=batch)


def build(shard: int = 0, shards: int = 1):
    """Compile every candidate (``shard`` of ``shards``: every shards-th one,
    for parallel builds into one cache)."""
    from flintgen.kernels import KERNELS
    from flintgen.kernels.base import Target
    from flintgen.runtime import load_variant

    k, t = KERNELS["decode_attention"], Target("sm_90a", 132)
    jobs = {(base, batch, cfg): (row, i) for row, (base, batch, _, _, cands) in reversed(ROWS.items())
            for i, cfg in reversed(list(enumerate(cands)))}      # rows of one spec at several lengths: once
    jobs = [(row, i, base, batch, cfg) for (base, batch, cfg), (row, i) in reversed(jobs.items())]
    for row, i, base, batch, cfg in jobs[shard::shards]:
        spec = _spec(row, i, base, batch)
        with forced(cfg):
            for v in k.variants(spec, t):
                load_variant(k, spec, v, t)
        print("built", row, cfg, flush=True)


def time_all(only: str = ""):
    from benchmarks.decode_attention import Case
    from benchmarks.harness import time_graph

    print("| row | config (splits, warps, stages, min_pages, cluster, ctas/SM) | µs | vs default |")
    print("|---|---|---|---|")
    for row, (base, batch, L, window, cands) in ROWS.items():
        if only not in row:
            continue
        case = None
        base_us = None
        for i, cfg in enumerate(cands):
            spec = _spec(row, i, base, batch)
            with forced(cfg):
                if case is None:
                    case = Case(spec, batch, [L] * batch, window)
                case.spec = spec
                flintgen.warmup(spec, ["decode_attention"])
                us = min(time_graph(case.flintgen_fn())["median_us"] for _ in range(3))
            base_us = base_us or us
            tag = " (default)" if i == 0 else ""
            print(f"| {row} | {tuple(cfg.as_params().values())}{tag} | {us:.2f} | {us / base_us:.2f}x |",
                  flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", action="store_true")
    ap.add_argument("--only", default="", help="time the rows whose name contains this")
    ap.add_argument("--shard", default="0/1", help="with --build: i/n, every n-th candidate from the i-th")
    a = ap.parse_args()
    if a.build:
        build(*map(int, a.shard.split("/")))
    else:
        time_all(a.only)
