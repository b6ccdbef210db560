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

G16 = shape_spec(16, 128, 64).replace(**FULL)     # 32 q / 2 kv per rank: two head tiles
G16_D64 = shape_spec(16, 64, 32).replace(**FULL)

# row -> (spec, batch, seq_len, window, candidates); the first candidate is the default.
# Several CTAs merge only from a number of active splits on (merge_from, a
# runtime threshold: active splits grow with seq_len at a fixed launch shape).
# Run 8 (results/decode_attention_sweep.md): with its partial loads issued
# before the m / l staging, 4 mergers beat the last CTA alone at 64-66 active
# splits (16/2 B=1 L=8k / 32k) and lose at 8 (L=1k) and 16 (64/8 B=1).
# Lengths 1k..32k give 8, 16, 32, 48, 64, 66 active splits of 66.
ALONE, SEVERAL, SWITCH = (C(66, 8, 2, 1, False, 1), C(66, 8, 2, 1, False, 1, merge_ctas=4),
                          C(66, 8, 2, 1, False, 1, merge_ctas=4, merge_from=24))
ROWS = {
    **{f"16/2 B=1 L={L // 1024}k": (TP2.replace(**FULL), 1, L, None, [ALONE, SEVERAL, SWITCH])
       for L in (1024, 2048, 4096, 6144, 8192, 32768)},
    "16/2 B=2 L=32k": (TP2.replace(**FULL), 2, 32768, None, [
        C(33, 8, 2, 1, False, 1), C(33, 8, 2, 1, False, 1, merge_ctas=4)]),
    "64/8 B=1 L=32k": (WIDE.replace(**FULL), 1, 32768, None, [
        C(16, 8, 2, 1, False, 1), C(16, 8, 2, 1, False, 1, merge_ctas=4)]),
    **{f"g16 d128 B=1 L={L // 1024}k": (G16, 1, L, None, [
        C(66, 8, 2, 1, False, 1, 128, 16, merge_ctas=4), C(66, 8, 2, 1, False, 1, 128, 16, merge_ctas=4, merge_from=24),
        C(66, 8, 2, 1, False, 1, 128, 16)]) for L in (1024, 4096, 32768)},
}


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


def build():
    from flintgen.kernels import KERNELS
    from flintgen.kernels.base import Target
    from flintgen.runtime import load_variant

    k, t = KERNELS["decode_attention"], Target("sm_90a", 132)
    for row, (base, batch, _, _, cands) in ROWS.items():
        for i, cfg in enumerate(cands):
            spec = _spec(row, i, base, batch)
            with forced(cfg):
                for v in k.variants(spec, t):
                    load_variant(k, spec, v, t)
            print("built", row, cfg)


def time_all():
    from benchmarks.decode_attention import Case
    from benchmarks.harness import time_graph

    print("| row | config (splits, warps, stages, min_pages, cluster, ctas/SM) | µs | vs default |")
    print("|---|---|---|---|")
    for row, (base, batch, L, window, cands) in ROWS.items():
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
    a = ap.parse_args()
    build() if a.build else time_all()
