"""Decode attention benchmark: flintgen vs FlashInfer XQA and FA4, on the
flint HND cache, with the read-bandwidth floor measured in the same process.

    python -m benchmarks.decode_attention [--quick] [--runs 3]
    python -m benchmarks.decode_attention --gpt-oss [--runs 1]
    python -m benchmarks.decode_attention --shapes [--runs 3]
    python -m benchmarks.decode_attention --models --group 1|2 [--runs 3]
    python -m benchmarks.decode_attention --models --list          # the row plan, no GPU

``--gpt-oss`` times head_dim 64 with gpt-oss-20b's heads per rank (64/8,
32/4, 8/1: TP 1, 2, 8), window 128 and full attention, B in {1, 8, 64, 256},
L in {1k, 8k, 32k}, and writes decode_attention_gpt_oss.{md,json}. Each
(heads, B, L) cache is allocated for its rows and freed after (B=256 x 32k x
8 kv heads x d64 is 17 GB).

``--models`` times real models' per-rank shapes (benchmarks/models.py: the
table, the rows, the two groups of one GPU run each) and writes
decode_attention_models_g<N>.{md,json}; ``--merge`` joins the groups' JSON
into decode_attention_models.{md,json} on any machine.

Method (as the peer table was timed): 20 identical calls per CUDA graph,
median replay; PDL on wherever a kernel has it (flintgen's kernel always
launches with it). Floor = attended KV bytes / read bandwidth. The whole table
is measured ``--runs`` times in one process; each cell reports the median run
and the spread (max - min) across runs.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

import flintgen
from flintgen.layout import AttentionLayout
from benchmarks.harness import Row, read_bandwidth, time_graph, write_results
from benchmarks.peers import PEER_SOFTCAP, PEERS

FLINT = flintgen.get_preset("flint")
TP2 = FLINT.replace(tp_size=2)                                # 16 q / 2 kv per rank
WIDE = FLINT.replace(num_q_heads=64, num_kv_heads=8)          # 64 / 8

# gpt-oss-20b: hidden 2880, 64 q / 8 kv heads of 64, sinks, window 128.
GPT_OSS = FLINT.replace(name="gpt-oss-20b", hidden_size=2880, num_q_heads=64, num_kv_heads=8, head_dim=64)
GPT_OSS_TP = [GPT_OSS.replace(tp_size=tp) for tp in (1, 2, 8)]
GPT_OSS_BATCHES = (1, 8, 64, 256)
GPT_OSS_LENS = (1024, 8192, 32768)

# Sibling shapes (--shapes): (GQA, head_dim, page) at 2 kv heads per rank.
SHAPES = [(4, 128, 32), (16, 128, 64), (8, 128, 64), (4, 64, 64), (16, 64, 32), (8, 64, 32)]
SHAPE_CASES = [(1, 8192, None), (32, 8192, None), (8, 8192, 128)]   # (B, L, window)


def shape_spec(gqa, head_dim, page):
    return FLINT.replace(name=f"g{gqa}-d{head_dim}-p{page}", num_q_heads=4 * gqa, num_kv_heads=4,
                         head_dim=head_dim, page_size=page, tp_size=2)


# (spec, batch, seq_len, window, goal µs or None, goal % of floor or None)
GOAL_ROWS = [
    (TP2, 1, 1024, None, 4.0, None),
    (TP2, 1, 32768, None, 11.0, None),
    (TP2, 8, 8192, None, 19.0, None),
    (TP2, 8, 8192, 128, 4.0, None),
    (TP2, 128, 8192, None, None, 92.0),
    (WIDE, 1, 32768, None, 36.0, None),
    (WIDE, 32, 8192, 128, 6.0, None),
    (WIDE, 128, 8192, None, None, 92.0),
]


class Case:
    """A paged cache with random contents and a random page permutation."""

    def __init__(self, spec, batch, seq_lens, window, copies=1, seed=0, lean=False, softcap=None):
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.spec, self.window, self.softcap = spec, window, softcap
        hq, hkv, d, page = spec.q_heads_per_rank, spec.kv_heads_per_rank, spec.head_dim, spec.page_size
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        self.max_len = int(max(seq_lens))
        max_blocks = -(-self.max_len // page)
        nblocks = batch * max_blocks
        # ``copies`` caches rotated between calls defeat L2 (4x its 60 MB).
        if lean:    # bf16 straight away: no fp32 temporary twice the cache's size
            self.kvs = [torch.empty(nblocks, hkv, page, 2 * d, dtype=torch.bfloat16, device="cuda").normal_(
                generator=g) for _ in range(copies)]
        else:
            self.kvs = [torch.randn(nblocks, hkv, page, 2 * d, device="cuda", generator=g).bfloat16()
                        for _ in range(copies)]
        self.bts = [torch.randperm(nblocks, device="cuda", generator=g).int().view(batch, max_blocks)
                    for _ in range(copies)]
        self.q = torch.randn(batch, hq, d, device="cuda", generator=g).bfloat16()
        self.sinks = torch.randn(hq, device="cuda", generator=g) if spec.sinks else None
        self.out = torch.empty_like(self.q)
        self.scale = spec.scale
        self.set_window(window)

    def set_window(self, window):
        """Time the same cache with another window (None: full attention)."""
        self.window = window
        attended = sum(min(n, window) if window else n for n in self.seq_lens.tolist())
        spec = self.spec
        lay = AttentionLayout(head_dim=spec.head_dim, gqa=spec.q_heads_per_rank // spec.kv_heads_per_rank,
                              kv_dtype=spec.kv_cache_dtype)
        self.bytes = attended * spec.kv_heads_per_rank * lay.kv_row_bytes  # K | V rows read

    def flintgen_fn(self):
        op = flintgen.get_kernel(self.spec, "decode_attention")
        it = {"i": 0}
        kw = {"softcap": self.softcap} if getattr(self.spec, "attn_logit_softcap", False) else {}

        def fn():
            i = it["i"] = (it["i"] + 1) % len(self.kvs)
            op(self.q, self.kvs[i], self.bts[i], self.seq_lens, self.sinks, self.window, self.scale, self.out, **kw)

        return fn

    def peer_fn(self, name):
        kw = {"softcap": self.softcap} if self.softcap and name in PEER_SOFTCAP else {}
        return PEERS[name](self.q, self.kvs[0], self.bts[0], self.seq_lens, self.sinks, self.window,
                           self.scale, self.max_len, **kw)


def _label(spec):
    return f"{spec.q_heads_per_rank}/{spec.kv_heads_per_rank}"


def measure(case, peers=True, refused=None):
    """µs of flintgen and each peer; ``refused``: flintgen's reason not to
    take the shape, recorded instead of its time (a peer's reason likewise)."""
    res = {"flintgen": refused or time_graph(case.flintgen_fn())["median_us"]}
    if peers:
        for name in PEERS:
            fn, why = case.peer_fn(name)
            try:
                res[name] = time_graph(fn)["median_us"] if fn else why
            except RuntimeError as e:    # e.g. a peer that cannot be captured in a CUDA graph
                res[name] = f"{name} timing failed: {type(e).__name__}: {e}"
    return res


def summarize(per):
    """Median over runs of flintgen and each peer, with spreads; a peer that
    failed records its error instead. ``per``: one ``measure`` dict per run.
    ``extra["beats_peers_beyond_spread"]``: flintgen's median + both spreads
    is below every timed peer's median. Where flintgen refused the shape the
    median is None and its reason is ``extra["flintgen_error"]``."""
    peers, extra = {}, {}
    for name in ("flintgen", *PEERS):
        vals = [p[name] for p in per]
        if all(isinstance(v, float) for v in vals):
            peers[name] = statistics.median(vals)
            extra["spread_us" if name == "flintgen" else f"{name}_spread_us"] = max(vals) - min(vals)
        else:
            extra[f"{name}_error"] = next(v for v in vals if not isinstance(v, float))
    med = peers.pop("flintgen", None)
    extra["beats_peers_beyond_spread"] = med is not None and all(
        med + extra["spread_us"] + extra[f"{n}_spread_us"] < peers[n] for n in peers)
    return med, peers, extra


def _precompile(plan):
    """Compile the (spec, batch, sliding) variants of ``plan`` in parallel
    processes before timing (a first call would otherwise compile inline)."""
    import concurrent.futures as cf
    import multiprocessing

    from flintgen import cache, toolchain
    from flintgen.cli import _build_one
    from flintgen.kernels import get_def

    kdef, target = get_def("decode_attention"), toolchain.resolve_target()
    todo = {}
    for spec, b, sliding in plan:
        v = kdef.bind(spec, target, lambda v: None)._variants[sliding][b]
        todo.setdefault(v.name, (spec, v))
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=max(1, (os.cpu_count() or 2) - 1), mp_context=ctx) as pool:
        for f in [pool.submit(_build_one, spec, "decode_attention", v, target, cache.default_root())
                  for spec, v in todo.values()]:
            f.result()


def gpt_oss(runs, bw):
    """The --gpt-oss table: one cache per (heads, B, L), timed with window 128
    and full attention, ``runs`` times, then freed."""
    _precompile([(s, b, sl) for s in GPT_OSS_TP for b in GPT_OSS_BATCHES for sl in (True, False)])
    rows = []
    for spec in GPT_OSS_TP:
        for b in GPT_OSS_BATCHES:
            for L in GPT_OSS_LENS:
                case = Case(spec, b, [L] * b, None, lean=True, seed=b + L)
                for window in (128, None):
                    case.set_window(window)
                    med, peers, extra = summarize([measure(case) for _ in range(runs)])
                    # A peer that failed counts as not beaten.
                    beats = extra["beats_peers_beyond_spread"] and len(peers) == len(PEERS)
                    extra["beats_peers_beyond_spread"] = beats
                    rows.append(Row({"q/kv heads": _label(spec), "B": b, "L": L, "window": window or "—",
                                     "beats peers": "yes" if beats else "NO",
                                     "spread µs": f"{extra['spread_us']:.2f}"},
                                    med, case.bytes / bw * 1e6, peers, extra))
                    print(rows[-1].case, f"{rows[-1].flintgen_us:.2f} us", peers, flush=True)
                del case
                torch.cuda.empty_cache()
    print(write_results("decode_attention_gpt_oss", rows, bw,
                        f"gpt-oss-20b heads per rank (TP 1 / 2 / 8), head_dim 64, sinks on, 16-token pages "
                        f"permuted; median of {runs} run(s) and spread (max - min) per implementation. flintgen's "
                        "head_dim-64 launch rule is derived from the head_dim-128 measurements; its one-pair "
                        "choice (8/1, B=1) is measured (decode_attention_sweep.md). A row is won when "
                        "flintgen's median + both spreads is below the peer's median."))
    won = sum(r.extra["beats_peers_beyond_spread"] for r in rows)
    print(f"flintgen beats both peers beyond the spread on {won} of {len(rows)} rows")
    for r in rows:
        for k, v in r.extra.items():
            if k.endswith("_error"):
                print(r.case, k, v)


def shapes(runs, bw):
    """The --shapes table: sibling shapes (GQA 4 / 16, head_dim 64, pages of
    32 / 64) with the heuristics' choice, against the floor and both peers."""
    _precompile([(shape_spec(*sh), b, w is not None) for sh in SHAPES for b, _, w in SHAPE_CASES])
    rows = []
    for sh in SHAPES:
        spec = shape_spec(*sh)
        for b, L, window in SHAPE_CASES:
            case = Case(spec, b, [L] * b, window, seed=b + L)
            med, peers, extra = summarize([measure(case) for _ in range(runs)])
            beats = extra["beats_peers_beyond_spread"]
            cfg = flintgen.get_kernel(spec, "decode_attention").config(b, window is not None)
            rows.append(Row({"GQA": sh[0], "head_dim": sh[1], "page": sh[2], "q/kv heads": _label(spec), "B": b,
                             "L": L, "window": window or "—", "config": str(tuple(cfg.as_params().values())),
                             "beats peers": "yes" if beats else "NO"},
                            med, case.bytes / bw * 1e6, peers, extra))
            print(rows[-1].case, f"{med:.2f} us", peers, flush=True)
            del case
    print(write_results("decode_attention_shapes", rows, bw,
                        f"Sibling shapes at 2 kv heads per rank, sinks on, pages permuted; median of {runs} runs. "
                        "config = (splits, warps, stages, min_pages, cluster, ctas/SM) the heuristics pick. "
                        "A peer that rejects a shape has no time. Won = flintgen's median + both spreads below "
                        "the peer's median."))
    for r in rows:
        for k, v in r.extra.items():
            if k.endswith("_error"):
                print(r.case["GQA"], r.case["head_dim"], r.case["page"], r.case["B"], k, v)


def _short(why, n=72):
    """First line of a refusal, cut for a table cell."""
    line = str(why).strip().splitlines()[0] if why else ""
    return (line[:n] + "…" if len(line) > n else line).replace("|", "/")


def models_table(name, rows, runs, bw):
    """The --models table (benchmarks/models.py): each row on its own cache,
    timed ``runs`` times back to back, then freed. Won = flintgen's median +
    both spreads below XQA's median; a refusal (flintgen's, XQA's, FA4's) is
    the cell's note instead of a time."""
    from benchmarks import models as M
    from flintgen import toolchain

    status = [M.flintgen_status(r, toolchain.resolve_target()) for r in rows]
    _precompile([(s, r.batch, r.window is not None) for r, (s, _) in zip(rows, status) if s])
    out = []
    for r, (spec, why) in zip(rows, status):
        m = r.model
        case = Case(spec or m, r.batch, [r.seq_len] * r.batch, r.window, lean=True, seed=r.batch + r.seq_len,
                    softcap=m.softcap)
        med, peers, extra = summarize([measure(case, refused=why) for _ in range(runs)])
        floor = case.bytes / bw * 1e6
        xqa = peers.get("XQA")
        beats = None if med is None or xqa is None else med + extra["spread_us"] + extra["XQA_spread_us"] < xqa
        met = None if med is None or not r.floor_goal else 100 * floor / med >= M.FLOOR_GOAL_PCT
        notes = [f"{k[:-6]}: {_short(v)}" for k, v in extra.items() if k.endswith("_error")]
        if m.softcap and xqa is not None:
            notes.append("XQA without softcap (it has none)")
        if m.note and r.seq_len == 1024:
            notes.append(m.note)
        extra.update(beats_xqa_beyond_spread=beats, floor_goal_met=met, read_bandwidth_TBps=bw / 1e12,
                     softcap=m.softcap, flintgen_softcap=bool(getattr(spec, "attn_logit_softcap", False)))
        yes = {None: "—", True: "yes", False: "NO"}
        won = "flintgen refused" if med is None else "XQA refused" if xqa is None else yes[beats]
        out.append(Row({"model": m.name, "q/kv heads": m.label, "head_dim": m.head_dim, "B": r.batch,
                        "L": r.seq_len, "window": r.window or "—",
                        "softcap": f"{m.softcap:g}" if m.softcap else "—", "beats XQA": won,
                        f">= {M.FLOOR_GOAL_PCT:g}% floor": yes[met] if r.floor_goal else "",
                        "spread µs": f"{extra['spread_us']:.2f}" if med is not None else "—",
                        "notes": "; ".join(notes)},
                       med, floor, peers, extra))
        print(m.name, r.describe(), "flintgen", "refused" if med is None else f"{med:.2f} us", peers, flush=True)
        del case
        torch.cuda.empty_cache()
    print(write_results(name, out, bw,
                        f"Real models' heads per rank (TP 1), benchmarks/models.py; sinks off, 16-token pages "
                        f"permuted, full attention unless a window is given (the Gemmas' B=32 rows: window "
                        f"1024, their spec's sliding_window set to 1024). Median of {runs} runs and spread (max - min) per "
                        "implementation. beats XQA: flintgen's median + both spreads below XQA's median. Floor "
                        "= attended K|V bytes of the real head_dim / read bandwidth (padding costs no bytes); "
                        f">= {M.FLOOR_GOAL_PCT:g}% of it is asked at B={M.FLOOR_GOAL_BATCH} x 8k. Gemma-2: "
                        "softcap 50 for flintgen and FA4; XQA has none. A refusal is "
                        "the row's note (full text in the JSON's extra)."))
    ran = [r for r in out if r.extra["beats_xqa_beyond_spread"] is not None]
    print(f"flintgen beats XQA beyond the spread on {sum(r.extra['beats_xqa_beyond_spread'] for r in ran)} "
          f"of {len(ran)} rows where both ran; >= {M.FLOOR_GOAL_PCT:g}% of the floor on "
          f"{sum(bool(r.extra['floor_goal_met']) for r in out)} of {sum(r.case['B'] == 128 for r in out)} "
          f"B={M.FLOOR_GOAL_BATCH} rows")
    for r in out:
        for k, v in r.extra.items():
            if k.endswith("_error"):
                print(r.case["model"], r.case["B"], r.case["L"], k, _short(v, 300))


def models_main(args):
    """--models: --list (no GPU), --merge (no GPU), or one group / --only."""
    from benchmarks import models as M
    from flintgen import toolchain

    if args.list:
        print(M.listing(toolchain.resolve_target(cpu_default=True)))
        return
    if args.merge:
        results = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
        rows, bw, meta, notes = M.merge(results)
        print(write_results("decode_attention_models", rows, bw, notes, out_dir=results, meta=meta))
        return
    name, models = M.select(args.group, args.only)
    if args.prebuild:
        n = M.prebuild(M.plan(models), args.prebuild, toolchain.resolve_target(arch="sm_90a", num_sms=132))
        print(f"prebuilt {n} decode-attention variants into {args.prebuild}")
        return
    models_table(name, M.plan(models), args.runs or 3, read_bandwidth())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=None, help="table repeats (default 3; --gpt-oss: 1)")
    ap.add_argument("--quick", action="store_true", help="goal rows only, one run")
    ap.add_argument("--gpt-oss", action="store_true",
                    help="gpt-oss-20b head_dim-64 table (decode_attention_gpt_oss.{md,json}) instead")
    ap.add_argument("--shapes", action="store_true",
                    help="sibling-shape table (decode_attention_shapes.{md,json}) instead")
    ap.add_argument("--models", action="store_true",
                    help="real models' shapes (benchmarks/models.py) vs XQA / FA4: with --group N|all or --only")
    ap.add_argument("--group", help="--models: the group of rows to time (1, 2; all = every row)")
    ap.add_argument("--only", help="--models: comma-separated model names instead of a group")
    ap.add_argument("--list", action="store_true", help="--models: print the row plan and exit (no GPU)")
    ap.add_argument("--prebuild", metavar="DIR",
                    help="--models: compile the group's flintgen variants for sm_90a (132 SMs) into cache root "
                         "DIR and exit (no GPU; carry DIR with the aot stage)")
    ap.add_argument("--merge", action="store_true",
                    help="--models: join results/decode_attention_models_g*.json into decode_attention_models")
    args = ap.parse_args()
    if args.models:
        models_main(args)
        return
    if args.gpt_oss:
        gpt_oss(args.runs or 1, read_bandwidth())
        return
    if args.shapes:
        shapes(args.runs or 3, read_bandwidth())
        return
    args.runs = args.runs or 3
    for spec in (TP2, WIDE):
        flintgen.warmup(spec, ["decode_attention"])
    bw = read_bandwidth()
    cases = [(f"{_label(s)}", b, L, w, gu, gp, Case(s, b, [L] * b, w)) for s, b, L, w, gu, gp in GOAL_ROWS]
    runs = []
    for _ in range(1 if args.quick else args.runs):
        runs.append([measure(c[-1]) for c in cases])
    rows = []
    for i, (heads, b, L, w, gu, gp, case) in enumerate(cases):
        med, peers, extra = summarize([r[i] for r in runs])
        floor = case.bytes / bw * 1e6
        extra["goal"] = f"<= {gu} us" if gu else f">= {gp}% of floor"
        met = med <= gu if gu else 100 * floor / med >= gp
        beats = extra["beats_peers_beyond_spread"]
        extra["goal_met"] = met
        rows.append(Row({"q/kv heads": heads, "B": b, "L": L, "window": w or "—", "goal": extra["goal"],
                         "met": "yes" if met else "NO", "beats peers": "yes" if beats else "NO"},
                        med, floor, peers, extra))
    print(write_results("decode_attention", rows, bw,
                        f"Median of {len(runs)} runs; sinks on; flint HND cache; pages permuted."))
    for r in rows:
        for k, v in r.extra.items():
            if k.endswith("_error"):
                print(r.case["q/kv heads"], r.case["B"], r.case["L"], k, v)

    if not args.quick:
        extra_rows = []
        for label, case in [
            ("rotated 5 caches (> 4x L2), 16/2 B=8 L=8k", Case(TP2, 8, [8192] * 8, None, copies=5)),
            ("mixed seq_lens 16/2 B=32 (1..16k)", Case(TP2, 32, [1 + (i * 4093) % 16384 for i in range(32)], None)),
        ]:
            m = measure(case)
            extra_rows.append(Row({"case": label}, m["flintgen"], case.bytes / bw * 1e6,
                                  {k: v for k, v in m.items() if k != "flintgen" and isinstance(v, float)}))
        print(write_results("decode_attention_extra", extra_rows, bw, "Reported without a goal."))


if __name__ == "__main__":
    main()
