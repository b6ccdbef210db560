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
import time

import flintgen
from flintgen.configs import decode_attention_config as dac

# Runs 13-18 (their rows and numbers: results/decode_attention_sweep.md) measured the head_dim-96 / -256 rules,
# long windows, min_pages above 8 pairs, the fp8 ring slots and CTAs per SM; run 19 releasing PDL dependents
# at the kernel's entry (``early_release``) against after K/V streaming (``_release_pair``).
# --passes times every candidate once per pass, interleaved.


def _release_pair(spec, batch, window):
    """The op's config of the row (early_release as the rule has it), then the other release."""
    from dataclasses import replace

    gqa = spec.q_heads_per_rank // spec.kv_heads_per_rank
    cfg = dac.launch_config(batch=batch, num_kv_heads=spec.kv_heads_per_rank, sliding=window is not None,
                            window=window, head_dim=spec.head_dim, gqa=gqa, page_size=spec.page_size, num_sms=132,
                            kv_dtype=spec.kv_cache_dtype)
    return [cfg, replace(cfg, early_release=not cfg.early_release)]


# Run 24's candidate for 16/2 B = 1 (also stamped by decode_attention_timeline): 132 four-warp splits, 2 per SM.
B1_FOUR_WARPS = dac.DecodeAttentionConfig(num_splits=132, num_warps=4, num_stages=2, min_pages=1, cluster=False,
                                          ctas_per_sm=2, head_dim=128, gqa=8, merge_ctas=4,
                                          merge_from=dac.MERGE_FROM_ACTIVE)


def _rows():
    """Run 24 (run on the H200 in session 38: no candidate faster: 132 splits 1k 5.27 -> 5.56-5.68 us, 4k-32k +1.8-2.9;
    decode_attention_sweep.md): the 16/2 B = 1 goal row (1k <= 4 us) with 4-warp CTAs. The
    timeline (decode_attention_timeline.md run 4) puts 0.9 us of B = 1 x 1k's 5.2 in the CTA combine over 8 warps
    and 0.8-1.9 in publishing and merging the partials; sweep run 3 had (16 splits, 4 warps, 2 CTAs per SM) 0.5-0.7
    us faster at 1k but 1.5-2.6x slower at 8k / 32k (too few warps streaming). 132 splits of 4 warps, 2 CTAs per
    SM, keep today's warps per pair at 32k (528) while 1k activates 16 four-warp splits (64 // 4 slices) like run 3's
    winner: the question is what the 132 partials cost at 8k / 32k (4 or 8 merging CTAs from 40 active splits)
    against what the smaller CTA combine saves at 1k. Same launch shape at every length (one config per batch)."""
    from dataclasses import replace as rp

    from benchmarks.decode_attention import GOAL_ROWS

    spec, batch, _, window, _, _ = GOAL_ROWS[0]
    op, _ = _release_pair(spec, batch, window)
    four = B1_FOUR_WARPS
    cands = [op, four, rp(four, merge_ctas=8), rp(four, num_stages=3), rp(four, num_splits=66)]
    return {f"16/2 B=1 L={L // 1024}k": (spec, batch, L, window, cands) for L in (1024, 4096, 8192, 32768)}


ROWS = _rows()


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


ROTATE_BF16 = False   # --rotate: bf16 caches rotated beyond L2 (_case)


def time_all(only: str = "", passes: int = 0, xqa: bool = False):
    from benchmarks.harness import time_graph

    if passes:
        return time_passes(only, passes, xqa)
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
                case = case or _case(spec, batch, L, window)
                us = min(time_graph(_candidate_fn(case, spec))["median_us"] for _ in range(3))
            base_us = base_us or us
            tag = " (default)" if i == 0 else ""
            print(f"| {row} | {tuple(cfg.as_params().values())}{tag} | {us:.2f} | {us / base_us:.2f}x |",
                  flush=True)


def _case(spec, batch, L, window, rotate_bf16=None):
    """The row's inputs: e4m3 caches rotated as --fp8 rotates them (beyond L2), else bf16 ones (``rotate_bf16``,
    None: ROTATE_BF16, --rotate: as many copies as an e4m3 row of the spec would rotate, else one)."""
    import torch

    from benchmarks.decode_attention import Case, Fp8Case, fp8_copies

    copies = fp8_copies(spec, batch, L, window, torch.cuda.get_device_properties(0).L2_cache_size)
    if spec.kv_cache_dtype == "fp8_e4m3":
        return Fp8Case(spec.replace(kv_cache_dtype="bf16"), batch, [L] * batch, window, copies=copies)
    rotate = ROTATE_BF16 if rotate_bf16 is None else rotate_bf16
    return Case(spec, batch, [L] * batch, window, copies=copies if rotate else 1)


def _candidate_fn(case, spec):
    """The op of ``spec`` (a candidate's, inside its ``forced`` config) on the case's caches, warmed up."""
    flintgen.warmup(spec, ["decode_attention"])
    if spec.kv_cache_dtype == "fp8_e4m3":
        case.spec8 = spec
        return case.fp8_fn()
    case.spec = spec
    return case.flintgen_fn()


def time_passes(only: str, passes: int, xqa: bool = False):
    """Every candidate of a row once per pass (a CUDA-graph replay median each), the candidates interleaved
    within a pass; per candidate the passes' values, their median and spread (max - min). ``xqa``: XQA-fp8
    on the same caches as one more candidate of fp8 rows (whether a drift over the passes is everyone's)."""
    from benchmarks.harness import time_graph

    print("| row | config (splits, warps, stages, min_pages, cluster, ctas/SM) | passes µs | median µs | spread µs |")
    print("|---|---|---|---|---|")
    for row, (base, batch, L, window, cands) in ROWS.items():
        if only not in row:
            continue
        case, runs, peer = None, [[] for _ in cands] + [[]], None
        tails = [[] for _ in cands] + [[]]      # (p10, p90) of each pass's replays
        for _ in range(passes):
            for i, cfg in enumerate(cands):
                spec = _spec(row, i, base, batch)
                with forced(cfg):
                    case = case or _case(spec, batch, L, window)
                    r = time_graph(_candidate_fn(case, spec))
                    runs[i].append(r["median_us"])
                    tails[i].append((r["p10_us"], r["p90_us"]))
            if xqa and hasattr(case, "kv8s"):
                if peer is None:
                    peer, why = case.xqa_fn()
                    if peer is None:
                        raise SystemExit(f"sweep --xqa: XQA-fp8 refused {row}: {why}")
                r = time_graph(peer)
                runs[-1].append(r["median_us"])
                tails[-1].append((r["p10_us"], r["p90_us"]))
            print("pass", len(runs[0]), time.strftime("%H:%M:%S"), " ".join(f"{v[-1]:.2f}" for v in runs if v),
                  flush=True)
        if runs[-1]:
            v = sorted(runs[-1])
            print(f"| {row} | XQA-fp8 | {_passes(runs[-1], tails[-1])} | {v[len(v) // 2]:.2f} "
                  f"| {v[-1] - v[0]:.2f} |", flush=True)
        for i, cfg in enumerate(cands):
            v = sorted(runs[i])
            tag = " (default)" if i == 0 else ""
            print(f"| {row} | {tuple(cfg.as_params().values())}{tag} | {_passes(runs[i], tails[i])} "
                  f"| {v[len(v) // 2]:.2f} | {v[-1] - v[0]:.2f} |", flush=True)


def _passes(medians, tails):
    """Each pass's median, with its replays' p10-p90."""
    return " / ".join(f"{m:.2f} ({t[0]:.0f}-{t[1]:.0f})" for m, t in zip(medians, tails))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", action="store_true")
    ap.add_argument("--only", default="", help="time the rows whose name contains this")
    ap.add_argument("--shard", default="0/1", help="with --build: i/n, every n-th candidate from the i-th")
    ap.add_argument("--passes", type=int, default=0,
                    help="time every candidate once per pass, interleaved, and print each pass (else the best of 3)")
    ap.add_argument("--xqa", action="store_true", help="with --passes: XQA-fp8 as one more candidate of fp8 rows")
    ap.add_argument("--rotate", action="store_true", help="bf16 caches rotated beyond L2 (as --fp8 rotates e4m3 ones)")
    a = ap.parse_args()
    ROTATE_BF16 = a.rotate
    if a.build:
        build(*map(int, a.shard.split("/")))
    else:
        time_all(a.only, a.passes, a.xqa)
