"""The fused QKV step's RMSNorm inside the streaming GEMV (StreamConfig.fuse_norm,
flintgen.device.fused_norm): the virtual-thread geometry that reproduces the
standalone kernel's summation order, the argument table, the refusals, compile
checks (marked compile) and, on the H200 (marked gpu), the fused step against
the unfused one: the same bits everywhere (q, the K/V cache, xn, the residual),
with and without a residual, in place, across launches and in a CUDA graph.
"""

from __future__ import annotations

import pytest

from flintgen.configs import qkv_stream_plan as sp
from flintgen.configs.qkv_stream_plan import StreamConfig
from flintgen.configs.rms_norm_config import RMSNormConfig
from flintgen.device.fused_norm import RowNorm


@pytest.mark.parametrize("hidden, threads", [(4096, 256), (2048, 256), (2880, 128), (2560, 256), (16384, 256),
                                             (896, 128), (3584, 256), (1024, 256), (5120, 256), (8192, 128)])
def test_virtual_threads_cover_the_standalone_kernel(hidden, threads):
    """Every 16-byte vector of a row is read once, by the virtual thread the standalone kernel gives it (vt =
    idx % rt), at the slot the standalone thread adds it in (v = idx // rt); a real thread's virtual threads
    lie in whole standalone warps, and the warp sums are the standalone kernel's warps, added in order."""
    cfg = RMSNormConfig.for_hidden(hidden)
    rn = RowNorm(hidden, cfg.threads, cfg.vec_per_thread, threads)
    assert rn.rt % 32 == 0 and threads % 32 == 0 and rn.warps <= sp.NORM_RED_FLOATS
    seen = {}
    for tid in range(threads):
        for k in range(rn.virtual):
            vt = tid + k * threads
            if vt >= rn.rt:
                continue
            assert vt // 32 == (tid // 32) + k * (threads // 32)       # whole warps: the butterfly's lanes
            for v in range(rn.vecs):
                idx = vt + v * rn.rt
                if idx < rn.num_vecs:
                    assert idx not in seen
                    seen[idx] = (vt, v)
    assert sorted(seen) == list(range(hidden // 8))
    assert all(vt == idx % cfg.threads and v == idx // cfg.threads for idx, (vt, v) in seen.items())


HARNESS = """
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.memory import SmemAllocator

from flintgen.device import fused_norm, ptx

NORM = fused_norm.RowNorm({hidden}, {rt}, {vecs}, {threads}, {offset})


class Harness:
    @cute.jit
    def __call__(self, x, residual, residual_out, xn, weight, eps, has_residual, rows):
        self.kernel(x, residual, residual_out, xn, weight, eps, has_residual).launch(
            grid=(rows, 1, 1), block=({threads}, 1, 1))

    @cute.kernel
    def kernel(self, x, residual, residual_out, xn, weight, eps, has_residual):
        tid, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        red = ptx.smem_addr(SmemAllocator().allocate_array(Float32, 32, byte_alignment=16))
        w = NORM.load_weight(weight.iterator.toint(), tid)
        NORM.normalize(x.iterator.toint(), residual.iterator.toint(), residual_out.iterator.toint(),
                       xn.iterator.toint(), w, row, eps, has_residual, tid, red)
"""


@pytest.mark.parametrize("hidden, threads, offset, residual", [(4096, 256, 0, True), (2880, 128, 0, True),
                                                              (2560, 256, 1, True), (1024, 256, 0, False),
                                                              (16384, 256, 0, True)])
def test_emulated_fused_norm_is_the_standalone_kernel(hidden, threads, offset, residual, monkeypatch):
    """Both run in the CPU emulator (tests/da_emulator.py: the rendered rms_norm module and
    flintgen.device.fused_norm against the same mocks, fp32 in numpy): for random rows the fused norm's xn and
    residual bytes equal the standalone kernel's, and so do the rows' fp32 sums of squares (rsqrt's arguments,
    recorded): the additions run in the same order. (The GPU test test_fused_equals_unfused checks the compiled
    code.) The sums tell orders apart where xn's bf16 rounding rarely does: at hidden 4096 the standalone
    kernel's threads halved (two vectors summed per thread) gives other sums.
    """
    import da_emulator
    import numpy as np
    from da_emulator import GlobalMemory, Tensor, load

    sums = []
    make_ptx = da_emulator._ptx

    def recording_ptx(gmem):   # rsqrt's argument: the row's sum of squares / hidden + eps, bit for bit
        p = make_ptx(gmem)
        rsqrt = p.rsqrt
        p.rsqrt = lambda a: (sums.append(np.float32(a).view(np.uint32).item()), rsqrt(a))[1]
        return p

    monkeypatch.setattr(da_emulator, "_ptx", recording_ptx)

    from flintgen import codegen
    from flintgen.kernels import get_def
    from flintgen.kernels.base import Variant

    rows = 3
    rng = np.random.default_rng(hidden + threads)

    def bf16(a):
        return (np.asarray(a, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)

    x = bf16(rng.standard_normal((rows, hidden)) * 3)
    res = bf16(rng.standard_normal((rows, hidden)))
    w = bf16(rng.standard_normal(hidden) * 0.2 + (0.0 if offset else 1.0))
    eps = np.float32(1e-6)
    rms = get_def("rms_norm")
    cfg = RMSNormConfig.for_hidden(hidden)
    v = Variant.of("rms_norm", hidden=hidden, has_residual=residual, **({"norm_weight_offset": offset} if offset else {}))
    src = codegen.render("rms_norm", rms.template_of(v), dict(rms.render_params(None, v)))

    def standalone():
        gm = GlobalMemory(64 << 20)
        ns = load(src, gm, modules=("reduce",))
        tx, tr, tro, txn, tw = (Tensor(gm, a.copy()) for a in (x, res, np.zeros_like(x), np.zeros_like(x), w))
        if residual:
            ns["RMSNorm"]()(tx, tr, tro, txn, tw, eps, None)
        else:
            ns["RMSNorm"]()(tx, txn, tw, eps, None)
        return txn.numpy().copy(), tro.numpy().copy()

    def fused(t, rt=cfg.threads, vecs=cfg.vec_per_thread):
        gm = GlobalMemory(64 << 20)
        ns = load(HARNESS.format(hidden=hidden, rt=rt, vecs=vecs, threads=t, offset=offset),
                  gm, modules=("reduce", "fused_norm"))
        tx, tr, tro, txn, tw = (Tensor(gm, a.copy()) for a in (x, res if residual else x, np.zeros_like(x),
                                                                 np.zeros_like(x), w))
        ns["Harness"]()(tx, tr, tro, txn, tw, eps, int(residual), rows)
        return txn.numpy().copy(), tro.numpy().copy()

    xn_s, res_s = standalone()
    sums_s, sums[:] = sorted(set(sums)), []
    xn_f, res_f = fused(threads)
    sums_f, sums[:] = sorted(set(sums)), []
    assert len(sums_s) == rows and sums_f == sums_s
    assert np.array_equal(xn_f, xn_s)
    if residual:
        assert np.array_equal(res_f, res_s) and res_s.any()
    else:
        assert not res_f.any()                         # nothing written without a residual
    if hidden == 4096:   # the check can fail: half the standalone threads (two vectors summed per thread) is
        fused(threads, rt=cfg.threads // 2, vecs=2 * cfg.vec_per_thread)   # another order
        assert sorted(set(sums)) != sums_s


def test_args_and_variant():
    """A fused variant takes x, residual, residual_out, the RMSNorm weight, eps and has_residual by name; the
    unfused ones' tables are unchanged; the Gemma offset is a parameter of fused variants only."""
    from test_qkv import SPECS
    from test_qkv_stream import KDEF, T132, _spec

    from flintgen.kernels import qkv_stream

    cfg = StreamConfig(stages=8, wgmma=True, fuse_norm=True)
    v = KDEF.variant(_spec("bf16_4096"), config=cfg, max_m=8, target=T132)
    names = [a.name for a in qkv_stream.args_of(dict(v.params))]
    assert names[:6] == ["xn", "weight", "x", "residual", "residual_out", "norm_weight"]
    assert names[-2:] == ["eps", "has_residual"] and qkv_stream.fuses_norm(v)
    plain = KDEF.variant(_spec("bf16_4096"), config=StreamConfig(stages=8, wgmma=True), max_m=8, target=T132)
    assert "x" not in [a.name for a in qkv_stream.args_of(dict(plain.params))] and not qkv_stream.fuses_norm(plain)
    gemma = SPECS["gemma3_4b"].replace(weight_format="bf16", max_tokens=64)
    vg = KDEF.variant(gemma, config=cfg, max_m=16, target=T132)
    assert dict(vg.params)["rms_offset"] == 1 and KDEF.render_params(gemma, vg)["rms_offset"] == 1
    p = qkv_stream.plan_of(dict(v.params))
    assert p.counters == p.heads + sp.LAUNCH_COUNTERS and p.launch_counters


def test_refusals():
    with pytest.raises(ValueError, match=r"fuse_norm = True \(the RMSNorm in the GEMV\) feeds xn to the cp.async "
                                         r"ring: prefetch = 2 must be 0 and tma = False False"):
        StreamConfig(prefetch=2, fuse_norm=True)
    with pytest.raises(ValueError, match=r"prefetch = 0 must be 0 and tma = True False"):
        StreamConfig(stages=8, wgmma=True, tma=True, fuse_norm=True)


# ----------------------------------------------------------------- compiled
COMPILE = [("bf16_4096", 8, StreamConfig(stages=8, wgmma=True, fuse_norm=True)),
           ("bf16_4096", 8, StreamConfig(stages=8, wgmma=True, finish_tokens=8, pool_steps=13, fuse_norm=True)),
           ("bf16_4096", 64, StreamConfig(stages=6, wgmma=True, finish_tokens=32, fuse_norm=True)),
           ("oss_bf16", 16, StreamConfig(stages=8, wgmma=True, fuse_norm=True)),        # hidden 2880: 3 virtual threads
           ("h16384_bf16", 8, StreamConfig(stages=8, wgmma=True, fuse_norm=True)),      # 2 vectors per thread
           ("d96_r24", 32, StreamConfig(stages=6, fuse_norm=True)),                     # the mma.sync ring
           ("gemma3_4b_bf16", 16, StreamConfig(stages=8, wgmma=True, fuse_norm=True)),  # 1 + w, 320 threads
           ("glm4_fp8", 8, StreamConfig(stages=8, wgmma=True, fuse_norm=True))]


def _spec_of(name):
    from test_qkv import SPECS
    from test_qkv_stream import _spec

    if name == "gemma3_4b_bf16":
        SPECS.setdefault(name, SPECS["gemma3_4b"].replace(weight_format="bf16"))
    return _spec(name)


@pytest.mark.compile
@pytest.mark.parametrize("name, max_m, cfg", COMPILE, ids=[f"{n}-M{m}-{i}" for i, (n, m, _) in enumerate(COMPILE)])
def test_fused_norm_compiles_clean(name, max_m, cfg):
    """Spill-free sm_90a binaries: the weight loaded before the grid-dependency wait, x / residual after it,
    one rsqrt more than the epilogue's, a row count released (acq_rel) and awaited (acquire) before the first
    xn copy, and the launch counters reset by the last CTA to leave."""
    from test_qkv_stream import _compiled

    p, ptx = _compiled(_spec_of(name), cfg, max_m)
    assert p["fuse_norm"] and p["launch_counters"] == sp.LAUNCH_COUNTERS
    wait = ptx.index("griddepcontrol.wait")
    assert ptx.index("ld.global.L1::no_allocate.v4.u32") < wait        # the RMSNorm weight
    assert ptx.index("ld.global.v4.u32") > wait                       # x and residual
    first_rsqrt = ptx.index("rsqrt.approx", wait)
    assert first_rsqrt < ptx.index("ld.acquire.gpu", wait) < ptx.index("cp.async.cg.shared.global", first_rsqrt)
    cfg_norm = RMSNormConfig.for_hidden(p["hidden"])
    assert (p["norm_threads"], p["norm_vecs"]) == (cfg_norm.threads, cfg_norm.vec_per_thread)
    # the launch counters' resets, then the heads': by the finishers' departures or the completing CTA's publish
    heads = p["max_owned"] if p["finish_slices"] else p["slots_per_cta"]
    assert ptx.count("st.relaxed.gpu.global.s32") == sp.LAUNCH_COUNTERS + heads


# ----------------------------------------------------------------- GPU
def _pair(name, max_tokens, cfg):
    """The op with ``cfg`` fused and the same config unfused (the RMSNorm kernel before the GEMV)."""
    from dataclasses import replace

    from test_qkv import SPECS
    from test_qkv_stream import _op

    key = f"{name}_m{max_tokens}"
    SPECS.setdefault(key, _spec_of(name).replace(max_tokens=max_tokens))
    return key, _op(SPECS[key], cfg), _op(SPECS[key], replace(cfg, fuse_norm=False))


GPU_CASES = [("bf16_4096", 8, m, StreamConfig(stages=8, wgmma=True, fuse_norm=True)) for m in (1, 5, 8)] + [
    ("bf16_4096", 8, 8, StreamConfig(stages=8, wgmma=True, finish_tokens=8, pool_steps=13, fuse_norm=True)),
    ("bf16_4096", 64, 33, StreamConfig(stages=6, wgmma=True, finish_tokens=32, fuse_norm=True)),
    ("oss_bf16", 16, 11, StreamConfig(stages=8, wgmma=True, fuse_norm=True)),
    ("h16384_bf16", 8, 3, StreamConfig(stages=8, wgmma=True, fuse_norm=True)),
    ("d96_r24", 32, 20, StreamConfig(stages=6, fuse_norm=True)),
    ("gemma3_4b_bf16", 16, 16, StreamConfig(stages=8, wgmma=True, fuse_norm=True))]   # (fp8: compiled above)


@pytest.mark.gpu
@pytest.mark.parametrize("name, max_tokens, m, cfg", GPU_CASES,
                         ids=[f"{n}-t{t}-M{m}-{i}" for i, (n, t, m, _) in enumerate(GPU_CASES)])
def test_fused_equals_unfused(name, max_tokens, m, cfg):
    """Fresh random inputs, three launches: the fused step's q, K/V cache, xn and residual equal the unfused
    step's bit for bit (with a residual, without one, and in place: residual_out = residual), and
    test_qkv's numerics contract holds for the fused op on its own; counters end at zero."""
    import torch
    from test_qkv import Case, _numerics
    from test_qkv_stream import _counters_zero

    key, fused, plain = _pair(name, max_tokens, cfg)
    for seed, mode in ((1, "residual"), (2, "none"), (3, "in place")):
        c = Case(fused.spec, m, seed=seed * 100 + m, n_slots=max(1, m - 1), residual=mode != "none")
        outs = []
        for op in (fused, plain):
            a = list(c.args())
            res = a[1].clone() if a[1] is not None else None
            a[1] = res
            c.poison()
            xn = torch.full_like(c.x, float("nan"))
            kw = dict(xn_out=xn)
            if mode == "in place":
                kw["residual_out"] = res
            q, r = op(*a, **kw)
            torch.cuda.synchronize()
            outs.append((q.clone(), r.clone(), xn.clone(), c.k_cache.clone(), c.v_cache.clone()))
        for what, f, u in zip(("q", "residual", "xn", "k_cache", "v_cache"), *outs):
            assert torch.equal(f.view(torch.uint8), u.view(torch.uint8)), f"{name} M={m} {mode}: {what}"
    _numerics(fused, key, m, max(1, m - 1 - m // 8))
    _counters_zero(fused)


GRAPH_CFG = StreamConfig(stages=8, wgmma=True, finish_tokens=8, pool_steps=8, fuse_norm=True)


@pytest.mark.gpu
def test_fused_graph_replay_with_changed_inputs():
    """A graph of the fused step replays with new x / residual / weights in place and matches eager unfused
    calls on the same inputs, bit for bit (the row count reset inside the graph)."""
    import torch
    from test_qkv import Case
    from test_qkv_stream import _counters_zero, refresh_inputs

    key, fused, plain = _pair("bf16_4096", 8, GRAPH_CFG)
    fused.warmup(torch.device("cuda"))
    for m in (1, 8):
        c = Case(fused.spec, m, seed=40 + m, n_slots=m)
        a = list(c.args())
        q_out = torch.empty(m, c.qh * c.d, dtype=torch.bfloat16, device="cuda")
        xn, res_out = torch.empty_like(c.x), torch.empty_like(c.x)
        s, g = torch.cuda.Stream(), torch.cuda.CUDAGraph()
        with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
            fused(*a, q_out=q_out, xn_out=xn, residual_out=res_out)
        for r in range(3):
            refresh_inputs(c, a, seed=900 * r + m)
            c.poison()
            g.replay()
            torch.cuda.synchronize()
            got = (q_out.clone(), xn.clone(), res_out.clone(), c.k_cache.clone(), c.v_cache.clone())
            c.poison()
            xn_e = torch.empty_like(c.x)
            q_e, r_e = plain(*a, xn_out=xn_e)
            torch.cuda.synchronize()
            want = (q_e, xn_e, r_e, c.k_cache, c.v_cache)
            for what, f, u in zip(("q", "xn", "residual", "k_cache", "v_cache"), got, want):
                assert torch.equal(f.view(torch.uint8), u.view(torch.uint8)), f"M={m} replay {r}: {what}"
    _counters_zero(fused)
