"""Benchmark the fused QKV step (RMSNorm + QKV GEMV + q/k norm, RoPE, cache write).

Cases:
* flint (hidden 2048, 32/4 heads of 128, NVFP4) at M = 1 and 8: the whole
  step (both kernels, PDL-chained) and the GEMV kernel alone;
* hidden 4096, 32/8 heads, bf16 weights: the GEMV kernel against its
  weight-read floor (goal >= 85%).

``--shapes`` (issue 15's report, results/qkv_shapes.md): the step and the
GEMV for hidden 1024 / 3584 / 5120 / 8192 (Qwen3-0.6B 16/8, Qwen2.5-7B 28/4
with bias, Qwen2.5-14B 40/8 with bias, Llama-3-70B 64/8; head_dim 128, TP 1),
bf16 and NVFP4 weights, M = 1 and 8.

``--tokens`` (issue 18, results/qkv_tokens.md): flint (NVFP4 and BF16
weights, hidden 2048) and hidden 4096 32/8 BF16 with max_tokens 64, the step,
the GEMV and the torch path at M = 1, 2, 4, 8, 16, 32, 64 (each M runs its
token tile's binary).

``--prebuild DIR [--tokens | --fp8 | --shapes]``: compile that mode's kernels
(every variant ``flintgen build`` makes for its specs) for sm_90a into cache
DIR, no GPU needed; carry DIR and set FLINTGEN_CACHE_DIR to it on the GPU.

``--fp8`` (issue 17, results/qkv_fp8.md): the flint and hidden-4096 steps at
M = 1 and 8 writing an e4m3 cache (k_scale / v_scale device tensors) against
the same step writing the bf16 cache, same weights and inputs.

``--stream`` (issue 18, results/qkv_stream.md): the BF16 specs of ``--tokens`` at
every M, the streaming design (persistent split-K grid, cp.async ring;
flintgen.kernels.qkv_stream) against the cluster design and the torch path,
the GEMV alone and the whole step; ``--configs w2,s6`` adds streaming configs (tiles per warp, ring depth);
with ``--shapes`` the BF16 shapes of ``--shapes`` instead (results/qkv_stream_shapes.md: which design the
8-token tile of hidden 1024..8192 should run, ``--ms 1,8 --configs s8g``).

``--sweep`` also times alternative launch configurations of both specs
(``sweep_configs``), each as the GEMV alone and as the whole step
(results/qkv_sweep.md).

Weights rotate over enough layer copies to exceed the 50 MB L2 (a real model's
layers stream from HBM), one copy per captured call. Floors: bytes / the read
bandwidth measured in the same process. Peer: torch F.linear on bf16 weights
(cuBLAS) for the GEMV alone.

    python -m benchmarks.qkv [--sweep | --shapes | --fp8 | --tokens | --stream] [--prebuild DIR]
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch

import flintgen
from benchmarks.harness import Row, prebuild_into, read_bandwidth, time_graph, write_results
from flintgen import quant
from flintgen.configs.qkv_config import QKVConfig, token_tile, token_tiles
from flintgen.kernels import qkv_stream
from flintgen.kernels.qkv import QKVDef, QKVOp
from flintgen.runtime import load_variant

L2_BYTES = 50 << 20
KDEF = QKVDef()


class Layers:
    """Per-layer weights (enough copies to defeat L2) and shared activations."""

    def __init__(self, spec, m, weights):
        dev = "cuda"
        fp8 = spec.kv_cache_dtype == "fp8_e4m3"
        h, d, n = spec.hidden_size, spec.head_dim, spec.qkv_out_features
        self.spec, self.m = spec, m
        bf = dict(dtype=torch.bfloat16, device=dev)
        self.x = torch.randn(m, h, **bf)
        self.res = torch.randn(m, h, **bf)
        self.norm_w = torch.randn(h, **bf) * 0.1 + 1
        self.w = weights
        self.qn = torch.randn(d, **bf) * 0.1 + 1 if spec.qk_norm else None
        self.kn = torch.randn(d, **bf) * 0.1 + 1 if spec.qk_norm else None
        self.cs = quant.rope_table(spec, 4096, dev) if spec.rope_style != "none" else None
        self.pos = torch.randint(0, 4096, (m,), device=dev)
        kv = spec.kv_heads_per_rank
        self.cache = torch.zeros(64, kv, 16, 2 * d, **bf)       # flint's HND layout
        self.kv_kw = {}
        if fp8:     # e4m3 pages, per-layer scales as device tensors
            self.cache = self.cache.to(torch.float8_e4m3fn)
            scale = torch.tensor([0.05], device=dev)
            self.kv_kw = {"k_scale": scale, "v_scale": scale.clone()}
        self.k = self.cache[..., :d].permute(0, 2, 1, 3)
        self.v = self.cache[..., d:].permute(0, 2, 1, 3)
        self.slots = torch.arange(m, device=dev) * 3
        self.q = torch.empty(m, spec.q_heads_per_rank * d, **bf)
        self.xn = torch.empty(m, h, **bf)
        self.bias = torch.randn(n, **bf) if spec.qkv_bias else None
        self.i = 0

    def weights(self):
        w = self.w[self.i % len(self.w)]
        self.i += 1
        return w

    def gemv_args(self, w):
        args = [self.xn, w[0]]
        if w[1] is not None:
            args += [w[1], w[2]]
        if self.bias is not None:
            args.append(self.bias)
        if self.qn is not None:
            args += [self.qn, self.kn]
        if self.cs is not None:
            args += [self.cs, self.pos]
        args += [self.slots, self.q, self.k, self.v]
        if self.kv_kw:      # an e4m3 cache: the layer's k_scale / v_scale tensors
            args += [self.kv_kw["k_scale"], self.kv_kw["v_scale"]]
        if self.qn is not None:
            args.append(1e-6)
        return args

    def args_for(self, v, w, op):
        """The GEMV binary ``v``'s arguments for weights ``w`` (``op``: whose workspace a streaming binary uses)."""
        if qkv_stream.is_stream(v):
            return self.stream_args(w, op, v)
        return self.gemv_args(w)

    def stream_args(self, w, op, v):
        """The streaming binary ``v``'s arguments (its table; ``op``'s workspace)."""
        p = dict(v.params)
        ws, counters = op._workspace.get(self.x.device)
        named = dict(xn=self.xn, weight=w[0], bias=self.bias, q_norm_weight=self.qn, k_norm_weight=self.kn,
                     cos_sin=self.cs, positions=self.pos, slot_mapping=self.slots, q=self.q, k_cache=self.k,
                     v_cache=self.v, workspace=ws, counters=counters, qk_eps=1e-6, **self.kv_kw)
        return [named[a.name] for a in qkv_stream.args_of(p)]


def torch_step(spec, lay, w):
    """The step in torch eager ops (what a model runs without flintgen), bf16
    weights: add + RMSNorm, F.linear, q / k RMSNorm, NeoX RoPE, K / V into the
    HND cache [blocks, kv, page, 2D] at the slots."""
    F = torch.nn.functional
    d, qh, kv = spec.head_dim, spec.q_heads_per_rank, spec.kv_heads_per_rank
    r = lay.x + lay.res
    xn = F.rms_norm(r, (r.shape[-1],), lay.norm_w, spec.rms_eps)
    qkv = F.linear(xn, w, lay.bias)
    q, k, v = qkv.split([qh * d, kv * d, kv * d], dim=-1)
    q, k, v = q.view(-1, qh, d), k.view(-1, kv, d), v.view(-1, kv, d)
    if lay.qn is not None:
        q, k = F.rms_norm(q, (d,), lay.qn, spec.rms_eps), F.rms_norm(k, (d,), lay.kn, spec.rms_eps)
    if lay.cs is not None:
        cos, sin = lay.cs[lay.pos].chunk(2, dim=-1)
        cos, sin = cos[:, None].repeat(1, 1, 2), sin[:, None].repeat(1, 1, 2)

        def rot(x):
            x1, x2 = x.float().chunk(2, dim=-1)
            return (x.float() * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)

        q, k = rot(q), rot(k)
    page = lay.cache.shape[2]
    lay.cache[lay.slots // page, :, lay.slots % page] = torch.cat((k, v), dim=-1)
    return q, r


def make_weights(spec, copies):
    """``copies`` independent weight sets (quantized on the GPU for NVFP4)."""
    n, h = spec.qkv_out_features, spec.hidden_size
    out = []
    for _ in range(copies):
        w = torch.randn(n, h, device="cuda") * 0.02
        if spec.weight_format == "nvfp4":
            packed, sw, gs = quant.quantize_nvfp4(w)
            out.append((packed, sw.view(torch.uint8), gs.reshape(1).to("cuda")))
        else:
            out.append((w.bfloat16(), None, None))
    return out


def weight_bytes(spec) -> int:
    n, h = spec.qkv_out_features, spec.hidden_size
    if spec.weight_format == "nvfp4":
        return n * h // 2 + (-(-n // 128) * 128) * (h // 16)
    return n * h * 2


def copies_for(spec) -> int:
    return max(2, -(-2 * L2_BYTES // weight_bytes(spec)))


def gemv_fn(spec, t, cfg=None, m=1):
    """The GEMV binary M tokens run (its token tile's) and its variant."""
    v = KDEF.variant(spec, config=cfg, max_m=token_tile(m), target=t)
    return load_variant(KDEF, spec, v, t)[0], v


def report_specs():
    """--shapes: (spec, token counts) per hidden size and weight format."""
    base = flintgen.get_preset("flint").replace(sliding_window=None, layer_types=("full",), sinks=False, tp_size=1)
    shapes = [("qwen3-0.6b", 1024, 16, 8, False, True), ("llama-3.2-3b", 3072, 24, 8, False, False),
              ("qwen2.5-7b", 3584, 28, 4, True, False),
              ("qwen2.5-14b", 5120, 40, 8, True, False), ("llama-3-70b", 8192, 64, 8, False, False)]
    return [(base.replace(name=f"{n}-{fmt}", hidden_size=h, num_q_heads=q, num_kv_heads=kv, qkv_bias=bias,
                          qk_norm=qk, weight_format=fmt), (1, 8))
            for n, h, q, kv, bias, qk in shapes for fmt in ("bf16", "nvfp4")]


TOKEN_COUNTS = (1, 2, 4, 8, 16, 32, 64)


def base_specs():
    """flint (NVFP4, hidden 2048) and hidden 4096 with 32/8 heads, BF16 weights."""
    flint = flintgen.get_preset("flint")
    big = flint.replace(hidden_size=4096, num_kv_heads=8, weight_format="bf16", sliding_window=None,
                        layer_types=("full",), sinks=False, name="h4096-32x8-bf16")
    return flint, big


def token_specs():
    """--tokens: (spec, token counts), each spec with max_tokens 64."""
    flint, big = base_specs()
    specs = [flint, flint.replace(weight_format="bf16", name="flint-bf16"), big]
    return [(s.replace(max_tokens=64), TOKEN_COUNTS) for s in specs]


def fp8_specs():
    flint, big = base_specs()
    return [s.replace(kv_cache_dtype=kv) for s in (flint, big) for kv in ("bf16", "fp8_e4m3")]


class ProductionVariantDef(QKVDef):
    """The op's own configuration per token tile with one change: weights prefetched into L2 before the
    grid-dependency wait (``l2``: units per range on the streaming design, a huge number for the whole
    range; the rows' rest on the cluster design) and / or the TMA ring on the streaming wgmma tiles (``tma``; the TMA
    ring takes one-step units, so a tile of two-step units, the 8-token rule's, also goes back to one, and no read
    policy) and / or the weights read with the L2 evict-first policy or not (``evict``; None: the op's own);
    ``no_l2``: no L2 prefetch on either design (instead of ``l2``)."""

    def __init__(self, l2: int = 0, tma: bool = False, evict: bool | None = None, group: int = 1,
                 no_l2: bool = False):
        super().__init__()
        if no_l2 and l2:
            raise ValueError(f"ProductionVariantDef: no_l2 with l2 = {l2}: one or the other")
        self.l2, self.tma, self.evict, self.group, self.no_l2 = l2, tma, evict, group, no_l2

    def config(self, spec, max_m=8, target=None):
        cfg = super().config(spec, max_m, target)
        evict = cfg.evict_first if self.evict is None else self.evict   # None: the op's own read policy
        if isinstance(cfg, qkv_stream.StreamConfig):
            # L<n>[G<g>] replaces the op's L2 prefetch (n units ahead, g per rolling prefetch), X drops it, else
            # it is kept
            l2, group = ((self.l2, self.group) if self.l2 else (0, 1) if self.no_l2
                         else (cfg.l2_prefetch, cfg.l2_prefetch_group))
            if self.tma and cfg.wgmma:   # the TMA ring's units are one K step (and take no read policy)
                return replace(cfg, l2_prefetch=l2, l2_prefetch_group=group, tma=True, unit_steps=1,
                               evict_first=False)
            return replace(cfg, l2_prefetch=l2, l2_prefetch_group=group, evict_first=evict)
        # the cluster design: L2, none (X) or the op's own
        return replace(cfg, l2_prefetch=not self.no_l2 and (cfg.l2_prefetch or self.l2 > 0), evict_first=evict)


def stream_configs():
    """--stream: (label, config, kernel def) of the designs timed per M. ``--configs w2,s6,w2s6,p3c2,s6g,L,L8,T,TL``
    adds streaming configs (w: 16-row tiles per warp, s: ring stages, p: units prefetched in registers (the
    register path), c: CTAs per SM, g: wgmma, t: the ring filled by TMA, f: tokens per finishing slice, l: units
    prefetched into L2 before the grid-dependency wait (G<n>: the ring's rolling prefetch n units at a time), k: CTAs
    per block, the grid aligned to blocks, d: those CTAs one cluster reducing through distributed shared memory, u:
    K steps of 64 per unit and ring stage, e: weights read with the L2 evict-first policy) and the op's own configs
    with L2 prefetch (L: whole ranges / rows, L8: 8 units of a streaming range; L1G8: one unit ahead, the ring's
    rolling prefetch 8 units per bulk op and row; X: none on either design) and / or the TMA ring on its wgmma
    tiles (T, TL, TL8) and / or, last, the weights read with the L2 evict-first policy or not (E, N, LE, L8N, XN;
    without either, the op's own policy; ProductionVariantDef),
    and P: the op's own binaries again through an op of their own, timed where P stands in the list (a control:
    what two timings of identical binaries differ by in one process, 0.7 us in the step once,
    qkv_stream_cluster.md third A/B); ``--no-fill`` leaves out the ring filling shared memory. A config a spec
    cannot take (its plan refuses the shape) is skipped on that spec, with a line saying why (``usable``)."""
    import re

    out = [("production", None, KDEF)]
    if "--no-fill" not in sys.argv:
        out.append(("stream", qkv_stream.StreamConfig(), KDEF))
    if "--configs" in sys.argv:
        for c in sys.argv[sys.argv.index("--configs") + 1].split(","):
            if c == "P":
                out.append(("production control", None, KDEF))
                continue
            # T: TMA weights; X: no L2 prefetch, L: L2 prefetch (all of a range; L8: 8 units; G<n>: the ring's
            # rolling prefetch n units at a time); E / N: evict-first reads or not (else the op's own)
            prod = re.fullmatch(r"(T)?(?:(X)|L(\d*)(?:G(\d+))?)?([EN])?", c)
            if c and prod:
                tma, x, l2, grp, ev = prod.groups()
                l2 = 0 if l2 is None else int(l2 or qkv_stream.MAX_L2_PREFETCH)
                out.append((f"production {c}", None, ProductionVariantDef(l2=l2, tma=tma is not None,
                                                                           evict=None if ev is None else ev == "E",
                                                                           group=int(grp or 1), no_l2=x is not None)))
                continue
            parts = re.fullmatch(r"(?:w(\d+))?(?:s(\d+))?(?:p(\d+))?(?:c(\d+))?(g)?(t)?(?:f(\d+))?"
                                 r"(?:l(\d+)(?:G(\d+))?)?(?:k(\d+))?(d)?(?:u(\d+))?(e)?", c)
            if not c or parts is None:
                raise ValueError(f"--configs label {c!r} is not one of: w<tiles>s<stages>p<units>c<ctas>[g][t]"
                                 "f<tokens>l<units>[G<units>]k<splits>[d]u<steps>[e] (in that order, each part "
                                 "optional), T, X, L, L<units>, TL, TL<units>, L<units>G<units>, each optionally "
                                 "followed by E or N, P")
            w, st, p, cs, g, tma, f, l2, grp, k, dsmem, us, ev = parts.groups()
            out.append((f"stream {c}", qkv_stream.StreamConfig(stages=int(st or 0), warp_tiles=int(w or 1),
                                                                prefetch=int(p or 0), ctas_per_sm=int(cs or 1),
                                                                wgmma=g is not None, finish_tokens=int(f or 0),
                                                                l2_prefetch=int(l2 or 0), tma=tma is not None,
                                                                splits=int(k or 0), cluster=dsmem is not None,
                                                                unit_steps=int(us or 1), evict_first=ev is not None,
                                                                l2_prefetch_group=int(grp or 1)),
                          KDEF))
    return out


def usable(spec, label, cfg, kd, tiles, target):
    """Whether ``spec`` takes stream config ``label`` at every tile of ``tiles`` (prints why not)."""
    try:
        for t in tiles:
            kd.variant(spec, config=cfg, max_m=t, target=target)
    except ValueError as e:
        print(f"skipped: {label} on {spec.name}: {e}", flush=True)
        return False
    return True


def mode_plan():
    """The table of the mode in sys.argv: ([(spec, token counts)], results name)."""
    if "--stream" in sys.argv:
        # --shapes: the BF16 shapes of --shapes (hidden 1024..8192) instead of flint-bf16 and hidden 4096
        specs = ([(s.replace(max_tokens=64), TOKEN_COUNTS) for s, _ in report_specs()] if "--shapes" in sys.argv
                 else token_specs())
        name = "qkv_stream_shapes" if "--shapes" in sys.argv else "qkv_stream"
        if "--results" in sys.argv:   # another table's name (a run of other configs beside production)
            name = sys.argv[sys.argv.index("--results") + 1]
        if "--ms" in sys.argv:   # these token counts only, on specs whose max_tokens is their largest tile
            ms = tuple(int(m) for m in sys.argv[sys.argv.index("--ms") + 1].split(","))
            return [(s.replace(max_tokens=token_tile(max(ms))), ms) for s, _ in specs
                    if s.weight_format == "bf16"], name
        return [(s, ms) for s, ms in specs if s.weight_format == "bf16"], name
    if "--shapes" in sys.argv:
        return report_specs(), "qkv_shapes"
    if "--tokens" in sys.argv:
        return token_specs(), "qkv_tokens"
    return [(s, (1, 8)) for s in base_specs()], "qkv"


def prebuild(root):
    """Compile every variant of the mode's specs for sm_90a into ``root`` (entries listed in prebuilt.txt)."""
    from flintgen import toolchain
    from flintgen.cli import _plan

    specs = fp8_specs() if "--fp8" in sys.argv else [s for s, _ in mode_plan()[0]]
    target = toolchain.resolve_target(arch="sm_90a", num_sms=132)
    todo = [(s, k, v) for s in specs for k, v in _plan(s, target, ("rms_norm", "qkv"))]
    if "--stream" in sys.argv:
        todo += [(s, "qkv", kd.variant(s, config=cfg, max_m=t, target=target)) for s in specs
                 for label, cfg, kd in stream_configs() if (cfg is not None or kd is not KDEF)
                 and usable(s, label, cfg, kd, token_tiles(s.max_tokens), target)
                 for t in token_tiles(s.max_tokens)]
    n = prebuild_into(todo, target, root)
    print(f"prebuilt {len(todo)} variants ({n} entries, listed in prebuilt.txt) into {root}")


def fp8_main():
    """--fp8: the step with an e4m3 cache write against the bf16 one."""
    bw = read_bandwidth()
    rows = []
    for spec in base_specs():
        weights = make_weights(spec, copies_for(spec))
        wb = weight_bytes(spec)
        for m in (1, 8):
            res = {}
            for kv in ("bf16", "fp8_e4m3"):
                s8 = spec.replace(kv_cache_dtype=kv)
                op = flintgen.get_kernel(s8, "qkv")
                op.warmup(torch.device("cuda"))
                lay = Layers(s8, m, weights)

                def step(op=op, lay=lay):
                    w = lay.weights()
                    return op(lay.x, lay.res, lay.norm_w, w[0], w[1], w[2], lay.qn, lay.kn, lay.cs, lay.pos,
                              lay.k, lay.v, lay.slots, lay.bias, q_out=lay.q, xn_out=lay.xn,
                              residual_out=lay.res, **lay.kv_kw)

                res[kv] = time_graph(step)
            act = m * spec.hidden_size * 2 * 4 + m * spec.qkv_out_features * 2
            case = {"spec": spec.name, "weights": spec.weight_format, "M": m, "what": "RMSNorm + QKV step, fp8 cache"}
            rows.append(Row(case, res["fp8_e4m3"]["median_us"], (wb + act) / bw * 1e6,
                            {"same step, bf16 cache": res["bf16"]["median_us"]},
                            {"p10_us": res["fp8_e4m3"]["p10_us"], "p90_us": res["fp8_e4m3"]["p90_us"]}))
            print(case, f"fp8 {res['fp8_e4m3']['median_us']:.2f} us, bf16 {res['bf16']['median_us']:.2f} us",
                  flush=True)
    print(write_results("qkv_fp8", rows, bw, "The fused step (RMSNorm + QKV GEMV + epilogue) writing e4m3 K/V "
                        "(k_scale = v_scale = 0.05 device tensors) against the same step writing the bf16 cache; "
                        "weights rotate over copies exceeding L2."))


def stream_main():
    """--stream: each design's GEMV and step per M, the torch path beside them."""
    from flintgen import toolchain

    t = toolchain.resolve_target()
    bw = read_bandwidth()
    rows = []
    for spec, ms in mode_plan()[0]:
        wb = weight_bytes(spec)
        weights = make_weights(spec, copies_for(spec))
        wl = [w[0] for w in weights]
        ops = {}
        for label, cfg, kd in stream_configs():
            if not usable(spec, label, cfg, kd, token_tiles(spec.max_tokens), t):
                continue
            ops[label] = QKVOp(kd, spec, t, lambda v, kd=kd: load_variant(kd, spec, v, t)[0], config=cfg)
            ops[label].warmup(torch.device("cuda"))
        for m in ms:
            lay = Layers(spec, m, weights)
            act = m * spec.hidden_size * 2 * 4 + m * spec.qkv_out_features * 2
            j = [0]

            def torch_path():
                j[0] += 1
                return torch_step(spec, lay, wl[j[0] % len(wl)])

            def torch_linear():
                j[0] += 1
                return torch.nn.functional.linear(lay.xn, wl[j[0] % len(wl)])

            peers_step = {"torch eager step, bf16": time_graph(torch_path)["median_us"]}
            peers_gemv = {"torch F.linear bf16 (GEMV only)": time_graph(torch_linear)["median_us"]}
            for label, op in ops.items():
                v = op._variants[token_tile(m)]
                fn = load_variant(op._def, spec, v, t)[0]

                def step(op=op):
                    w = lay.weights()
                    return op(lay.x, lay.res, lay.norm_w, w[0], w[1], w[2], lay.qn, lay.kn, lay.cs, lay.pos,
                              lay.k, lay.v, lay.slots, lay.bias, q_out=lay.q, xn_out=lay.xn,
                              residual_out=lay.res, **lay.kv_kw)

                def gemv(fn=fn, op=op, v=v):
                    fn(*lay.args_for(v, lay.weights(), op))

                whole, alone = time_graph(step), time_graph(gemv)
                case = {"spec": spec.name, "M": m, "design": label}
                rows.append(Row(dict(case, what="RMSNorm + QKV step"), whole["median_us"], (wb + act) / bw * 1e6,
                                peers_step, {"p10_us": whole["p10_us"], "p90_us": whole["p90_us"], "variant": v.name}))
                rows.append(Row(dict(case, what="QKV GEMV kernel"), alone["median_us"], wb / bw * 1e6, peers_gemv,
                                {"p10_us": alone["p10_us"], "p90_us": alone["p90_us"], "variant": v.name}))
                print(spec.name, m, label, f"step {whole['median_us']:.2f} us, GEMV {alone['median_us']:.2f} us "
                      f"({rows[-1].pct_of_floor:.0f}% of floor)", flush=True)
    print(write_results(mode_plan()[1], rows, bw, "BF16 weights rotate over copies exceeding L2. Floor: weight "
                        "(+ activation) bytes / read bandwidth. Designs: production = what the op picks per token tile "
                        "(qkv_stream_plan.stream_config: the cluster design at M <= 8 below hidden 3072; else the "
                        "streaming design's wgmma ring, every tile reading its weights evict-first: at the 8-token "
                        "tile units of two K steps filling shared memory, one unit prefetched into L2 ahead up to "
                        "hidden 4096; from 16 tokens two CTAs per block as one cluster reducing through DSMEM, the "
                        "ring filling shared memory, where that grid is 0.6-1 x the SMs and a head is one block "
                        "(up to hidden 4096 units prefetched into L2 ahead in groups: weights <= 24 MB 8 ahead / 8, "
                        "the whole range at 64 tokens, else 1 / 4, 1 / 8 at 16 tokens), else 8 stages at 16 / 32 "
                        "tokens and 6 at 64), stream = a configuration as labelled (s = stages, g = wgmma, else "
                        "mma.sync; l = units prefetched into L2; k = CTAs per block, d = those CTAs one cluster; "
                        "u = K steps per unit; e = evict-first reads)."))


def main():
    if "--prebuild" in sys.argv:
        return prebuild(sys.argv[sys.argv.index("--prebuild") + 1])
    if "--fp8" in sys.argv:
        return fp8_main()
    if "--stream" in sys.argv:
        return stream_main()
    sweep = "--sweep" in sys.argv
    plan, name = mode_plan()
    from flintgen import toolchain

    t = toolchain.resolve_target()
    bw = read_bandwidth()
    rows = []
    for spec, ms in plan:
        op = flintgen.get_kernel(spec, "qkv")
        op.warmup(torch.device("cuda"))
        wb = weight_bytes(spec)
        weights = make_weights(spec, copies_for(spec))
        # The torch path's GEMV: F.linear on bf16 weights of the same shape (torch has no NVFP4 GEMV).
        wl = [w[0] for w in weights] if spec.weight_format == "bf16" else [
            w[0] for w in make_weights(spec.replace(weight_format="bf16"), copies_for(spec.replace(weight_format="bf16")))]
        for m in ms:
            lay = Layers(spec, m, weights)
            fn, v = gemv_fn(spec, t, m=m)

            def step(op=op):
                w = lay.weights()
                return op(lay.x, lay.res, lay.norm_w, w[0], w[1], w[2], lay.qn, lay.kn, lay.cs, lay.pos,
                          lay.k, lay.v, lay.slots, lay.bias, q_out=lay.q, xn_out=lay.xn,
                          residual_out=lay.res, **lay.kv_kw)

            def gemv():
                fn(*lay.args_for(v, lay.weights(), op))

            whole = time_graph(step)
            alone = time_graph(gemv)
            h = spec.hidden_size
            act = m * h * 2 * 4 + m * spec.qkv_out_features * 2
            j = [0]

            def torch_linear():
                j[0] += 1
                return torch.nn.functional.linear(lay.xn, wl[j[0] % len(wl)])

            peers = {"torch F.linear bf16 (GEMV only)": time_graph(torch_linear)["median_us"]}

            def torch_path():
                j[0] += 1
                return torch_step(spec, lay, wl[j[0] % len(wl)])

            step_peers = {"torch eager step, bf16": time_graph(torch_path)["median_us"]}
            case = {"spec": spec.name, "weights": spec.weight_format, "M": m}
            rows.append(Row(dict(case, what="RMSNorm + QKV step"), whole["median_us"], (wb + act) / bw * 1e6,
                            step_peers, {"p10_us": whole["p10_us"], "p90_us": whole["p90_us"], "variant": v.name}))
            rows.append(Row(dict(case, what="QKV GEMV kernel"), alone["median_us"], wb / bw * 1e6, peers,
                            {"p10_us": alone["p10_us"], "p90_us": alone["p90_us"], "variant": v.name}))
            print(rows[-2].case, f"{rows[-2].flintgen_us:.2f} us", rows[-1].case,
                  f"{rows[-1].flintgen_us:.2f} us ({rows[-1].pct_of_floor:.0f}% of floor)", flush=True)
            if sweep:
                for cfg in sweep_configs(spec):
                    f2, v2 = gemv_fn(spec, t, cfg, m)
                    op2 = QKVOp(KDEF, spec, t, lambda v: load_variant(KDEF, spec, v, t)[0], config=cfg)
                    op2.warmup(torch.device("cuda"))
                    r = time_graph(lambda: f2(*lay.args_for(v2, lay.weights(), op2)))
                    r_step = time_graph(lambda: step(op2))
                    tag = (f"GEMV r{cfg.rows} w{cfg.warps} p{cfg.prefetch} early{cfg.early_dequant}"
                           + (" l2" if cfg.l2_prefetch else ""))
                    rows.append(Row(dict(case, what=tag),
                                    r["median_us"], wb / bw * 1e6, {}, {"variant": v2.name}))
                    rows.append(Row(dict(case, what=tag.replace("GEMV", "step")), r_step["median_us"],
                                    (wb + act) / bw * 1e6, {}, {"variant": v2.name}))
                    print("  sweep", tag, f"{r['median_us']:.2f} us ({rows[-2].pct_of_floor:.0f}%), step "
                          f"{r_step['median_us']:.2f} us", flush=True)
    md = write_results(name, rows, bw, "Weights rotate over copies exceeding L2. Floor: weight (+ activation) "
                       "bytes / read bandwidth. Peer: torch F.linear with bf16 weights of the same shape (cuBLAS; "
                       "for NVFP4 rows too: torch has no NVFP4 GEMV), the GEMV alone.")
    print(md)


def sweep_configs(spec):
    """Launch configurations to compare with the heuristic's (all compile
    without spills; registers noted)."""
    C = QKVConfig
    if spec.weight_format == "nvfp4":
        cands = [C(32, 4, 8, 4),           # 88 registers: everything dequantized after the wait
                 C(32, 4, 8, 4, 1),        # 97
                 C(32, 4, 8, 4, 3),        # 142: one CTA per SM
                 C(16, 8, 8, 4),           # 8-CTA clusters (58)
                 C(16, 8, 8, 4, 4)]        # 95
    else:
        cands = [C(16, 8, 8, 4), C(16, 8, 8, 2), C(16, 8, 8, 6), C(16, 8, 4, 4),
                 C(32, 4, 8, 2), C(32, 4, 4, 2), C(32, 4, 8, 3)]
    base = KDEF.config(spec)
    cands.append(replace(base, l2_prefetch=True))   # the weight rows past the prefetched steps into L2 first
    return [c for c in cands if c != base and c.cluster * c.rows == spec.head_dim]


if __name__ == "__main__":
    main()
