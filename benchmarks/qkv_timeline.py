"""Where the RMSNorm + QKV step spends its time inside a CUDA-graph replay
(issue 18: the GEMV at 57-79 % of the weight-read floor, the step 2-4 us
above it), per CTA of both kernels: the production binaries (and two ring
configurations at M <= 8) with timestamps (a text patch of the rendered
modules, like decode_attention_timeline; the outputs are still computed and
checked against the op's), thread 0 of each CTA writing ``%globaltimer`` at
entry and exit and ``%clock64`` at four points:

    entry -> after the grid-dependency wait -> weights streamed (QKV: the
    range's last unit accumulated, or the cluster's MMA loop done) -> done
    (every thread of the CTA past its last store)

into a stamp buffer of its own per call (an added ``stamps`` argument). Two
chains per row, 20 calls each, captured in one graph and replayed: the step
(RMSNorm then QKV, PDL-chained, weights rotating beyond L2, as
``benchmarks.qkv`` times it) and the GEMV alone (QKV after QKV). Per call,
times are µs after the previous call's last QKV exit (t0): when the RMSNorm's
CTAs enter, pass their wait and leave, when the QKV's CTAs enter (landing
beside a draining launch shows as entries before t0), pass their wait (how
long after the RMSNorm's last exit the dependency releases), finish their
weights and leave. Medians over the 19 calls that have a predecessor.
``%globaltimer`` ticks in 0.256 us on the H200 (decode_attention_timeline.md);
clock64 phases are placed on it with one clock rate per row (the median over
the QKV CTAs of clock ticks per globaltimer span).

    python -m benchmarks.qkv_timeline --prebuild DIR   # CPU: stamped binaries + the op's for sm_90a
    python -m benchmarks.qkv_timeline                  # GPU (FLINTGEN_CACHE_DIR=DIR): the table
    ... [--rows REGEX]                                 # both: only the rows whose label it matches whole

Rows: flint-bf16 (hidden 2048, 32/4) and hidden 4096 32/8, BF16, at M = 1,
8, 16, 32, 64 (the op's design per token tile), at M = 1 and 8 also the wgmma ring
of 8 stages and the ring filling shared memory (the streaming design forced
onto the 8-token tile: more of each range copied before the grid wait), and
at M = 1 and 8 the op writing an e4m3 cache (issue 17: that step is
0.04-0.26 us slower than the bf16 write; where does it go?).
"""

from __future__ import annotations

import datetime
import os
import re
import sys

from benchmarks.decode_attention_timeline import HELPERS, _median, _pct
from flintgen import cache, codegen, toolchain
from flintgen.configs.qkv_config import token_tile, token_tiles
from flintgen.kernels import get_def, qkv_stream
from flintgen.kernels.qkv import QKVDef

STAMPS = 8        # u64 per CTA: gt entry, clk entry, clk waited, clk streamed, clk done, gt exit, smid, unused
STAMP_CTAS = 1024  # rows of a stamp buffer (more than any grid here: RMSNorm M, cluster 4 x heads, stream 132)
CALLS = 20
KDEF = QKVDef()
RMS = get_def("rms_norm")
FAKE_STAMPS = "make_fake_compact_tensor(Int64, (cute.sym_int(),), assumed_align=8)"


def _entry(ind: str, cta: str) -> str:
    """The stamp row of CTA ``cta`` and its entry stamps."""
    return (f"{ind}st_row = stamps.iterator.toint() + Int64(({cta}) * {STAMPS}) * 8\n"
            f"{ind}if tid == 0:\n{ind}    _gt(st_row)\n{ind}    _clk(st_row + 8)\n{ind}    _smid(st_row + 48)\n")


def _clk_at(ind: str, slot: int) -> str:
    return f"{ind}if tid == 0:\n{ind}    _clk(st_row + {8 * slot})\n"


def _exit(ind: str) -> str:
    return f"{ind}cute.arch.sync_threads()\n{ind}if tid == 0:\n{ind}    _clk(st_row + 32)\n{ind}    _gt(st_row + 40)\n"


I8, I12 = " " * 8, " " * 12
# (old, new, occurrences) per rendered module
PATCHES = {
    "rms_norm": [
        (f"{I8}weight: cute.Tensor,\n{I8}eps: Float32,\n",
         f"{I8}weight: cute.Tensor,\n{I8}stamps: cute.Tensor,\n{I8}eps: Float32,\n", 2),
        ("xn, weight, eps\n", "xn, weight, stamps, eps\n", 1),
        ("weight, Float32(1e-6), stream)", f"weight, {FAKE_STAMPS}, Float32(1e-6), stream)", 1),
        (f"{I8}cute.arch.griddepcontrol_launch_dependents()\n",
         _entry(I8, "row") + f"{I8}cute.arch.griddepcontrol_launch_dependents()\n", 1),
        (f"{I8}cute.arch.griddepcontrol_wait()\n", f"{I8}cute.arch.griddepcontrol_wait()\n" + _clk_at(I8, 2), 1),
        (f"{I8}total = block_sum(", _clk_at(I8, 3) + f"{I8}total = block_sum(", 1),
        ("\n\n\ndef compile_args():", "\n" + _exit(I8) + "\n\ndef compile_args():", 1),
    ],
    "cluster": [
        (f"{I8}slot_mapping: cute.Tensor,\n", f"{I8}stamps: cute.Tensor,\n{I8}slot_mapping: cute.Tensor,\n", 2),
        (" slot_mapping, q,\n", " stamps, slot_mapping, q,\n", 1),
        ("    args += [slot_mapping, q, k_cache, v_cache]\n",
         f"    args += [{FAKE_STAMPS}, slot_mapping, q, k_cache, v_cache]\n", 1),
        (f"{I8}cute.arch.griddepcontrol_launch_dependents()\n{I8}if tid == 0:\n{I12}cute.arch.mbarrier_init(mbar, 1)\n",
         _entry(I8, "head * CLUSTER + rank")
         + f"{I8}cute.arch.griddepcontrol_launch_dependents()\n{I8}if tid == 0:\n{I12}cute.arch.mbarrier_init(mbar, 1)\n",
         1),
        (f"{I8}cute.arch.cluster_wait()\n\n{I8}# ---- xn -> shared memory",
         f"{I8}cute.arch.cluster_wait()\n" + _clk_at(I8, 2) + f"\n{I8}# ---- xn -> shared memory", 1),
        (f"{I8}# ---- warps' partial sums -> shared", _clk_at(I8, 3) + f"{I8}# ---- warps' partial sums -> shared", 1),
        ("\n\n    # ------------------------------------------------------------ main loop\n",
         "\n" + _exit(I8) + "\n    # ------------------------------------------------------------ main loop\n", 1),
    ],
    "stream": [
        ("slot_mapping: cute.Tensor", "stamps: cute.Tensor, slot_mapping: cute.Tensor", 0),    # every signature
        (" slot_mapping, q, k_cache,", " stamps, slot_mapping, q, k_cache,", 0),              # and every call
        ("'slot_mapping', 'q',", "'stamps', 'slot_mapping', 'q',", 1),
        (f"{I8}\"q\": make_fake_compact_tensor(", f"{I8}\"stamps\": {FAKE_STAMPS},\n{I8}\"q\": make_fake_compact_tensor(", 1),
        (f"{I8}cute.arch.griddepcontrol_launch_dependents()\n{I8}lo = cta * UNITS // GRID\n",
         _entry(I8, "cta") + f"{I8}cute.arch.griddepcontrol_launch_dependents()\n{I8}lo = cta * UNITS // GRID\n", 1),
        (f"{I8}cute.arch.griddepcontrol_wait()\n", f"{I8}cute.arch.griddepcontrol_wait()\n" + _clk_at(I8, 2), 1),
        (f"{I12}if cutlass.const_expr(FINISH_SLICES > 0):\n{I12}    # ---- spread finish",
         _clk_at(I12, 3) + f"{I12}if cutlass.const_expr(FINISH_SLICES > 0):\n{I12}    # ---- spread finish", 1),
        ("\n\n    def store_partials(", "\n" + _exit(I8) + "\n    def store_partials(", 1),
    ],
}


def kind_of(kdef, v) -> str:
    if kdef is RMS:
        return "rms_norm"
    return "stream" if qkv_stream.is_stream(v) else "cluster"


def patched_source(kdef, spec, v) -> str:
    """The stamped module of variant ``v`` of ``kdef``: each patch must match as often as listed (0: at least
    once); the stamp helpers go before the module's class."""
    src = codegen.render(v.kernel, kdef.template_of(v), kdef.render_params(spec, v))
    for old, new, count in PATCHES[kind_of(kdef, v)]:
        found = src.count(old)
        if (count and found != count) or not found:
            raise RuntimeError(f"qkv timeline patch for {v.name}: {old!r} occurs {found} times, expected "
                               f"{count or 'at least 1'}")
        src = src.replace(old, new)
    if "\nclass " not in src:
        raise RuntimeError(f"qkv timeline: no class in {v.name}'s module")
    return src.replace("\nclass ", HELPERS + "\n\nclass ", 1)


def entry(kdef, spec, v, target, root=None):
    src = patched_source(kdef, spec, v)
    return cache.Entry(v, kdef.template_of(v), src, target, cache.key_of(cache.key_material(v, src, target)),
                       root or cache.default_root())


def specs():
    from benchmarks.qkv import token_specs

    return [s for s, _ in token_specs() if s.weight_format == "bf16"]


def rows():
    """(label, spec, M, config or None: the op's per-tile configuration); each spec's max_tokens is M's token
    tile (the op then needs no larger binaries; the tile's configuration does not depend on max_tokens)."""
    S = qkv_stream.StreamConfig
    out = []
    for spec in specs():
        out += [(f"{spec.name} M={m}", spec, m, None) for m in (1, 8, 16, 32, 64)]
        out += [(f"{spec.name} M={m} {name}", spec, m, cfg) for m in (1, 8)
                for name, cfg in (("ring s8 wgmma", S(stages=8, wgmma=True)), ("ring filling smem", S(wgmma=True)))]
        # issue 18: the 8-token ring with 8-token finishing slices (hidden 4096, where it was timed beside the
        # pool, since removed: qkv_stream_pool.md)
        if spec.hidden_size >= 4096:
            out += [(f"{spec.name} M={m} ring s8 f8", spec, m, S(stages=8, wgmma=True, finish_tokens=8)) for m in (1, 8)]
        # issue 17: the step writing an e4m3 cache (0.04-0.26 us slower than the bf16 write, qkv_fp8_ablation.md)
        fp8 = spec.replace(kv_cache_dtype="fp8_e4m3")
        out += [(f"{spec.name} M={m} fp8 cache", fp8, m, None) for m in (1, 8)]
    keep = _selected()
    return [(label, spec.replace(max_tokens=token_tile(m)), m, cfg) for label, spec, m, cfg in out if keep(label)]


def _selected():
    """--rows REGEX: the rows whose label it matches whole (prebuild and run take the same); default all."""
    if "--rows" not in sys.argv:
        return lambda label: True
    pattern = re.compile(sys.argv[sys.argv.index("--rows") + 1])
    return lambda label: pattern.fullmatch(label) is not None


def variants(spec, m, cfg, target):
    """(the QKV variant of the row, the RMSNorm variant with a residual)."""
    v = KDEF.variant(spec, config=cfg, max_m=token_tile(m), target=target)
    (norm,) = [n for n in RMS.variants(spec, target) if n["has_residual"]]
    return v, norm


def _build_stamped(kdef_name, spec, m, cfg, target, root):
    """Worker: build one row's stamped binary of ``kdef_name`` into ``root``; returns its entry directory."""
    kdef = KDEF if kdef_name == "qkv" else RMS
    v, norm = variants(spec, m, cfg, target)
    e = entry(kdef, spec, v if kdef is KDEF else norm, target, root)
    cache.get_or_build(e, fallback=False)
    return e.dir


def prebuild(root: str) -> None:
    """The op's binaries (every variant of the rows' configurations) and the stamped ones, for sm_90a into
    ``root``; prebuilt.txt lists them all."""
    from benchmarks.harness import list_prebuilt, prebuild_into
    from flintgen.procutil import run_spawned

    root = os.path.abspath(root)
    target = toolchain.resolve_target(arch="sm_90a", num_sms=132)
    todo = []
    for _, spec, m, cfg in rows():   # the op's binaries: every tile up to M's, both RMSNorm variants
        todo += [(spec, "qkv", KDEF.variant(spec, config=cfg, max_m=t, target=target))
                 for t in token_tiles(spec.max_tokens)]
        todo += [(spec, "rms_norm", n) for n in RMS.variants(spec, target)]
    todo = list({(s.name, v.name): (s, k, v) for s, k, v in todo}.values())
    prebuild_into(todo, target, root)
    jobs = [("qkv", spec, m, cfg) for _, spec, m, cfg in rows()] + [("rms_norm", spec, 1, None) for spec in specs()]
    dirs = run_spawned(_build_stamped, [(*job, target, root) for job in jobs])
    n = list_prebuilt(root, dirs, append=True)
    print(f"prebuilt {len(todo)} op variants and {n} stamped binaries into {root}")


def _times(s, rate):
    """One kernel's stamps ([CTAs, STAMPS] int64, CTAs that ran) as ns on the globaltimer axis: a dict of
    entry, waited, streamed, done, exit (float64 tensors) and smid."""
    gt0, gt1 = s[:, 0].double(), s[:, 5].double()
    clk = s[:, 1:5].double()
    clk[:, 2] = clk[:, 2].where(clk[:, 2] > 0, clk[:, 3])     # no 'streamed' stamp: the done one
    at = gt0[:, None] + (clk - clk[:, :1]) * rate
    return dict(entry=gt0, waited=at[:, 1], streamed=at[:, 2], done=at[:, 3], exit=gt1, smid=s[:, 6])


def _ran(buf):
    s = buf.view(-1, STAMPS).cpu()
    return s[s[:, 0] > 0]


def clock_rate(qkv_bufs) -> float:
    """ns per clock64 tick: the median over QKV CTAs spanning >= 2 us of globaltimer span / clock ticks."""
    import torch

    s = torch.cat([_ran(b) for b in qkv_bufs])
    span, ticks = (s[:, 5] - s[:, 0]).double(), (s[:, 4] - s[:, 1]).double()
    keep = (span >= 2000) & (ticks > 0)
    if not bool(keep.any()):
        keep = ticks > 0
    return float((span[keep] / ticks[keep]).median())


def analyse(qkv_bufs, rms_bufs=None, sms=None, lens=None):
    """Per call after the first (µs after the previous call's last QKV exit): the RMSNorm's first entry, median
    wait and last exit, the QKV's entries, waits, streamed / done points and exits, CTAs per SM; the tail (the
    last CTA's streamed point, the longest finish phase, CTAs finishing for > 0.2 us) and, given ``lens`` (units
    of each CTA's range), the median stream phase of the CTAs of each range length."""
    import torch

    rate = clock_rate(qkv_bufs)
    q = [_times(_ran(b), rate) for b in qkv_bufs]
    r = [_times(_ran(b), rate) for b in rms_bufs] if rms_bufs else None
    sms = sms or torch.cuda.get_device_properties(0).multi_processor_count
    out = []
    for i in range(1, len(q)):
        t0 = float(q[i - 1]["exit"].max())
        us = lambda x: (float(x) - t0) / 1e3   # noqa: E731
        c = q[i]
        phase, fin = c["streamed"] - c["waited"], c["done"] - c["streamed"]   # stream and finish phases, ns
        d = dict(q_entry=(us(c["entry"].min()), us(c["entry"].median()), us(c["entry"].max())),
                 q_waited=(us(c["waited"].median()), us(c["waited"].max())),
                 q_streamed=(us(c["streamed"].median()), us(_pct(c["streamed"].tolist(), 0.9))),
                 q_exit=(us(c["exit"].median()), us(c["exit"].max())),
                 q_stream_phase=float(phase.median()) / 1e3,
                 q_finish_phase=float(fin.median()) / 1e3)
        d["tail"] = (us(c["streamed"].max()), float(fin.max()) / 1e3, int((fin > 200).sum()))
        if lens is not None and len(lens) == len(c["streamed"]):   # stream phase by range length (units)
            for n in sorted(set(lens)):
                pick = torch.tensor([x == n for x in lens])
                d[f"phase_{n}"] = float(phase[pick].median()) / 1e3
        per_sm = torch.bincount(c["smid"], minlength=sms)
        d["ctas_per_sm"] = (int(per_sm.min()), int(per_sm.max()))
        if r:
            n = r[i]
            d["r"] = (us(n["entry"].min()), us(n["waited"].median()), us(n["exit"].max()))
            d["q_waited_after_r"] = (float(c["waited"].median()) - float(n["exit"].max())) / 1e3
        out.append(d)
    return out


def _summary(res):
    """Medians over calls of analyse()'s fields (tuples elementwise)."""
    out = {}
    for k, v in res[0].items():
        if isinstance(v, tuple):
            out[k] = tuple(_median([r[k][j] for r in res]) for j in range(len(v)))
        else:
            out[k] = _median([r[k] for r in res])
    return out


def _with_stamps(args, slots, stamps):
    """The QKV binary's arguments with the stamp buffer before slot_mapping (where the patch put it)."""
    i = next(k for k, a in enumerate(args) if a is slots)
    return args[:i] + [stamps] + args[i:]


def run_row(label, spec, m, cfg, weights, target):
    """The row's table lines (step chain, GEMV chain: the op's own timing, then the stamped binaries') and its
    tail lines."""
    import torch

    from benchmarks.harness import replay_calls, time_graph
    from benchmarks.qkv import Layers
    from flintgen.kernels.qkv import QKVOp
    from flintgen.runtime import load_variant

    op = QKVOp(KDEF, spec, target, lambda v: load_variant(KDEF, spec, v, target)[0], config=cfg)
    op.warmup(torch.device("cuda"))
    lay = Layers(spec, m, weights)
    v, norm = variants(spec, m, cfg, target)
    assert v == op._variants[token_tile(m)], (v.name, op._variants[token_tile(m)].name)
    plain_fn = load_variant(KDEF, spec, v, target)[0]
    res_out = torch.empty_like(lay.res)

    def op_step(w):
        return op(lay.x, lay.res, lay.norm_w, w[0], w[1], w[2], lay.qn, lay.kn, lay.cs, lay.pos, lay.k, lay.v,
                  lay.slots, lay.bias, q_out=lay.q, xn_out=lay.xn, residual_out=res_out, **lay.kv_kw)

    def plain_step():
        op_step(lay.weights())

    def plain_gemv():
        plain_fn(*lay.args_for(v, lay.weights(), op))

    op_us = (time_graph(plain_step)["median_us"], time_graph(plain_gemv)["median_us"])
    # the stamped binaries on call 0's weights give the op's outputs
    op_step(weights[0])
    torch.cuda.synchronize()
    ref = (lay.q.clone(), lay.xn.clone(), res_out.clone(), lay.cache.clone())
    for t in (lay.q, lay.xn, res_out, lay.cache):
        t.view(torch.uint8).zero_()
    qkv_fn = cache.get_or_build(entry(KDEF, spec, v, target)).function
    rms_fn = cache.get_or_build(entry(RMS, spec, norm, target)).function
    q_bufs = [torch.zeros(STAMP_CTAS * STAMPS, dtype=torch.int64, device="cuda") for _ in range(CALLS)]
    r_bufs = [torch.zeros(STAMP_CTAS * STAMPS, dtype=torch.int64, device="cuda") for _ in range(CALLS)]

    def qkv_call(i):
        qkv_fn(*_with_stamps(lay.args_for(v, weights[i % len(weights)], op), lay.slots, q_bufs[i]))

    def step_call(i):
        rms_fn(lay.x, lay.res, res_out, lay.xn, lay.norm_w, r_bufs[i], spec.rms_eps)
        qkv_call(i)

    step_call(0)
    torch.cuda.synchronize()
    got = (lay.q, lay.xn, res_out, lay.cache)
    for name, a, b in zip(("q", "xn", "residual_out", "cache"), got, ref):
        if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            raise SystemExit(f"qkv timeline: {label}: the stamped step's {name} differs from the op's")
    lines, tails = [], []
    lens = None       # units of each CTA's range (the streaming design)
    if qkv_stream.is_stream(v):
        plan = qkv_stream.plan_of(dict(v.params))
        lens = [plan.lo(c + 1) - plan.lo(c) for c in range(plan.grid)]
    for chain, calls, rb, us in (("step", step_call, r_bufs, op_us[0]), ("GEMV", qkv_call, None, op_us[1])):
        for b in q_bufs + r_bufs:
            b.zero_()
        stamped = replay_calls(calls, CALLS)
        s = _summary(analyse(q_bufs, rb, lens=lens))
        r = " / ".join(f"{x:+.2f}" for x in s["r"]) if rb else "-"
        lines.append(f"| {label} | {chain} | {us:.2f} | {stamped:.2f} | {r} | "
                     + " / ".join(f"{x:+.2f}" for x in s["q_entry"]) + " | "
                     + " / ".join(f"{x:+.2f}" for x in s["q_waited"]) + " | "
                     + (f"{s['q_waited_after_r']:+.2f}" if rb else "-") + " | "
                     + " / ".join(f"{x:+.2f}" for x in s["q_streamed"]) + " | "
                     + " / ".join(f"{x:+.2f}" for x in s["q_exit"]) + " | "
                     + f"{s['q_stream_phase']:.2f} | {s['q_finish_phase']:.2f} | "
                     + f"{s['ctas_per_sm'][0]}-{s['ctas_per_sm'][1]} |")
        print(lines[-1], flush=True)
        phases = ", ".join(f"{k[6:]} units {x:.2f}" for k, x in s.items() if k.startswith("phase_"))
        tails.append(f"* {label}, {chain}: last CTA streamed at {s['tail'][0]:+.2f} us, longest finish phase "
                     f"{s['tail'][1]:.2f} us ({s['tail'][2]:.0f} CTAs finish for > 0.2 us)"
                     + (f"; median stream phase by range length: {phases}" if phases else ""))
        print(tails[-1], flush=True)
    return lines, tails


HEAD = ("| row | chain | op µs per call (graph median, unstamped) | stamped µs per call | RMSNorm first entry / "
        "median wait / last exit | QKV entry first / median / last | QKV wait median / last | QKV wait after the "
        "RMSNorm's last exit (median) | QKV streamed median / p90 | QKV exit median / last | QKV wait -> streamed "
        "(median) | streamed -> done (median) | QKV CTAs per SM |")


def main():
    if "--prebuild" in sys.argv:
        return prebuild(sys.argv[sys.argv.index("--prebuild") + 1])
    from benchmarks.harness import commit, device_info, write_report
    from benchmarks.qkv import copies_for, make_weights

    target = toolchain.resolve_target()
    lines, tails, weights = [], [], {}
    for label, spec, m, cfg in rows():
        if spec.name not in weights:
            weights = {spec.name: make_weights(spec, copies_for(spec))}   # one spec's copies at a time
        row_lines, row_tails = run_row(label, spec, m, cfg, weights[spec.name], target)
        lines += row_lines
        tails += row_tails
    info = device_info()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = ("# qkv_timeline\n\n" + (__doc__ or "").split("\n\n")[0] + "\n\n"
            + f"{when} · {info['device']} ({info['sms']} SMs) · torch {info['torch']} · commit {commit()}\n\n"
            + "Times in µs after the previous call's last QKV exit; medians over 19 calls.\n\n"
            + HEAD + "\n|" + "---|" * (HEAD.count("|") - 1) + "\n" + "\n".join(lines) + "\n"
            + ("\nThe tails (medians over the calls):\n\n" + "\n".join(tails) + "\n" if tails else ""))
    write_report("qkv_timeline", text)


if __name__ == "__main__":
    main()
