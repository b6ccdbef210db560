"""What makes the fused QKV step slower when it writes an fp8 (e4m3) KV cache?

With an e4m3 cache the step is slower than with the bf16 one (flint, H200: +0.14 us at
M = 1, +0.23 us at M = 8). Each variant is the fp8 GEMV binary with ONE change (some
numerically wrong: only the time counts), timed as in ``benchmarks.qkv --fp8`` (CUDA-graph
replay, weights rotating past L2): the step through the real QKVOp (rms_norm + that
GEMV, PDL) and the GEMV alone; flint and h4096-32x8-bf16, M = 1 and 8, 3 interleaved runs.

  bf16, fp8     the references (QKVDef: the very binaries benchmarks.qkv --fp8 runs; where
                the op streams, as h4096 does at M <= 8 since the 8-token rule, these two and
                recip_before_s are timed: the other patches are the cluster design's text)
  fp8_inl       control: kv_quant.py and head_epilogue.py pasted into the module, unchanged
                (the base of the pasted-code patches; its PTX is fp8's, --prebuild checks)
  recip_late    the reciprocal once xn has landed, just before the main loop: neither the grid wait
                nor the xn copies then follow the scale's load
  recip_after   the reciprocal of the scale computed right after the grid wait instead of next
                to its load (b50c6c3 tried it, on the hypothesis that a CTA landing late waits
                for the load before its grid wait: 0.04-0.05 us slower); recip_before_s: the
                streaming design's reciprocal before the wait instead of right after it
  no_ldg        is it the scale load (before griddepcontrol.wait)? The scale is the kernel
                argument block_size instead: no load, the quotient kept (not constant-folded)
  div_rn        the quotient as it was: div.rn.f32 per element (MUFU.RCP, 5 dependent FFMA,
                FCHK and a BSSY/BSYNC region that may call a slow path: 8 per lane) in both
                of the epilogue's copies, instead of kv_quant's reciprocal-based one
                (1 FMUL, 2 FFMA, 2 FSETP per element; the reciprocal before the wait)
  mul           is it the quotient? x * scale instead
  noscale       no scaling at all (ptxas then drops the unused load as well)
  cvt_bf16      is it the e4m3 cvt? cvt.rn.bf16x2 instead (its low half stored: same stores)
  no_quant      the whole conversion: the epilogue is told kv_fp8=False but keeps the 1-byte
                cache addressing, so the bf16 words' low halves go out through the same
                2-byte stores, with no unpack, division or cvt (and no load)
  nostore       is it the stores (narrower, st.global.b16)? Every global store of the
                epilogue (q, k, v) predicated on addr < 0: never true, which ptxas cannot
                know, so all values are computed and nothing is written
  bf16_nostore  the same on the bf16 reference (nostore - bf16_nostore: compute alone)
  reload        is it the scale and its reciprocal held in registers across the main loop? Both read and
                computed once the main loop is done (before the partial sums' reduction) instead
  bf16_e1 .. fp8_p3  another launch configuration (QKVConfig: early_dequant 1 / 3, prefetch 2 / 3 of 4) for each
                cache: is there one whose fp8 step is no slower than bf16's production step?
  one_copy      is it the epilogue's code size? The conversion's fast copy alone (no div.rn copy behind the
                uniform branch), so the tail runs less cold code

Patches are text replacements of the rendered module (pasted helpers included); each
variant's kernel name keys its cache entries apart; the real files are never changed.

    python -m benchmarks.qkv_fp8_ablation [--runs N] [--check] [--only T,T]  # GPU (--check: find the binaries only;
                                                          # --only: those variants beside bf16 and fp8)
    python -m benchmarks.qkv_fp8_ablation --prebuild DIR [--only T,T]  # no GPU: sm_90a, 132 SMs, into DIR
    python -m benchmarks.qkv_fp8_ablation --diff          # each variant against its base (flint; streaming: h4096)
"""

from __future__ import annotations

import ast
import difflib
import os
import re
import statistics
import sys
import time
from dataclasses import replace

from benchmarks import qkv as bq
from flintgen import cache, codegen, toolchain
from flintgen.configs.qkv_config import QKVConfig, token_tile
from flintgen.kernels import get_def
from flintgen.kernels.qkv import QKVDef, QKVOp

RUNS, MS = 3, (1, 8)
INLINED = ("kv_quant", "head_epilogue")   # flintgen.device modules pasted into an inline variant


def _drop(stmt: str) -> str:
    """``from flintgen.device import ...`` without the pasted modules ('' if none is left)."""
    node = ast.parse(stmt).body[0]
    if not isinstance(node, ast.ImportFrom) or node.module != "flintgen.device":
        return stmt
    keep = [a.name for a in node.names if a.name not in INLINED]
    return f"from flintgen.device import {', '.join(keep)}" if keep else ""


def _module_parts(name: str) -> tuple[list[str], str]:
    """(import lines, code from the first definition on) of flintgen.device.<name>;
    its docstring and ``from __future__`` left out."""
    with open(cache._module_file(f"flintgen.device.{name}")) as f:
        text = f.read()
    imports, first = [], None
    for node in ast.parse(text).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if getattr(node, "module", None) != "__future__":
                imports.append(_drop(ast.get_source_segment(text, node)))
        elif not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            first = node
            break
    start = min([first.lineno] + [d.lineno for d in getattr(first, "decorator_list", [])]) - 1
    return [i for i in imports if i], "".join(text.splitlines(keepends=True)[start:])


def inline_helpers(src: str) -> str:
    """``src`` with kv_quant and head_epilogue pasted in after its imports; the module
    names they are called by (``head_epilogue.finish_qk``, ``kv_quant.e4m3_run``) are
    bound to this module, so a patch of the pasted text changes what the kernel runs."""
    lines = src.splitlines(keepends=True)
    last = max(n.end_lineno for n in ast.parse(src).body if isinstance(n, (ast.Import, ast.ImportFrom)))
    out = [_drop(l.rstrip("\n")) + "\n" if l.startswith("from flintgen.device import") else l for l in lines[:last]]
    out.append("import sys\n")
    bodies = []
    for name in INLINED:
        imports, body = _module_parts(name)
        out += [i + "\n" for i in imports]
        bodies.append(f"\n\n# ==== flintgen/device/{name}.py, pasted by benchmarks/qkv_fp8_ablation.py ====\n{body}")
    tail = f"\n{' = '.join(INLINED)} = sys.modules[__name__]   # the pasted code is called by these names\n"
    return "".join(out + bodies + [tail] + lines[last:])


# ---- the patches: (old, new, occurrences) --------------------------------------------
NO_LDG = ("""        kv_scale_in = kv_quant.load_scale(
            k_scale.iterator.toint() + Int64(is_v) * (v_scale.iterator.toint() - k_scale.iterator.toint()),
            Int32(rank == 0) * Int32(head >= Q_HEADS))
""", "        kv_scale_in = Float32(block_size)   # ablation no_ldg: no load (a runtime value)\n", 1)
LOAD = """            Int32(rank == 0) * Int32(head >= Q_HEADS))
"""
RECIP = "        kv_scale = kv_quant.Scale.of(kv_scale_in)\n"   # the production reciprocal, next to the load
RECIP_AFTER = [(LOAD + RECIP, LOAD, 1),
               ("\n        cute.arch.cluster_wait()\n",   # the one after the grid wait (8 spaces: not the loop's)
                "\n        kv_scale = kv_quant.Scale.of(kv_scale_in)   # ablation recip_after\n"
                "        cute.arch.cluster_wait()\n", 1)]
# the reciprocal once xn has landed (the mbarrier wait before the main loop): nothing before the xn copies
# waits for the scale's load (recip_before makes the grid wait follow it; recip_after the xn copies)
RECIP_LATE = [(LOAD + RECIP, LOAD, 1),
              ("        cute.arch.mbarrier_wait(mbar, 0)\n\n        # ---- GEMV main loop",
               "        cute.arch.mbarrier_wait(mbar, 0)\n"
               "        kv_scale = kv_quant.Scale.of(kv_scale_in)   # ablation recip_late\n\n        # ---- GEMV main loop", 1)]
STREAM_RECIP = "            kv_scales = (kv_quant.Scale.of(kv_scales[0]), kv_quant.Scale.of(kv_scales[1]))"
STREAM_LOAD = """                         kv_quant.load_scale(v_scale.iterator.toint(), Int32(1)))
"""
STREAM_RECIP_BEFORE = [("""        if cutlass.const_expr(KV_FP8):
""" + STREAM_RECIP + "\n", "", 1), (STREAM_LOAD, STREAM_LOAD + STREAM_RECIP + "   # ablation recip_before\n", 1)]
QUOTIENT = "    q = [quotient(v, scale, fast) for v in vals]\n"     # kv_quant.e4m3_run's
MUL = (QUOTIENT, "    q = [v * scale.scale for v in vals]   # ablation mul\n", 1)
NOSCALE = (QUOTIENT, "    q = list(vals)   # ablation noscale\n", 1)
DIV_RN = (QUOTIENT, "    q = [ptx.div_rn(v, scale.scale) for v in vals]   # ablation div_rn\n", 1)
CVT_BF16 = [("ptx.e4m3x2(", "ptx.bf16x2(", 2),
            ("ptx.e4m3x4(q[4 * i], q[4 * i + 1], q[4 * i + 2], q[4 * i + 3])", "ptx.bf16x2(q[4 * i], q[4 * i + 1])", 1)]
NO_QUANT = ("stride_head, KV_ELEM_BYTES, KV_FP8)", "stride_head, KV_ELEM_BYTES, False)", 1)   # KvPages(..., fp8)
NOSTORE = ("""    if cutlass.const_expr(eb == 1):
        kv_quant.stg_bytes_run(dst, words, e)
    else:
        ldst.stg_words_run(dst, words, e)
""", '''    _stg_never(dst, words, e * eb)   # ablation nostore


def _stg_never(addr, words, nbytes: int):
    """Ablation: _store_run's store, predicated on addr < 0: never true, which ptxas cannot know."""
    n, st = {1: (1, "st.global.b8 [$0], $1;"), 2: (1, "st.global.b16 [$0], h;"), 4: (1, "st.global.u32 [$0], $1;"),
             8: (2, "st.global.v2.u32 [$0], {$1, $2};"), 16: (4, "st.global.v4.u32 [$0], {$1, $2, $3, $4};")}[nbytes]
    ptx._asm([], [(Int64, addr)] + [(cutlass.Uint32, w) for w in words[:n]],
             "{ .reg .pred p; .reg .b16 h; cvt.u16.u32 h, $1; setp.lt.s64 p, $0, 0; @p " + st + " }",
             side_effects=True)
''', 1)


# one copy of the conversion (the fast one): is it the epilogue's code size (instruction-cache misses on the
# kernel's tail: the identical fp8_inl differs from fp8 by up to 0.08 us)?
ONE_COPY = [("""                            if kv_scale.fast():   # uniform: the same scale in every thread
                                _store_e4m3_head(dst, o1, o2, op, kv_scale, True, lane, d, dp, lanes)
                            else:
                                _store_e4m3_head(dst, o1, o2, op, kv_scale, False, lane, d, dp, lanes)
""", """                            _store_e4m3_head(dst, o1, o2, op, kv_scale, True, lane, d, dp, lanes)   # ablation one_copy
""", 1), ("""                    if kv_scale.fast():   # uniform: the same scale in every thread
                        _store_e4m3_v(dst, w1, w2, kv_scale, True, e, half)
                    else:
                        _store_e4m3_v(dst, w1, w2, kv_scale, False, e, half)
""", """                    _store_e4m3_v(dst, w1, w2, kv_scale, True, e, half)   # ablation one_copy
""", 1)]


# the scale read once the main loop is done (before the partial sums' reduction, whose latency covers it),
# not before the grid wait: nothing of the write stays live in registers across the main loop
SCALE_LOAD = NO_LDG[0] + RECIP
RELOAD = [(SCALE_LOAD, "", 1),
          ("        acc = acc[0]\n", "        acc = acc[0]\n" + SCALE_LOAD.rstrip("\n") + "   # ablation reload\n", 1)]


class Ablation(QKVDef):
    """The QKVDef of one timed variant: the real template's rendering, with the epilogue
    helpers pasted in (``inline``), then ``patches``. Its own kernel name (the
    references keep 'qkv', so their keys are benchmarks.qkv's) keys its entries apart."""

    def __init__(self, tag: str, kv: str, inline: bool = False, patches=(), doc: str = "", stream: bool = False,
                 launch: dict | None = None):
        self.tag, self.kv, self.inline, self.doc, self.stream = tag, kv, inline, doc, stream
        self.patches = [patches] if patches and isinstance(patches[0], str) else list(patches)
        self.launch = launch or {}   # QKVConfig fields changed from the op's own (the cluster design's)
        self.name = "qkv" if tag in REFERENCES else f"qkv_abl_{tag}"

    def config(self, spec, max_m=8, target=None):
        cfg = super().config(spec, max_m, target)
        return replace(cfg, **self.launch) if self.launch and isinstance(cfg, QKVConfig) else cfg

    def source(self, spec, variant, *, inline: bool | None = None, patched: bool = True) -> str:
        src = codegen.render(variant.kernel, self.template_of(variant), dict(self.render_params(spec, variant)))
        if self.inline if inline is None else inline:
            src = inline_helpers(src)
        for old, new, n in self.patches if patched else ():
            if src.count(old) != n:
                raise RuntimeError(f"ablation {self.tag}: {old!r} occurs {src.count(old)} times, not {n}")
            src = src.replace(old, new)
        return src

    def entry(self, spec, variant, target, root: str | None = None) -> cache.Entry:
        """The cache entry, keyed as cache.make_entry keys a rendered source."""
        src = self.source(spec, variant)
        key = cache.key_of(cache.key_material(variant, src, target))
        return cache.Entry(variant, self.template_of(variant), src, target, key, root or cache.default_root())


B, F = "bf16", "fp8_e4m3"
REFERENCES = ("bf16", "fp8")   # the op's own binaries, whichever design it runs
VARIANTS = {a.tag: a for a in (
    Ablation("bf16", B, doc="reference, bf16 cache"),
    Ablation("fp8", F, doc="reference, e4m3 cache"),
    Ablation("fp8_inl", F, True, doc="control: fp8 with kv_quant + head_epilogue pasted in, unchanged"),
    Ablation("recip_after", F, False, RECIP_AFTER, "1 / scale right after the grid wait, not before it (as at b50c6c3)"),
    Ablation("recip_late", F, False, RECIP_LATE, "1 / scale once xn has landed (before the main loop), not before the grid wait"),
    Ablation("recip_before_s", F, False, STREAM_RECIP_BEFORE,
             "streaming design: 1 / scale before the grid wait, not right after it", stream=True),
    Ablation("no_ldg", F, False, NO_LDG, "k_scale / v_scale not loaded (scale = block_size)"),
    Ablation("div_rn", F, True, DIV_RN, "div.rn.f32(x, scale) per element in both copies (as before kv_quant.Scale)"),
    Ablation("mul", F, True, MUL, "x * scale instead of the quotient (kv_quant.quotient)"),
    Ablation("noscale", F, True, NOSCALE, "no scaling (the unused scale load goes too)"),
    Ablation("cvt_bf16", F, True, CVT_BF16, "cvt bf16x2 instead of e4m3x2, same stores"),
    Ablation("no_quant", F, False, NO_QUANT, "no conversion: bf16 low halves, the same 2-byte stores"),
    Ablation("nostore", F, True, NOSTORE, "epilogue stores (q, k, v) predicated off, values computed"),
    Ablation("bf16_nostore", B, True, NOSTORE, "bf16 reference, epilogue stores predicated off"),
    Ablation("reload", F, False, RELOAD, "k_scale / v_scale read after the main loop, not before the grid wait"),
    # another launch configuration of the cluster design for both caches: is there one where the fp8 step is
    # no slower than bf16's production step?
    *(Ablation(f"{kv}_{lbl}", k, launch=ch, doc=f"{kv} cache with {ch} (QKVConfig) instead of the op's own")
      for lbl, ch in (("e1", {"early_dequant": 1}), ("e3", {"early_dequant": 3}),
                      ("p2", {"prefetch": 2}), ("p3", {"prefetch": 3})) for kv, k in (("bf16", B), ("fp8", F))),
    Ablation("one_copy", F, True, ONE_COPY, "the conversion's fast copy alone (no div.rn copy: smaller epilogue code)"),
)}
_FNS: dict = {}


class Loader:
    """QKVOp's GEMV loader of one variant; the timing run, --check and --prebuild all
    find its binaries through ``entry``."""

    def __init__(self, abl: Ablation, spec, target):
        self.abl, self.spec, self.target = abl, spec, target

    def entry(self, variant, root: str | None = None) -> cache.Entry:
        return self.abl.entry(self.spec, variant, self.target, root)

    def __call__(self, variant):
        e = self.entry(variant)
        if e.key not in _FNS:
            _FNS[e.key] = cache.get_or_build(e).function
        return _FNS[e.key]


def _only() -> tuple[str, ...]:
    """--only T,T..: these variants (beside the references) alone; default every one."""
    if "--only" not in sys.argv:
        return tuple(VARIANTS)
    tags = tuple(sys.argv[sys.argv.index("--only") + 1].split(","))
    if unknown := [t for t in tags if t not in VARIANTS]:
        raise SystemExit(f"qkv_fp8_ablation: --only {','.join(unknown)}: not a variant; variants: {', '.join(VARIANTS)}")
    return tags


def plan(target, root: str | None = None):
    """([(spec, tag, op, loader)], every cache entry those ops load: GEMV and rms_norm)."""
    ops, entries, rms = [], [], get_def("rms_norm")
    wanted = _only()
    for spec in bq.base_specs():
        for tag, abl in VARIANTS.items():
            # the references always; another variant where asked for and its patches are this design's text
            if tag not in REFERENCES and (tag not in wanted or abl.stream == isinstance(abl.config(spec), QKVConfig)):
                continue
            s8 = spec.replace(kv_cache_dtype=abl.kv)
            load = Loader(abl, s8, target)
            op = QKVOp(abl, s8, target, load)
            ops.append((spec, tag, op, load))
            entries += [(tag, s8, v, load.entry(v, root)) for v in op.variants()]
            entries += [("rms_norm", s8, v, cache.make_entry(v, rms.template, dict(rms.render_params(s8, v)),
                                                             target, root)) for v in op.norm_op().variants()]
    return ops, list({e.dir: (t, s, v, e) for t, s, v, e in entries}.values())


def check(entries) -> bool:
    bad = [(e, p) for _, _, _, e in entries if (p := cache.check_entry(e))]
    for e, p in bad:
        print(f"not in the cache: {e.dir} ({p})")
    print(f"{len(entries) - len(bad)} of {len(entries)} binaries found in {entries[0][3].root}", flush=True)
    return not bad


def _build(tag, spec, variant, target, root):
    """Pool worker: build one entry (never uncached)."""
    if tag == "rms_norm":
        from flintgen.cli import _build_one
        return _build_one(spec, "rms_norm", variant, target, root)[-1]
    e = VARIANTS[tag].entry(spec, variant, target, root)
    cache.get_or_build(e, fallback=False)
    return e.dir


def _ptx(e) -> list[str]:
    with open(e.path("kernel.ptx")) as f:
        return re.sub(r"kernel_cutlass_kernel_flintgen_generated\w*?_0(?=_param|\b)", "K", f.read()).splitlines()


def _regs(e):
    return ((cache.read_meta(e) or {}).get("resources") or {}).get("registers")


def prebuild(root: str) -> None:
    from flintgen.procutil import run_spawned

    root = os.path.abspath(root)
    target = toolchain.resolve_target(arch="sm_90a", num_sms=132)
    _, entries = plan(target, root)
    run_spawned(_build, [(t, s, v, target, root) for t, s, v, _ in entries])
    print(f"prebuilt {len(entries)} binaries into {root}")
    ref = {(s.name, s.kv_cache_dtype): e for t, s, _, e in entries if t in REFERENCES}
    for t, s, _, e in entries:   # PTX lines changed against the reference of the same cache dtype
        if t != "rms_norm":
            n = sum(1 for l in difflib.unified_diff(_ptx(ref[s.name, s.kv_cache_dtype]), _ptx(e), n=0)
                    if l[:1] in "+-" and l[:3] not in ("+++", "---"))
            print(f"  {s.name:16} {t:13} {_regs(e)} registers, {n} PTX lines differ from its reference")
    check(entries)


def diff_main() -> None:
    target = toolchain.resolve_target(arch="sm_90a", num_sms=132)
    flint, big = bq.base_specs()   # the cluster design's patches on flint, the streaming ones on hidden 4096
    for tag, abl in VARIANTS.items():
        s8 = (big if abl.stream else flint).replace(kv_cache_dtype=abl.kv)
        v = abl.variant(s8, target=target)
        base = abl.source(s8, v, inline=abl.inline and bool(abl.patches), patched=False)
        d = difflib.unified_diff(base.splitlines(True), abl.source(s8, v).splitlines(True),
                                 f"{tag} (unpatched)", tag, n=2)
        print(f"==== {tag}: {abl.doc}\n" + "".join(d))


def main() -> None:
    target = toolchain.resolve_target()
    ops, entries = plan(target)
    if not check(entries):
        sys.exit("some binaries are missing: build them with --prebuild DIR and set FLINTGEN_CACHE_DIR=DIR")
    if "--check" in sys.argv:
        return
    import torch

    from benchmarks.harness import commit, device_info, time_graph, write_report

    runs = int(sys.argv[sys.argv.index("--runs") + 1]) if "--runs" in sys.argv else RUNS
    dev, res = torch.device("cuda"), {}
    for spec in dict.fromkeys(s for s, *_ in ops):   # plan's spec objects (base_specs() makes new ones)
        mine = [(t, op, ld) for s, t, op, ld in ops if s is spec]
        for _, op, _ in mine:
            op.warmup(dev)
        weights = bq.make_weights(spec, bq.copies_for(spec))
        for m in MS:
            lays = {}
            for kv in (B, F):
                torch.manual_seed(0)   # the same activations for both caches
                lays[kv] = bq.Layers(spec.replace(kv_cache_dtype=kv), m, weights)
            cases = []
            for tag, op, ld in mine:
                lay = lays[op.spec.kv_cache_dtype]
                v = VARIANTS[tag].variant(op.spec, max_m=token_tile(m), target=target)
                fn = ld(v)   # the binary the step runs at this M (its token tile's)

                def step(op=op, lay=lay):
                    w = lay.weights()
                    return op(lay.x, lay.res, lay.norm_w, w[0], w[1], w[2], lay.qn, lay.kn, lay.cs, lay.pos,
                              lay.k, lay.v, lay.slots, lay.bias, q_out=lay.q, xn_out=lay.xn,
                              residual_out=lay.res, **lay.kv_kw)

                def gemv(fn=fn, lay=lay, v=v, op=op):
                    fn(*lay.args_for(v, lay.weights(), op))

                cases.append((tag, step, gemv, _regs(ld.entry(v))))
            for r in range(runs):   # interleaved: every variant once per run
                for tag, step, gemv, regs in cases:
                    for what, f in (("step", step), ("GEMV", gemv)):
                        res.setdefault((spec.name, m, what, tag), {"regs": regs, "us": []})["us"].append(
                            time_graph(f)["median_us"])
                print(f"{spec.name} M={m} run {r + 1}: " + ", ".join(
                    f"{t} {res[spec.name, m, 'step', t]['us'][-1]:.2f}" for t, *_ in cases), flush=True)
    md = report(res, {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit(), **device_info()})
    write_report("qkv_fp8_ablation", md, os.path.join(os.path.dirname(__file__), "results"))


def report(res, meta) -> str:
    """The markdown table: per variant its runs' medians, their spread and its paired
    difference to each reference (median over runs of variant - reference, same run)."""
    def delta(k, ref):
        a, b = res[k]["us"], res[k[:3] + (ref,)]["us"]
        return statistics.median(x - y for x, y in zip(a, b))

    n = max(len(v["us"]) for v in res.values())
    runs = " | ".join(f"run {i + 1} µs" for i in range(n))
    lines = ["# qkv_fp8_ablation", "", f"{meta['date']} · {meta['device']} ({meta['sms']} SMs) · torch {meta['torch']} · commit "
             f"{meta['commit']} · benchmarks/qkv_fp8_ablation.py", "",
             "CUDA-graph replay (benchmarks.harness.time_graph), median per call; the variants run interleaved, "
             f"once per run, {n} runs. Spread: max - min over the runs. Δ: median over the runs of (variant - "
             "reference) in the same run. Weights rotate over copies exceeding L2 (as benchmarks.qkv --fp8).", "",
             f"| spec | M | what | variant | regs | {runs} | spread | Δ vs bf16 | Δ vs fp8 |",
             "|" + "---|" * (8 + n)]
    order = {t: i for i, t in enumerate(VARIANTS)}
    for k in sorted(res, key=lambda k: (k[0] != "flint", k[1], k[2] != "step", order[k[3]])):
        v, us = res[k], res[k]["us"]
        lines.append(f"| {' | '.join(map(str, k))} | {v['regs']} | " + " | ".join(f"{x:.2f}" for x in us)
                     + f" | {max(us) - min(us):.2f} | {delta(k, 'bf16'):+.2f} | {delta(k, 'fp8'):+.2f} |")
    lines += ["", "Variants (benchmarks/qkv_fp8_ablation.py):", ""]
    lines += [f"* `{t}`: {a.doc}" for t, a in VARIANTS.items() if t in {k[3] for k in res}]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if "--prebuild" in sys.argv:
        prebuild(sys.argv[sys.argv.index("--prebuild") + 1])
    elif "--diff" in sys.argv:
        diff_main()
    else:
        main()
