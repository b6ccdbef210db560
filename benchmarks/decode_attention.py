"""Decode attention benchmark: flintgen vs FlashInfer XQA and FA4, on the
flint HND cache, with the read-bandwidth floor measured in the same process.

    python -m benchmarks.decode_attention [--quick] [--runs 3]
    python -m benchmarks.decode_attention --gpt-oss [--runs 1]
    python -m benchmarks.decode_attention --shapes [--runs 3]
    python -m benchmarks.decode_attention --models --group 1|2 [--runs 3]
    python -m benchmarks.decode_attention --models --list          # the row plan, no GPU
    python -m benchmarks.decode_attention --fp8 [--runs 3]
    python -m benchmarks.decode_attention --fp8 --list             # the row plan, no GPU
    python -m benchmarks.decode_attention --fp8 --prebuild DIR     # its variants for sm_90a, no GPU

``--gpt-oss`` times head_dim 64 with gpt-oss-20b's heads per rank (64/8,
32/4, 8/1: TP 1, 2, 8), window 128 and full attention, B in {1, 8, 64, 256},
L in {1k, 8k, 32k}, and writes decode_attention_gpt_oss.{md,json}. Each
(heads, B, L) cache is allocated for its rows and freed after (B=256 x 32k x
8 kv heads x d64 is 17 GB).

``--models`` times real models' per-rank shapes (benchmarks/models.py: the
table, the rows, the two groups of one GPU run each) and writes
decode_attention_models_g<N>.{md,json}; ``--merge`` joins the groups' JSON
into decode_attention_models.{md,json} on any machine.

``--fp8`` times the e4m3 KV cache (``FP8_ROWS``: the goal rows, sinks on,
and 12 gpt-oss-20b rows) three ways on the same paged cache contents
(``Fp8Case``): flintgen's fp8 kernel (k_scale = v_scale = ``FP8_KV_SCALE``,
one-element device tensors), flintgen's bf16 kernel on the dequantized cache
(a bf16 copy, exact: the scale is a power of two; same block tables), and
FlashInfer XQA on the e4m3 cache (benchmarks/peers.py ``xqa_fp8``: one kv
scale, hence k_scale = v_scale). It reports the error of both fp8 kernels
against the fp64 reference on the dequantized cache (over the first
``FP8_REF_REQUESTS`` requests), the fp8 floor (attended e4m3 K|V bytes / read
bandwidth) and writes decode_attention_fp8.{md,json}. Each row's cache is
allocated for it (``fp8_copies`` copies rotated between calls, see there)
and freed after.

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
from benchmarks.peers import PEER_SOFTCAP, PEERS, xqa_fp8
from flintgen.references.decode_attention import (
    decode_attention_ref,
    dequantize_kv,
    head_errors,
    quantize_kv,
    rel_error,
)

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

# --fp8: gpt-oss-20b at TP 1 (64/8) and TP 8 (8/1), B in {1, 8, 64}: window
# 128 on the 1k rows (its sliding layers), full attention on the 8k ones.
GPT_OSS_FP8_ROWS = [(spec, b, L, 128 if L == 1024 else None)
                    for spec in (GPT_OSS_TP[0], GPT_OSS_TP[2]) for b in (1, 8, 64) for L in (1024, 8192)]
FP8_ROWS = [(s, b, L, w) for s, b, L, w, _, _ in GOAL_ROWS] + GPT_OSS_FP8_ROWS   # (bf16 spec, B, L, window)
FP8_KV_SCALE = 2.0 ** -6     # k_scale = v_scale: N(0, 1) values / 2^-6 stay within e4m3's 448 to 7 sigma
FP8_REF_REQUESTS = 8         # the fp64 reference covers the first 8 requests of a row
ROTATE_L2 = 4                # copies enough that one graph replay reads 4x L2 where it can ...
ROTATE_MAX_COPIES = 20       # ... a graph holds 20 calls: more copies would not be read ...
ROTATE_MEM_BYTES = 24 << 30  # ... and at most 24 GB of bf16 + fp8 caches
NOMINAL_L2_BYTES = 50 << 20  # --fp8 --list without a GPU: the H200's L2 (a GPU run reads its own)


def fp8_spec(spec):
    """The e4m3-cache spec of a bf16 one."""
    return spec.replace(kv_cache_dtype="fp8_e4m3")


def kv_bytes(spec, seq_lens, window, kv_dtype=None):
    """K | V bytes the requests of ``seq_lens`` attend (``window`` None:
    all), in the spec's cache dtype or ``kv_dtype``."""
    attended = sum(min(n, window) if window else n for n in seq_lens)
    lay = AttentionLayout(head_dim=spec.head_dim, gqa=spec.q_heads_per_rank // spec.kv_heads_per_rank,
                          kv_dtype=kv_dtype or spec.kv_cache_dtype)
    return attended * spec.kv_heads_per_rank * lay.kv_row_bytes


def fp8_copies(spec, batch, seq_len, window, l2_bytes):
    """Caches an --fp8 row rotates between calls: enough that the 20 calls of
    a graph replay read ROTATE_L2 x L2 of e4m3 K|V, at most 20 and at most
    ROTATE_MEM_BYTES of caches (bf16 + e4m3, whole: a windowed row allocates
    all L tokens). Short rows (B=1 x 1k, windows) stay below L2 even at 20
    copies: partly L2-resident, for every implementation alike."""
    attended = kv_bytes(spec, [seq_len] * batch, window, "fp8_e4m3")
    per_copy = 3 * kv_bytes(spec, [seq_len] * batch, None, "fp8_e4m3")    # bf16 copy + e4m3 cache
    want = -(-ROTATE_L2 * l2_bytes // max(attended, 1))
    return max(1, min(want, ROTATE_MAX_COPIES, ROTATE_MEM_BYTES // per_copy))


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
        self.bytes = kv_bytes(self.spec, self.seq_lens.tolist(), window)  # K | V rows read

    def flintgen_fn(self, spec=None, kvs=None, **kw):
        """flintgen's op of ``spec`` (default the case's) on ``kvs`` (default
        its caches), rotated between calls; ``kw``: more keyword arguments
        (an fp8 cache's scales). ``fn.call(i)`` runs cache i, returns out."""
        spec, kvs = spec or self.spec, kvs or self.kvs
        op = flintgen.get_kernel(spec, "decode_attention")
        it = {"i": 0}
        kw = {**({"softcap": self.softcap} if getattr(spec, "attn_logit_softcap", False) else {}), **kw}

        def call(i):
            op(self.q, kvs[i], self.bts[i], self.seq_lens, self.sinks, self.window, self.scale, self.out, **kw)
            return self.out

        def fn():
            i = it["i"] = (it["i"] + 1) % len(kvs)
            call(i)

        fn.call = call
        return fn

    def peer_fn(self, name):
        kw = {"softcap": self.softcap} if self.softcap and name in PEER_SOFTCAP else {}
        return PEERS[name](self.q, self.kvs[0], self.bts[0], self.seq_lens, self.sinks, self.window,
                           self.scale, self.max_len, **kw)


class Fp8Case(Case):
    """A ``Case`` whose caches are quantized to e4m3 (``quantize_kv``, vLLM's
    write) with k_scale = v_scale = ``kv_scale``: ``kv8s``, the e4m3 caches,
    and ``kvs``, overwritten with their dequantized values in bf16 (exact for
    a power-of-two scale: e4m3's 4 significant bits times 2^k), the same
    block tables ``bts``. ``spec`` is the bf16 spec, ``spec8`` the fp8 one;
    ``bytes8``: attended e4m3 K|V bytes (``bytes``: bf16's)."""

    def __init__(self, spec, batch, seq_lens, window, kv_scale=FP8_KV_SCALE, copies=1, seed=0):
        super().__init__(spec, batch, seq_lens, window, copies=copies, seed=seed, lean=True)
        self.spec8, self.kv_scale = fp8_spec(spec), kv_scale
        self.k_scale = torch.tensor([kv_scale], dtype=torch.float32, device="cuda")
        self.v_scale = torch.tensor([kv_scale], dtype=torch.float32, device="cuda")
        step = max(1, (1 << 26) // self.kvs[0][0].numel())     # blocks per chunk: fp32 / fp64 temporaries bounded
        self.kv8s = []
        for kv in self.kvs:
            kv8 = torch.empty(kv.shape, dtype=torch.float8_e4m3fn, device="cuda")
            for i in range(0, kv.shape[0], step):
                kv8[i:i + step] = quantize_kv(kv[i:i + step], kv_scale, kv_scale)
                kv[i:i + step] = dequantize_kv(kv8[i:i + step], kv_scale, kv_scale)
            self.kv8s.append(kv8)

    def set_window(self, window):
        super().set_window(window)
        self.bytes8 = kv_bytes(self.spec, self.seq_lens.tolist(), window, "fp8_e4m3")

    def fp8_fn(self):
        return self.flintgen_fn(self.spec8, self.kv8s, k_scale=self.k_scale, v_scale=self.v_scale)

    def xqa_fn(self):
        return xqa_fp8(self.q, self.kv8s, self.bts, self.seq_lens, self.sinks, self.window, self.scale,
                       self.max_len, self.kv_scale)

    def errors(self, outs, requests=FP8_REF_REQUESTS):
        """Relative error (and max over (request, head)) of each output [B,
        Hq, D] of cache 0 in ``outs`` against the fp64 reference on the
        dequantized cache, over the first ``requests`` requests: ({name:
        (err, max head err)}, requests used). The reference reads only those
        requests' blocks, dequantized in fp64."""
        n = min(requests, self.q.shape[0])
        ids = self.bts[0][:n].flatten().long()
        kv = dequantize_kv(self.kv8s[0].view(torch.uint8)[ids], self.kv_scale, self.kv_scale)
        bt = torch.arange(ids.numel(), dtype=torch.int32, device="cuda").view(n, -1)
        ref = decode_attention_ref(self.q[:n], kv, bt, self.seq_lens[:n], self.sinks, self.window, self.scale)
        return {k: (rel_error(o[:n], ref), float(head_errors(o[:n], ref).max())) for k, o in outs.items()}, n


def _label(spec):
    return f"{spec.q_heads_per_rank}/{spec.kv_heads_per_rank}"


def measure(case, peers=True, refused=None):
    """µs of flintgen and each peer; ``refused``: flintgen's reason not to
    take the shape, recorded instead of its time (a peer's reason likewise)."""
    res = {"flintgen": refused or time_graph(case.flintgen_fn())["median_us"]}
    if peers:
        for name in PEERS:
            res[name] = timed(name, *case.peer_fn(name))
    return res


def timed(name, fn, why=None):
    """µs of ``fn`` (time_graph's median), or ``why`` where there is no fn,
    or the timing's error (e.g. a peer that cannot be captured in a CUDA graph)."""
    if not fn:
        return why
    try:
        return time_graph(fn)["median_us"]
    except RuntimeError as e:
        return f"{name} timing failed: {type(e).__name__}: {e}"


def summarize(per, names=None):
    """Median over runs of flintgen and each peer, with spreads; a peer that
    failed records its error instead. ``per``: one ``measure`` dict per run;
    ``names``: its keys, "flintgen" first (default flintgen and PEERS).
    ``extra["runs_us"]`` / ``extra[f"{name}_runs_us"]``: each run's µs in run order.
    ``extra["beats_peers_beyond_spread"]``: flintgen's median + both spreads
    is below every timed peer's median. Where flintgen refused the shape the
    median is None and its reason is ``extra["flintgen_error"]``."""
    peers, extra = {}, {}
    for name in names or ("flintgen", *PEERS):
        vals = [p[name] for p in per]
        if all(isinstance(v, float) for v in vals):
            peers[name] = statistics.median(vals)
            extra["spread_us" if name == "flintgen" else f"{name}_spread_us"] = max(vals) - min(vals)
            extra["runs_us" if name == "flintgen" else f"{name}_runs_us"] = vals     # in run order
        else:
            extra[f"{name}_error"] = next(v for v in vals if not isinstance(v, float))
    med = peers.pop("flintgen", None)
    extra["beats_peers_beyond_spread"] = med is not None and all(
        med + extra["spread_us"] + extra[f"{n}_spread_us"] < peers[n] for n in peers)
    return med, peers, extra


def _precompile(plan, target=None, root=None):
    """Compile the (spec, batch, sliding) variants of ``plan`` in parallel
    processes before timing (a first call would otherwise compile inline),
    for ``target`` (default the GPU's) into cache root ``root`` (default
    the default one). Returns the number of variants."""
    from flintgen import cache, toolchain
    from flintgen.cli import _build_one
    from flintgen.kernels import get_def
    from flintgen.procutil import run_spawned

    kdef, target = get_def("decode_attention"), target or toolchain.resolve_target()
    root = root or cache.default_root()
    todo = {}
    for spec, b, sliding in plan:
        v = kdef.bind(spec, target, lambda v: None)._variants[sliding][b]
        todo.setdefault(v.name, (spec, v))
    run_spawned(_build_one, [(spec, "decode_attention", v, target, root) for spec, v in todo.values()],
                workers=max(1, (os.cpu_count() or 2) - 1))
    return len(todo)


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


def _fp8_row_label(spec, b, L, window):
    return f"{spec.name} {_label(spec)} d{spec.head_dim} B={b} L={L // 1024}k" + (f" w{window}" if window else "")


def fp8_rows(select=None):
    """FP8_ROWS whose label (``_fp8_row_label``, as ``--fp8 --list`` prints
    it) contains one of the comma-separated strings of ``select`` (None:
    every row), in table order. A string that matches no row is refused."""
    if select is None:
        return FP8_ROWS
    pats = [p.strip() for p in select.split(",") if p.strip()]
    labels = [_fp8_row_label(*r) for r in FP8_ROWS]
    unmatched = [p for p in pats if not any(p in lab for lab in labels)]
    if not pats or unmatched:
        raise ValueError(f"--rows {select!r}: {unmatched or 'nothing'} matches no --fp8 row; give parts of the "
                         f"labels that --fp8 --list prints, e.g. '64/8 d64 B=64 L=8k'")
    return [r for r, lab in zip(FP8_ROWS, labels) if any(p in lab for p in pats)]


def _err(e):
    return "—" if e is None else f"{e:.2e}"


def _first_outputs(fns):
    """Each callable's output on cache 0 (``fn.call(0)``, eager), cloned;
    one that raises becomes ``(None, its error)`` in ``fns`` (the cell's
    note; the other cells still run)."""
    outs = {}
    for name, (fn, _) in list(fns.items()):
        if fn is None:
            continue
        try:
            outs[name] = fn.call(0).clone()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            fns[name] = (None, f"{name} failed: {type(e).__name__}: {e}")
    return outs


def rotated(names, i):
    """``names`` from its ``i``-th (mod its length) on: the order run ``i`` of a row times the implementations in,
    so none is always timed first. On the H200 (2026-12-07, decode_attention_fp8.md) the first run of a large row,
    right after the row's eager checks and fp64 reference (light GPU work), timed flintgen fp8 (then always first)
    7-8 % faster than its later runs (64/8 B = 128 x 8k 520-524 against 561-568 µs) while XQA-fp8's and the bf16
    path's runs agreed within 1.3 µs; fp8_table also times every implementation once, untimed, before the runs."""
    k = i % len(names)
    return tuple(names[k:]) + tuple(names[:k])


def fp8_table(runs, bw, rows=FP8_ROWS):
    """The --fp8 table (``rows`` a selection: decode_attention_fp8_rows, so
    the whole table's files stay): per row one ``Fp8Case`` (its ``fp8_copies`` caches),
    checked once against the fp64 reference (flintgen fp8, flintgen bf16 on
    the dequantized copy, XQA-fp8; eager calls, which also load the kernels
    and JIT-compile XQA before any graph is captured), then the three once
    untimed and ``runs`` times timed, each run in a rotated order
    (``rotated``), then freed. A row is won when flintgen
    fp8's median + both spreads is below XQA-fp8's median."""
    _precompile([(s, b, w is not None) for s0, b, _, w in rows for s in (s0, fp8_spec(s0))])
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    names = ("flintgen", "flintgen bf16", "XQA-fp8")
    out = []
    for spec, b, L, window in rows:
        copies = fp8_copies(spec, b, L, window, l2)
        case = Fp8Case(spec, b, [L] * b, window, copies=copies, seed=b + L)
        fns = {"flintgen": (case.fp8_fn(), None), "flintgen bf16": (case.flintgen_fn(), None),
               "XQA-fp8": case.xqa_fn()}
        outs = _first_outputs(fns)
        errs, n_ref = case.errors(outs)
        for name in names:   # untimed: no run times a GPU that ran only the row's light checks (see rotated)
            timed(name, *fns[name])
        per = [{name: timed(name, *fns[name]) for name in rotated(names, i)} for i in range(runs)]
        med, peers, extra = summarize(per, names)
        floor = case.bytes8 / bw * 1e6
        xqa = peers.get("XQA-fp8")
        beats = None if med is None or xqa is None else \
            med + extra["spread_us"] + extra["XQA-fp8_spread_us"] < xqa
        bf16 = peers.get("flintgen bf16")
        notes = [f"{k[:-6]}: {_short(v)}" for k, v in extra.items() if k.endswith("_error")]
        xqa_notes = getattr(fns["XQA-fp8"][0], "notes", [])
        notes += [_short(n, 120) for n in xqa_notes]
        if n_ref < b:
            notes.append(f"err: first {n_ref} of {b} requests")
        extra.pop("beats_peers_beyond_spread")
        extra.update(beats_xqa_fp8_beyond_spread=beats, copies=copies, kv_scale=case.kv_scale, xqa_notes=xqa_notes,
                     err_requests=n_ref, read_bandwidth_TBps=bw / 1e12, bf16_floor_us=case.bytes / bw * 1e6,
                     fp8_speedup_over_bf16=bf16 / med if med and bf16 else None,
                     **{f"{k}_rel_err": e for k, (e, _) in errs.items()},
                     **{f"{k}_max_head_rel_err": h for k, (_, h) in errs.items()})
        fp8_err, xqa_err = errs.get("flintgen", (None,))[0], errs.get("XQA-fp8", (None,))[0]
        won = "flintgen failed" if med is None else "XQA failed" if xqa is None else "yes" if beats else "NO"
        out.append(Row({"spec": spec.name, "q/kv heads": _label(spec), "head_dim": spec.head_dim, "B": b, "L": L,
                        "window": window or "—", "copies": copies,
                        "fp8 spread µs": f"{extra['spread_us']:.2f}" if med is not None else "—",
                        "XQA-fp8 spread µs": f"{extra['XQA-fp8_spread_us']:.2f}" if xqa is not None else "—",
                        "fp8 beats XQA-fp8": won, "flintgen fp8 err": _err(fp8_err), "XQA-fp8 err": _err(xqa_err),
                        "notes": "; ".join(notes)},
                       med, floor, peers, extra))
        print(_fp8_row_label(spec, b, L, window), f"copies {copies}", "fp8",
              "failed" if med is None else f"{med:.2f} us", peers,
              f"err fp8 {_err(fp8_err)} xqa {_err(xqa_err)}", flush=True)
        del fns, outs, case
        torch.cuda.empty_cache()
    print(write_results("decode_attention_fp8" if rows is FP8_ROWS else "decode_attention_fp8_rows", out, bw,
                        f"fp8 e4m3 KV cache, k_scale = v_scale = {FP8_KV_SCALE:g} (XQA takes one kv scale), sinks "
                        "on, 16-token pages permuted. flintgen µs = flintgen fp8; floor = attended e4m3 K|V bytes / "
                        "read bandwidth, % of floor likewise; flintgen bf16 = flintgen's bf16 kernel on the "
                        "dequantized cache (an exact bf16 copy, same block tables); XQA-fp8 = FlashInfer XQA "
                        "(Hopper fp8 kernel: q and P in e4m3 too) on the e4m3 cache with bmm1_scale = scale x "
                        "kv_scale, bmm2_scale = kv_scale. copies: caches rotated between calls (enough for 4x L2 "
                        "per graph replay where 20 calls can, <= 24 GB). After one untimed pass, median of "
                        f"{runs} run(s) (the implementations' order rotating per run) and spread (max - min). "
                        "fp8 beats XQA-fp8: flintgen fp8's median + both "
                        "spreads below XQA-fp8's median. err: relative Frobenius error vs fp64 on the dequantized "
                        f"cache over the first {FP8_REF_REQUESTS} requests (all when B <= {FP8_REF_REQUESTS})."))
    both = [r for r in out if r.extra["beats_xqa_fp8_beyond_spread"] is not None]
    ratios = sorted(r.extra["fp8_speedup_over_bf16"] for r in out if r.extra["fp8_speedup_over_bf16"])
    big = [f"{r.case['q/kv heads']} d{r.case['head_dim']} {r.pct_of_floor:.0f}%"
           for r in out if r.case["B"] == 128 and r.pct_of_floor]
    errs8 = [r.extra["flintgen_rel_err"] for r in out if r.extra.get("flintgen_rel_err") is not None]
    errsx = [r.extra["XQA-fp8_rel_err"] for r in out if r.extra.get("XQA-fp8_rel_err") is not None]
    print(f"flintgen fp8 beats XQA-fp8 beyond the spread on "
          f"{sum(r.extra['beats_xqa_fp8_beyond_spread'] for r in both)} of {len(both)} rows where both ran "
          f"({len(out)} rows); fp8 over flintgen bf16: "
          + (f"{ratios[0]:.2f}-{ratios[-1]:.2f}x (median {statistics.median(ratios):.2f}x)" if ratios else "—")
          + f"; % of fp8 floor at B=128: {', '.join(big) or '—'}; max err flintgen fp8 "
          + (f"{max(errs8):.2e}" if errs8 else "—") + ", XQA-fp8 " + (f"{max(errsx):.2e}" if errsx else "—"))
    for r in out:
        for k, v in r.extra.items():
            if k.endswith("_error"):
                print(r.case["spec"], r.case["q/kv heads"], r.case["B"], r.case["L"], r.case["window"], k,
                      _short(v, 300))


def fp8_listing(target, l2_bytes=None, rows=FP8_ROWS):
    """The --fp8 row plan (no GPU): each row's copies, attended e4m3 bytes
    and caches, what flintgen's specs accept, and XQA's JIT modules."""
    from flintgen.kernels import KERNELS

    l2 = l2_bytes or NOMINAL_L2_BYTES
    lines, modules, peak = [], set(), 0
    for spec, b, L, window in rows:
        copies = fp8_copies(spec, b, L, window, l2)
        attended = kv_bytes(spec, [L] * b, window, "fp8_e4m3")
        mem = copies * 3 * kv_bytes(spec, [L] * b, None, "fp8_e4m3")
        peak = max(peak, mem)
        refused = []
        for s in (spec, fp8_spec(spec)):
            try:
                KERNELS["decode_attention"].variants(s, target)
            except (NotImplementedError, ValueError) as e:
                refused.append(f"{s.kv_cache_dtype}: {_short(e, 140)}")
        modules.add((spec.page_size, spec.head_dim, spec.q_heads_per_rank // spec.kv_heads_per_rank,
                     window is not None))
        lines.append(f"  {_fp8_row_label(spec, b, L, window)}: {copies} copies, e4m3 K|V read "
                     f"{attended / 1e6:.2f} MB per call, caches {mem / 1e9:.2f} GB (bf16 + e4m3)"
                     + (f"; flintgen refuses {'; '.join(refused)}" if refused else ""))
    head = (f"--fp8: {len(rows)} rows, {len(modules)} XQA fp8 modules to JIT-compile, at most "
            f"{peak / 1e9:.1f} GB of caches at once; L2 {l2 / 2**20:.0f} MiB"
            + ("" if l2_bytes else " assumed (a GPU run reads its own)")
            + f"; k_scale = v_scale = {FP8_KV_SCALE:g}")
    return "\n".join([head] + lines)


def fp8_main(args):
    """--fp8: --list (no GPU), --prebuild DIR (no GPU), or the table."""
    from flintgen import toolchain

    try:
        rows = fp8_rows(args.rows)
    except ValueError as e:
        raise SystemExit(f"benchmarks.decode_attention: {e}") from None
    if args.list:
        l2 = torch.cuda.get_device_properties(0).L2_cache_size if torch.cuda.is_available() else None
        print(fp8_listing(toolchain.resolve_target(cpu_default=True), l2, rows))
        return
    if args.prebuild:
        plan = [(s, b, w is not None) for s0, b, _, w in rows for s in (s0, fp8_spec(s0))]
        n = _precompile(plan, toolchain.resolve_target(arch="sm_90a", num_sms=132), os.path.abspath(args.prebuild))
        print(f"prebuilt {n} decode-attention variants (bf16 and fp8) into {args.prebuild}")
        return
    fp8_table(args.runs or 3, read_bandwidth(), rows)


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
    ap.add_argument("--fp8", action="store_true",
                    help="fp8 e4m3 KV cache: flintgen fp8 vs flintgen bf16 (dequantized copy) vs XQA-fp8, with "
                         "errors vs fp64 (decode_attention_fp8.{md,json}); --list, --prebuild DIR")
    ap.add_argument("--group", help="--models: the group of rows to time (1, 2; all = every row)")
    ap.add_argument("--only", help="--models: comma-separated model names instead of a group")
    ap.add_argument("--rows", help="--fp8: only the rows whose --list label contains one of these comma-separated "
                                   "strings (results: decode_attention_fp8_rows)")
    ap.add_argument("--list", action="store_true", help="--models / --fp8: print the row plan and exit (no GPU)")
    ap.add_argument("--prebuild", metavar="DIR",
                    help="--models / --fp8: compile the group's (--fp8: the rows', bf16 and fp8) flintgen variants "
                         "for sm_90a (132 SMs) into cache root DIR and exit (no GPU; carry DIR with the aot stage)")
    ap.add_argument("--merge", action="store_true",
                    help="--models: join results/decode_attention_models_g*.json into decode_attention_models")
    args = ap.parse_args()
    if args.rows and not args.fp8:
        ap.error("--rows selects --fp8 rows: add --fp8")
    if args.models:
        models_main(args)
        return
    if args.fp8:
        fp8_main(args)
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
