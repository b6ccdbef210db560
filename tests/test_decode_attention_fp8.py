"""Decode attention over an fp8 e4m3 KV cache (spec ``kv_cache_dtype="fp8_e4m3"``).

The cache holds e4m3 bytes (torch.float8_e4m3fn or torch.uint8), dequantized
= e4m3 x k_scale (K) / v_scale (V), the scales one-element fp32 CUDA tensors
read by the kernel before its grid-dependency wait. Numerics contract
(issue 17 item 4), against the fp64 reference on the dequantized cache
(``references.decode_attention.dequantize_kv``): relative Frobenius error
<= 1e-2 over the batch and <= 2x that of the seed's bf16-rounding torch path
on the same dequantized cache, max over (request, head) <= 3e-2, exact zeros
for seq_len 0, never NaN (also with K / V saturated at +-448 and tiny
scales) (``decode_attention_cases.Fp8Case``).

* CPU: the emulator's e4m3 -> f16 table against torch; quantize /
  dequantize; launch configs re-derived by bytes; variant names and
  rendered source; the op's rejections (errors naming the value and the
  fix) and FLINTGEN_CHECK_INPUTS's scale / q-range checks; the generated
  fp8 kernel run by the CPU emulator (tests/da_emulator.py: exact e4m3 ->
  f16, f16 q with satfinite, f16 P, f16 mma) on every path family (cluster,
  split partials merged by one or four CTAs, one split, one / two head
  tiles, head_dim 64 / 96 / 128 / 256, pages 16 / 32 / 64, sinks, windows,
  soft-capping, uint8 views), q past f16's range (saturated), K / V at the
  e4m3 limits with tiny scales.
* ``compile`` (sm_90a): fp8 variants compile with no spills, stack or local
  memory, with ``cvt.rn.f16x2.e4m3x2`` and the f16 mma and without the bf16
  mma (the CI grid: tests/test_decode_attention_grid.py adds fp8 families).
* ``gpu`` (H200): every (GQA, head_dim) of the grid at B = 1 / 3 / 64, full
  attention and window 128, mixed lengths, sinks on odd GQA, soft-capping on
  some shapes, uint8 and float8 views; long windows on the split path; the
  emulated cases; a CUDA-graph replay after changing k_scale / v_scale in
  place; FLINTGEN_CHECK_INPUTS=1 refusing bad scales.
"""

import dataclasses
import random

import numpy as np
import pytest
import torch

from flintgen import codegen
from flintgen.configs import decode_attention_config as dac
from flintgen.kernels.base import Target
from flintgen.kernels import kv_scales
from flintgen.kernels.decode_attention import DecodeAttentionDef, check_fp8_inputs
from flintgen.presets import FLINT
from flintgen.references.decode_attention import (
    decode_attention_ref,
    dequantize_kv,
    quantize_kv,
    rel_error,
)

from decode_attention_cases import (Fp8Case, call_op, check_compiled, cpu_op_args, lens_for, precompile, record,
                                    refill)
from test_decode_attention_grid import (CLUSTER_PLAN, LONG_WINDOWS, PAIRS, check_cluster_plan, grid_spec,
                                        precompile_windows)

KDEF = DecodeAttentionDef()
T132 = Target("sm_90a", 132)
FP8 = FLINT.replace(name="flint-fp8", kv_cache_dtype="fp8_e4m3")


def _no_load(v):
    raise AssertionError("no kernel load expected")


def fp8_spec(gqa, head_dim, *, page=16, kv=1, window=128, sinks=True, softcap=False, max_batch=80):
    s = grid_spec(gqa, head_dim, kv=kv, page=page, window=window, sinks=sinks, max_batch=max_batch,
                  softcap=softcap)
    return s.replace(name=s.name + "-fp8", kv_cache_dtype="fp8_e4m3")


# ----------------------------------------------------------------- conversions and references
def test_emulator_e4m3_table_matches_torch():
    """The emulator's cvt.rn.f16x2.e4m3x2 (the kernel's K / V conversion) is
    torch's exact e4m3fn -> f16 for all 256 bytes (NaN -> NaN)."""
    import da_emulator

    ours = np.array([da_emulator.e4m3_to_f16_bits(b) for b in range(256)], np.uint16).view(np.float16)
    ref = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float16).numpy()
    nan = np.isnan(ref)
    assert nan.sum() == 2 and (np.isnan(ours) == nan).all()
    assert (ours[~nan] == ref[~nan]).all()
    assert ours[0x7E] == 448 and ours[0x01] == 2.0 ** -9     # max normal, min subnormal


def test_emulator_f16_q_saturates():
    """q's bf16 -> f16 (satfinite): exact in f16's normal range, +-65504 past
    it (infinities too), NaN stays NaN."""
    import da_emulator

    def conv(x):
        w = int(torch.tensor([x, 0.0]).bfloat16().view(torch.int16)[0]) & 0xFFFF
        return float(np.array([da_emulator._f32_to_f16(np.uint32(w << 16).view(np.float32), True)],
                              np.uint16).view(np.float16)[0])

    for x in (1.5, -3.25, 2.0 ** -14, 65504.0 / 2, 448.0):
        assert conv(x) == float(torch.tensor(x).bfloat16())
    assert conv(1e5) == 65504.0 and conv(-3e38) == -65504.0 and conv(float("inf")) == 65504.0
    assert np.isnan(conv(float("nan")))


def test_quantize_and_dequantize():
    """quantize_kv is vLLM's write ((x / scale).clamp(+-448) -> e4m3), K and
    V with their own scales; dequantize_kv is exact; uint8 views carry the
    same bytes; NaN stays NaN."""
    g = torch.Generator().manual_seed(0)
    kv = (torch.randn(3, 2, 16, 2 * 64, generator=g) * 4).bfloat16()
    kv[0, 0, 0, 0] = float("nan")
    kv[1, 1, 3, 5] = 1e4        # K past 448 * k_scale: saturates
    kv[1, 1, 3, 70] = -1e4      # V
    q8 = quantize_kv(kv, 0.5, 0.25)
    assert q8.dtype == torch.float8_e4m3fn
    assert torch.equal(quantize_kv(kv, 0.5, 0.25, as_uint8=True), q8.view(torch.uint8))
    exp_k = (kv[..., :64].float() / 0.5).clamp(-448, 448).to(torch.float8_e4m3fn)
    exp_v = (kv[..., 64:].float() / 0.25).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(q8[..., :64].view(torch.uint8), exp_k.view(torch.uint8))
    assert torch.equal(q8[..., 64:].view(torch.uint8), exp_v.view(torch.uint8))
    deq = dequantize_kv(q8.view(torch.uint8), torch.tensor([0.5]), 0.25)
    assert deq.dtype == torch.float64 and torch.isnan(deq[0, 0, 0, 0])
    assert deq[1, 1, 3, 5] == 448 * 0.5 and deq[1, 1, 3, 70] == -448 * 0.25
    ok = ~torch.isnan(deq)
    both = torch.cat([q8.double()[..., :64] * 0.5, q8.double()[..., 64:] * 0.25], dim=-1)
    assert torch.equal(deq[ok], both[ok])


def test_head_errors_floor():
    """Per-head errors are relative to the row, floored at sqrt(D) x
    max(2^-126, 2^-120 x v_max): zeros for an exact output of ~1e-42 count
    as nearly exact, and with v_max = 50 zeros for one of 2e-36 (a sink
    taking all but 2^-128 of the mass, flushed: the H200 graph-replay test
    met it with k_scale = 1); zeros for an ordinary row, a small fraction
    off, a NaN and an infinity count as they are, also with v_max."""
    from flintgen.references.decode_attention import head_errors

    ref = torch.randn(2, 3, 128, dtype=torch.float64)
    ref[0, 1] *= 1e-42
    out = ref.clone()
    out[0, 1] = 0.0
    e = head_errors(out, ref)
    assert float(e[0, 1]) < 1e-3 and float(e.max()) == float(e[0, 1])
    ref[0, 1] = 2e-36 / 128 ** 0.5
    assert float(head_errors(out, ref)[0, 1]) == 1.0
    assert float(head_errors(out, ref, v_max=50.0)[0, 1]) < 1e-2
    out[1, 2] = 0.0
    out[1, 0] = ref[1, 0] * 1.01
    for v_max in (0.0, 50.0):
        e = head_errors(out, ref, v_max)
        assert float(e[1, 2]) == 1.0 and abs(float(e[1, 0]) - 0.01) < 1e-9
    out[0, 0, 5] = float("nan")
    out[0, 2, 0] = float("inf")
    e = head_errors(out, ref, 50.0)
    assert torch.isnan(e[0, 0]) and torch.isinf(e[0, 2])


# ----------------------------------------------------------------- configs and variants
@pytest.mark.parametrize("gqa, head_dim", PAIRS, ids=["g{}-d{}".format(*p) for p in PAIRS])
def test_fp8_configs_by_bytes(gqa, head_dim):
    """Every batch and window kind: the bf16 choice with half the slice
    bytes, bf16's stages (one fewer for windows, at least 2; FP8_SLIDING_KEEP_BF16_SLOTS
    keep bf16's, at least 3 for one split; more only where the epilogue
    scratch needs them), everything else unchanged; same fragment registers.
    Except head_dim 64's single-split launches past one wave of two CTAs per
    SM: 4 per SM, 2 slots."""
    for kv in (1, 8):
        for window in (None, 128, 4096):
            kw = dict(max_batch=256, num_kv_heads=kv, sliding=window is not None, window=window,
                      head_dim=head_dim, gqa=gqa, page_size=16, num_sms=132)
            bf, f8 = dac.all_configs(**kw), dac.all_configs(**kw, kv_dtype="fp8_e4m3")
            for b in bf:
                x, y = bf[b], f8[b]
                assert y.kv_dtype == "fp8_e4m3" and x.kv_dtype == "bf16"
                assert y.slice_bytes * 2 == x.slice_bytes
                if (head_dim == 64 and gqa <= 8 and x.num_splits == 1 and x.ctas_per_sm == 2
                        and b * kv > 2 * 132):   # more than one wave at 2 per SM: 4 CTAs per SM of 2 slots
                    slots = 3 if window and (head_dim, gqa) in dac.FP8_SLIDING_KEEP_BF16_SLOTS else 2
                    assert y == dataclasses.replace(x, kv_dtype="fp8_e4m3", num_stages=slots,
                                                    ctas_per_sm=dac.FP8_D64_CTAS_PER_SM), (b, x, y)
                    continue
                keep = (head_dim, gqa) in dac.FP8_SLIDING_KEEP_BF16_SLOTS
                if not window:
                    want = x.num_stages
                elif keep:
                    want = max(3, x.num_stages) if x.num_splits == 1 else x.num_stages
                else:
                    want = max(2, x.num_stages - 1)
                assert want <= y.num_stages <= 2 * x.num_stages, (b, x, y)
                if y.num_stages > want:     # only where one slot fewer leaves the epilogue scratch no room
                    with pytest.raises(ValueError, match="epilogue scratch"):
                        dataclasses.replace(y, num_stages=y.num_stages - 1)
                assert y.as_params() == dict(x.as_params(), num_stages=y.num_stages)
                assert y.kv_parts == x.kv_parts and y.ring_bytes <= x.ring_bytes


def test_fp8_check_supported():
    dac.check_supported(head_dim=128, gqa=8, page_size=16, kv_dtype="fp8_e4m3")
    with pytest.raises(NotImplementedError, match=r"kv_cache_dtype = fp8_e5m2 is not supported \(supported: "
                                                  r"\['bf16', 'fp8_e4m3'\]"):
        dac.check_supported(head_dim=128, gqa=8, page_size=16, kv_dtype="fp8_e5m2")


def test_fp8_variants_and_source():
    """Batch by batch, the fp8 variant is the bf16 one plus kv_fp8 (names of
    bf16 variants unchanged) with its own stages; the rendered fp8
    module takes k_scale / v_scale, the bf16 one renders KV_FP8 = False and no
    scale argument."""
    plain, f8 = KDEF.bind(FLINT, T132, _no_load)._variants, KDEF.bind(FP8, T132, _no_load)._variants
    assert plain.keys() == f8.keys() and all(plain[k].keys() == f8[k].keys() for k in plain)
    by_pair = {(plain[k][b].name, f8[k][b].name): (plain[k][b], f8[k][b]) for k in plain for b in plain[k]}
    assert {s.name for _, s in by_pair.values()} == {v.name for v in KDEF.variants(FP8, T132)}
    for p, s in by_pair.values():
        assert "kv_fp8" not in p.name and "-kv_fp81-" in s.name
        assert dict(s.params) == dict(p.params, kv_fp8=True, num_stages=s["num_stages"])
        src_p = codegen.render(p.kernel, KDEF.template, dict(KDEF.render_params(FLINT, p)))
        src_s = codegen.render(s.kernel, KDEF.template, dict(KDEF.render_params(FP8, s)))
        code_p = [ln.split("#")[0] for ln in src_p.splitlines()]
        assert "KV_FP8 = False" in src_p and "Float8E4M3FN" not in src_p
        assert [ln for ln in code_p if "k_scale" in ln or "vq" in ln] == []
        assert "kq = Float32(k_scale[0])" in src_s and "norm_factor(l_cta, m_cta * scale_log2, sink_s, vq)" in src_s
        assert "KV_FP8 = True" in src_s and "KV_TYPE = cutlass.Float8E4M3FN" in src_s
        assert "counters, k_scale, v_scale, scale_log2, window" in src_s
        assert f"SLICE_BYTES = {16 * 2 * 128}" in src_s
    p, s = next(iter(by_pair.values()))
    assert KDEF.variant_ptx(s) != KDEF.variant_ptx(p) == KDEF.required_ptx


# ----------------------------------------------------------------- validation (CPU)
def _args(b=2, kv_dtype=torch.float8_e4m3fn, **over):
    return cpu_op_args(b, kv_dtype, **over)


def _call(spec, a, **kw):
    return call_op(KDEF.bind(spec, T132, _no_load), a, **kw)


ONE = torch.ones(())
REJECTIONS = [
    (FP8, {}, dict(v_scale=ONE), ValueError,
     r"spec 'flint-fp8' has kv_cache_dtype='fp8_e4m3': pass k_scale, the layer's fp32 K scale as a "
     r"one-element CUDA tensor \(dequantized = e4m3 x k_scale; vLLM's layer._k_scale\).*1.0 where the "
     r"checkpoint has none"),
    (FP8, {}, dict(k_scale=ONE), ValueError, r"pass v_scale, the layer's fp32 V scale"),
    (FP8, {}, dict(k_scale=0.5, v_scale=ONE), TypeError,
     r"k_scale must be a one-element fp32 torch.Tensor \(read by the kernel at every launch, so CUDA graphs "
     r"see updates\), got float 0.5: pass e.g. torch.tensor\(\[0.5\], dtype=torch.float32, device='cuda'\)"),
    (FP8, {}, dict(k_scale=ONE, v_scale=ONE.double()), TypeError,
     r"v_scale must be torch.float32, got torch.float64: convert it with .float\(\)"),
    (FP8, {}, dict(k_scale=torch.ones(4), v_scale=ONE), ValueError,
     r"k_scale must hold one fp32 value \(one scale per layer\), got shape \(4,\): per-kv-head scale "
     r"vectors are not supported"),
    (FLINT, dict(kv_dtype=torch.bfloat16), dict(k_scale=ONE), ValueError,
     r"k_scale given but spec 'flint' has kv_cache_dtype='bf16' \(K / V stored unscaled\): pass "
     r"k_scale=None, or build a spec with kv_cache_dtype='fp8_e4m3'"),
    (FP8, dict(kv_dtype=torch.bfloat16), dict(k_scale=ONE, v_scale=ONE), TypeError,
     r"kv_cache must be torch.float8_e4m3fn or torch.uint8 \(e4m3 bytes\) for spec 'flint-fp8' "
     r"\(kv_cache_dtype='fp8_e4m3'\), got torch.bfloat16: pass the fp8 cache itself"),
    (FP8, dict(kv_dtype=torch.int8), dict(k_scale=ONE, v_scale=ONE), TypeError, r"got torch.int8"),
    (FLINT, dict(kv_dtype=torch.uint8), {}, TypeError, r"kv_cache must be torch.bfloat16, got torch.uint8"),
]


@pytest.mark.parametrize("spec, over, kw, exc, match", REJECTIONS, ids=[r[-1][:40] for r in REJECTIONS])
def test_fp8_rejections(spec, over, kw, exc, match):
    with pytest.raises(exc, match=match):
        _call(spec, _args(**over), **kw)


def test_fp8_strides_in_bytes():
    """Block / head strides are checked in 1-byte elements: 16 e4m3 elements
    (16 bytes) pass, 8 do not."""
    kv = torch.zeros(8, 4, 16, 256 + 8, dtype=torch.uint8)[..., :256]
    with pytest.raises(ValueError, match=r"multiples of 16 elements \(16 bytes, for bulk copies\)"):
        _call(FP8, _args(kv_cache=kv), k_scale=ONE, v_scale=ONE)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.uint8])
def test_fp8_valid_arguments_reach_the_device_checks(dtype):
    """Valid fp8 arguments (both cache dtypes, 0-d and [1] scales) pass every
    host check: the next one is the device's."""
    for ks in (torch.ones(()), torch.ones(1)):
        with pytest.raises(ValueError, match="q must be on a CUDA device"):
            _call(FP8, _args(kv_dtype=dtype), k_scale=ks, v_scale=torch.full((1, 1), 0.5))


@pytest.mark.parametrize("ks, vs, match", [
    (0.0, 1.0, r"k_scale = 0.0 must be finite and > 0 \(dequantized = e4m3 x k_scale\): pass the layer's "
               r"k_scale \(its calibrated value; 1.0 where the checkpoint has none\)"),
    (1.0, -2.0, r"v_scale = -2.0 must be finite and > 0"),
    (float("nan"), 1.0, r"k_scale = nan must be finite and > 0"),
    (1.0, float("inf"), r"v_scale = inf must be finite and > 0"),
])
def test_check_inputs_scales(ks, vs, match):
    q = torch.zeros(2, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        check_fp8_inputs(q, torch.tensor(ks), torch.tensor([vs]))


def test_check_inputs_q_range():
    """q past f16's range would saturate in the f16 mma: refused under
    FLINTGEN_CHECK_INPUTS; 65280 (the largest bf16 <= 65504) passes, bf16's
    next value 65536 does not; tiny scales pass."""
    q = torch.zeros(2, 8, 64, dtype=torch.bfloat16)
    check_fp8_inputs(q, torch.tensor(1e-30), torch.tensor(1e-30))
    q[1, 3, 7] = 65280
    check_fp8_inputs(q, ONE, ONE)
    q[0, 0, 0] = -65536
    with pytest.raises(ValueError, match=r"q has \|values\| up to 65536.0"):
        check_fp8_inputs(q, ONE, ONE)
    q[1, 3, 7] = -70000
    with pytest.raises(ValueError, match=r"q has \|values\| up to 70144.0, outside f16's range \(\|q\| <= "
                                         r"65504\): the fp8 path runs the f16 mma"):
        check_fp8_inputs(q, ONE, ONE)
    q[1, 3, 7] = float("nan")
    with pytest.raises(ValueError, match=r"q has \|values\| up to nan"):
        check_fp8_inputs(q, ONE, ONE)


# ----------------------------------------------------------------- emulated (CPU)
class EmulatedFp8Op:
    """The op's launch choice for a batch, run by the CPU emulator."""

    def __init__(self, spec):
        self.spec = spec
        self.op = KDEF.bind(spec, T132, _no_load)

    def config(self, batch, sliding):
        return self.op.config(batch, sliding)

    def variant(self, batch, sliding):
        return self.op._variants[sliding][batch]

    def __call__(self, q, kv, bt, lens, sinks, window, scale, out, *, softcap=None, k_scale=None, v_scale=None):
        import da_emulator

        kv_scales.check_scales(self.spec, k_scale, v_scale)   # the op's rule (its other checks need CUDA)
        v = self.variant(q.shape[0], window is not None)
        res = da_emulator.run(KDEF, self.spec, v, q, kv, bt, lens, sinks, window, scale,
                              num_partials=self.op._max_partials, softcap=softcap, k_scale=float(k_scale),
                              v_scale=float(v_scale))
        out.copy_(torch.from_numpy(res))


# (GQA, head_dim, page, sinks, window, seq_lens, softcap, k_scale, v_scale, uint8): every path
# family on small inputs.
EMULATED = [
    (8, 128, 16, True, 128, [130, 17, 0], None, 0.02, 0.01, False),   # 8-rank cluster, padded b=3 row
    (8, 64, 16, True, None, [600, 33], None, 0.05, 0.003, True),      # split partials merged by one CTA; uint8
    (4, 128, 32, False, None, [600], None, 0.02, 0.05, False),        # padded tile, 8-warp splits
    (16, 64, 64, True, None, [600] + [0] * 16, None, 0.01, 0.02, True),  # two tiles, 2 splits, pages of 64
    (16, 128, 16, False, 128, [150] + [0] * 64, None, 0.02, 0.01, False),  # two tiles, one split per pair
    (3, 64, 16, True, 128, [145, 0, 1], 3.0, 0.02, 0.01, True),       # odd ratio, cluster of 4, softcap
    (2, 256, 16, False, None, [700, 1], 50.0, 0.03, 0.02, False),     # head_dim 256: K then V; softcap
    (2, 256, 16, True, 128, [150], None, 0.02, 0.01, True),           # head_dim 256 cluster
    (1, 96, 16, True, None, [600, 17], None, 0.02, 0.01, False),      # head_dim 96: trailing 32-dim group
    (12, 96, 16, False, None, [500, 17], None, 0.02, 0.01, True),     # head_dim 96, two tiles
    (8, 128, 16, True, None, [2200], None, 0.02, 0.01, False),        # one pair, 132 splits, 4 mergers
]


def _emulated_case(gqa, head_dim, page, sinks, window, lens, cap, ks, vs, as_uint8, device="cpu", **kw):
    spec = fp8_spec(gqa, head_dim, page=page, sinks=sinks, softcap=cap is not None,
                    window=128 if window is not None else None)
    case = Fp8Case(spec, lens, window, seed=len(lens) + gqa, device=device, softcap=cap, k_scale=ks,
                   v_scale=vs, as_uint8=as_uint8, q_scale=(cap if cap else 1.5), **kw)
    return spec, case


@pytest.mark.parametrize("gqa, head_dim, page, sinks, window, lens, cap, ks, vs, as_uint8", EMULATED,
                         ids=lambda x: None)
def test_emulated_fp8_kernel(gqa, head_dim, page, sinks, window, lens, cap, ks, vs, as_uint8):
    """The generated fp8 kernel, run on the CPU by the emulator, meets the
    contract against the fp64 reference on the dequantized cache, where
    ignoring k_scale or v_scale (or applying v_scale twice) is far off."""
    spec, case = _emulated_case(gqa, head_dim, page, sinks, window, lens, cap, ks, vs, as_uint8)
    op = EmulatedFp8Op(spec)
    out = case.poisoned_out()
    op(*case.args(out), **case.kwargs())
    label = f"emulated fp8 {spec.name} window={window} b={len(lens)} {op.config(len(lens), window is not None)}"
    ek, _ = case.check(out, label)
    a = (case.q, case.bt, case.lens, case.sinks, window, case.scale)
    live = case.lens > 0
    for wrong in (dequantize_kv(case.kv, 1.0, vs), dequantize_kv(case.kv, ks, vs * vs)):
        ref = decode_attention_ref(a[0], wrong, *a[1:], softcap=cap)
        assert rel_error(out[live], ref[live]) > max(20 * ek, 0.05), f"{label}: a scale does not matter"


def test_emulated_q_past_f16_range_saturates():
    """q elements past 65504 (bf16 allows them) are saturated to +-65504 by
    the f16 conversion: the output matches the reference with q clamped,
    not the unclamped one; nothing is NaN. Dequantized K ~ N(0, (5e-5)^2),
    so the big q dims alone spread the logits (std 0.4 clamped, 1.2 not)."""
    spec, case = _emulated_case(8, 64, 16, True, None, [300, 40], None, 1e-6, 0.01, False, amp=5e-5)
    case.q[0, :, 5] = 2e5
    case.q[1, 3, 9] = -1e6
    op = EmulatedFp8Op(spec)
    out = case.poisoned_out()
    op(*case.args(out), **case.kwargs())
    clamped = case.q.float().clamp(-65504, 65504).bfloat16()
    assert torch.isfinite(out).all()
    ref_c = decode_attention_ref(clamped, case.kv_deq, case.bt, case.lens, case.sinks, None, case.scale)
    ref_u = decode_attention_ref(case.q, case.kv_deq, case.bt, case.lens, case.sinks, None, case.scale)
    ek = rel_error(out, ref_c)
    record(f"emulated fp8 q past f16 range: err vs clamped-q reference {ek:.3e}, vs unclamped "
           f"{rel_error(out, ref_u):.3e}")
    assert ek <= 1e-2 and rel_error(out, ref_u) > 10 * ek


@pytest.mark.parametrize("ks, vs", [(1e-4, 1e-30), (1e-30, 1e-4)])
def test_emulated_e4m3_limits_and_tiny_scales(ks, vs):
    """K and V written from values far past 448 x scale (saturated to +-448
    on write), tiny scales: finite, exact zeros for seq_len 0, the contract
    holds (split partials and a cluster)."""
    for window, lens in ((None, [600, 0, 40]), (128, [150, 0])):
        spec, case = _emulated_case(8, 64, 16, True, window, lens, None, ks, vs, True, amp=1e3 * max(ks, vs))
        e4 = case.kv.view(torch.float8_e4m3fn).float()
        assert (e4.abs() == 448).float().mean() > 0.3      # mostly saturated
        op = EmulatedFp8Op(spec)
        out = case.poisoned_out()
        op(*case.args(out), **case.kwargs())
        case.check(out, f"emulated fp8 limits k_scale={ks} v_scale={vs} window={window}")


# ----------------------------------------------------------------- compile
def _compile_cases():
    out = []
    for spec in (FP8, fp8_spec(16, 128, page=64, kv=1, window=None, softcap=True), fp8_spec(2, 256, kv=8),
                 fp8_spec(1, 96, kv=2), fp8_spec(8, 64, kv=1, page=32, window=4096),
                 fp8_spec(1, 64, kv=2, window=128, max_batch=64),    # 2 / 6 sliding ring slots spilled here
                 fp8_spec(7, 64, kv=2, window=128, max_batch=64),    # 2 spilled here
                 fp8_spec(1, 64, kv=8, window=None, max_batch=64),   # B = 64: 4 CTAs per SM of 2 slots
                 fp8_spec(7, 64, kv=8, window=None, max_batch=64),
                 fp8_spec(1, 64, kv=8, window=4096, max_batch=64),   # ... of 3 (2 spilled on the H200 run)
                 fp8_spec(7, 64, kv=8, window=4096, max_batch=64)):
        op = KDEF.bind(spec, T132, _no_load)
        fams = {}
        for sliding in op._variants:
            for b in (1, 3, 64):
                v = op._variants[sliding][b]
                fams.setdefault((sliding, v["cluster"], v["num_splits"] > 1, v["merge_ctas"]), v)
        out += [pytest.param(spec, v, id=f"{spec.name}-{v.name[len('decode_attention-'):]}") for v in fams.values()]
    return out


def assert_scales_read_before_wait(ptx):
    """k_scale and v_scale (kernel parameters 9 and 10, after the counters)
    are loaded from global memory before the first griddepcontrol.wait."""
    import re

    wait = ptx.index("griddepcontrol.wait")
    for idx in (9, 10):
        regs = re.findall(rf"ld\.param\.b64\s+(%rd\d+), \[\w+_param_{idx}\];", ptx)
        assert regs, f"parameter {idx} is not loaded"
        loads = [m.start() for r in regs for m in re.finditer(rf"ld\.global\.\w+\s+%r\d+, \[{r}\];", ptx)]
        assert loads and min(loads) < wait, f"parameter {idx} is read after griddepcontrol.wait"


@pytest.mark.compile
@pytest.mark.parametrize("spec, variant", _compile_cases())
def test_fp8_variant_compiles_clean(spec, variant):
    """No spills, stack or local memory; e4m3 -> f16 conversions and the f16
    mma, never the bf16 one."""
    from flintgen.runtime import load_variant

    load_variant(KDEF, spec, variant, T132)
    res, ptx = check_compiled(KDEF, spec, variant, T132)
    assert KDEF.BF16_MMA not in ptx
    assert_scales_read_before_wait(ptx)
    record(f"compile {spec.name} {variant.name}: {res['registers']} registers")


# ================================================================= GPU
GPU_PLAN = [(None, 1), (None, 3), (None, 64), (128, 1), (128, 3), (128, 64)]
LEN_CAP = 5000


def _gpu_spec(gqa, d):
    # Soft-capping on head_dim 256 (Gemma 2) and GQA 2 (pairwise with the rest).
    return fp8_spec(gqa, d, kv=2, window=128, sinks=gqa % 2 == 1, softcap=d == 256 or gqa == 2, max_batch=64)


def _long_specs():
    return [fp8_spec(g, d, kv=2, window=4096, max_batch=4) for g, d in ((1, 96), (7, 128), (2, 256), (16, 64))]


# head_dim 64 past one wave of two single-split CTAs per SM (> 264 pairs): 4 CTAs per SM of 2 slots
WAVE_SPECS = [fp8_spec(g, 64, kv=8, window=4096, sinks=g == 1, max_batch=40) for g in (1, 8)]
WAVE_PLAN = [(None, 33), (None, 40), (4096, 40)]

# short windows at one to two single-split pairs per SM (133..264): at most 2 CTAs per SM
# (SHORT_WINDOW_CTAS_PER_SM); head_dim 64 GQA 1 keeps 3 slots (FP8_SLIDING_KEEP_BF16_SLOTS)
CAP_SPECS = [fp8_spec(g, d, kv=8, window=128, sinks=g != 4, softcap=d == 256, max_batch=33)
             for g, d in ((8, 128), (1, 64), (4, 256), (3, 96))]
CAP_PLAN = [17, 32, 33]

GRAPH_SPEC = fp8_spec(8, 128, kv=2, window=128, max_batch=48)
GRAPH_PLAN = [(128, 2), (None, 3), (None, 40)]


@pytest.fixture(scope="module")
def precompiled_fp8():
    from flintgen import toolchain

    plans = [(_gpu_spec(g, d), GPU_PLAN) for g, d in PAIRS] + [(s, [(4096, 4)]) for s in _long_specs()]
    plans += [(fp8_spec(c[0], c[1], page=c[2], sinks=c[3], softcap=c[6] is not None,
                        window=128 if c[4] is not None else None), [(c[4], len(c[5]))]) for c in EMULATED]
    plans += [(GRAPH_SPEC, [(w, b) for w in (128, None) for b in range(1, 49)])]
    plans += [(s, WAVE_PLAN) for s in WAVE_SPECS]
    record(f"precompiled {precompile(plans, KDEF, toolchain.resolve_target(), _no_load)} fp8 variants")


def _edges(page, window):
    return [0, 1, 2, 15, 16, 17, page - 1, page, page + 1, window - 1, window, window + 1, 4999]


@pytest.mark.gpu
@pytest.mark.parametrize("gqa, head_dim", PAIRS, ids=["g{}-d{}".format(*p) for p in PAIRS])
def test_fp8_grid_shape(precompiled_fp8, gqa, head_dim):
    """B = 1, 3, 64 x full / window 128, lengths activating every split, the
    edge lengths at B = 64, fresh inputs, poisoned outputs; uint8 and float8
    views alternate; scales vary; soft-capping on head_dim 256 and GQA 2."""
    import flintgen

    spec = _gpu_spec(gqa, head_dim)
    op = flintgen.get_kernel(spec, "decode_attention")
    rnd = random.Random(gqa * 1000 + head_dim)
    cap = 50.0 if spec.attn_logit_softcap else None
    for i, (window, b) in enumerate(GPU_PLAN):
        cfg = op.config(b, window is not None)
        lens = lens_for(cfg, b, window is not None, 128, rnd, spec.page_size, LEN_CAP)
        if b == 64:
            edges = _edges(spec.page_size, 128)
            lens[1:1 + len(edges)] = edges
        ks, vs = rnd.choice([(0.02, 0.01), (1.0, 1.0), (0.004, 0.05)])
        case = Fp8Case(spec, lens, window, seed=rnd.randint(0, 2**31), softcap=cap, k_scale=ks, v_scale=vs,
                       as_uint8=i % 2 == 1, q_scale=30.0 if cap else 1.5)
        out = case.poisoned_out()
        op(*case.args(out), **case.kwargs())
        case.check(out, f"fp8 grid {spec.name} window={window} b={b} ks={ks} vs={vs} {cfg.as_params()}")


@pytest.mark.gpu
@pytest.mark.parametrize("idx", range(len(WAVE_SPECS)))
def test_fp8_d64_four_ctas_per_sm(precompiled_fp8, idx):
    """B = 40 x 8 kv heads at head_dim 64 (320 pairs: the 4-CTA-per-SM launch, full attention and a 4096
    window), and B = 33 (264 pairs: two per SM), edge lengths, fresh inputs, poisoned outputs."""
    import flintgen

    spec = WAVE_SPECS[idx]
    op = flintgen.get_kernel(spec, "decode_attention")
    assert op.config(40, False).ctas_per_sm == dac.FP8_D64_CTAS_PER_SM and op.config(33, False).ctas_per_sm == 2
    rnd = random.Random(640 + idx)
    for window, b in WAVE_PLAN:
        cfg = op.config(b, window is not None)
        lens = [rnd.randint(0, 3000) for _ in range(b)]
        edges = [0, 1, 15, 16, 17, 4095, 4096, 4097]
        lens[:len(edges)] = edges
        case = Fp8Case(spec, lens, window, seed=rnd.randint(0, 2**31), k_scale=0.02, v_scale=0.01,
                       as_uint8=b % 2 == 0)
        out = case.poisoned_out()
        op(*case.args(out), **case.kwargs())
        case.check(out, f"fp8 d64 waves {spec.name} window={window} b={b} {cfg.as_params()}")


@pytest.fixture(scope="module")
def precompiled_fp8_cap():
    from flintgen import toolchain

    n = precompile([(s, [(128, b) for b in CAP_PLAN]) for s in CAP_SPECS], KDEF, toolchain.resolve_target(), _no_load)
    record(f"precompiled {n} fp8 capped-window variants")


@pytest.mark.gpu
@pytest.mark.parametrize("idx", range(len(CAP_SPECS)))
def test_fp8_short_window_two_ctas_per_sm(precompiled_fp8_cap, idx):
    """8 kv heads x B = 17, 32, 33 (136, 256, 264 pairs) with window 128: single-split launches capped at 2 CTAs
    per SM; window, slice and page edge lengths, fresh inputs, poisoned outputs, uint8 and float8 views."""
    import flintgen

    spec = CAP_SPECS[idx]
    op = flintgen.get_kernel(spec, "decode_attention")
    rnd = random.Random(170 + idx)
    cap = 50.0 if spec.attn_logit_softcap else None
    for b in CAP_PLAN:
        cfg = op.config(b, True)
        assert cfg.num_splits == 1 and cfg.ctas_per_sm == dac.SHORT_WINDOW_CTAS_PER_SM and cfg.early_release, cfg
        lens = [rnd.randint(0, 3000) for _ in range(b)]
        edges = _edges(spec.page_size, 128)
        lens[:len(edges)] = edges
        case = Fp8Case(spec, lens, 128, seed=rnd.randint(0, 2**31), softcap=cap, k_scale=0.02, v_scale=0.01,
                       as_uint8=b % 2 == 1, q_scale=30.0 if cap else 1.5)
        out = case.poisoned_out()
        op(*case.args(out), **case.kwargs())
        case.check(out, f"fp8 capped window {spec.name} b={b} {cfg.as_params()}")


@pytest.fixture(scope="module")
def precompiled_fp8_cluster():
    precompile_windows(CAP_SPECS, CLUSTER_PLAN, "fp8 short-window cluster")


@pytest.mark.gpu
@pytest.mark.parametrize("idx", range(len(CAP_SPECS)))
def test_fp8_short_window_cluster_sizes(precompiled_fp8_cluster, idx):
    """8 kv heads x B = 2, 3, 8 (16, 24, 64 pairs) with window 128: 4- then 2-CTA clusters, uint8 and float8 views."""
    spec = CAP_SPECS[idx]
    check_cluster_plan(spec, 430 + idx, lambda lens, seed, b, cap, qs: Fp8Case(
        spec, lens, 128, seed=seed, softcap=cap, k_scale=0.02, v_scale=0.01, as_uint8=b % 2 == 1, q_scale=qs),
        "fp8 cluster window")


@pytest.mark.gpu
@pytest.mark.parametrize("idx", range(4))
def test_fp8_long_windows_on_the_split_path(precompiled_fp8, idx):
    import flintgen

    spec = _long_specs()[idx]
    op = flintgen.get_kernel(spec, "decode_attention")
    assert not op.config(4, True).cluster
    for w in LONG_WINDOWS:
        case = Fp8Case(spec, [w - 1, w, w + 1, 5000], w, seed=w + idx, as_uint8=w % 2 == 0)
        out = case.poisoned_out()
        op(*case.args(out), **case.kwargs())
        case.check(out, f"fp8 long window {spec.name} W={w} {op.config(4, True).as_params()}")


@pytest.mark.gpu
@pytest.mark.parametrize("gqa, head_dim, page, sinks, window, lens, cap, ks, vs, as_uint8", EMULATED,
                         ids=lambda x: None)
def test_fp8_emulated_cases_gpu(precompiled_fp8, gqa, head_dim, page, sinks, window, lens, cap, ks, vs, as_uint8):
    """The H200 twin of test_emulated_fp8_kernel, and the e4m3 limits."""
    import flintgen

    spec, case = _emulated_case(gqa, head_dim, page, sinks, window, lens, cap, ks, vs, as_uint8, device="cuda")
    op = flintgen.get_kernel(spec, "decode_attention")
    out = case.poisoned_out()
    op(*case.args(out), **case.kwargs())
    case.check(out, f"gpu fp8 {spec.name} window={window} b={len(lens)}")
    for tiny in ((1e-4, 1e-30), (1e-30, 1e-4)):
        _, lim = _emulated_case(gqa, head_dim, page, sinks, window, lens, cap, *tiny, as_uint8, device="cuda",
                                amp=1e3 * max(tiny))
        out = lim.poisoned_out()
        op(*lim.args(out), **lim.kwargs())
        lim.check(out, f"gpu fp8 limits {spec.name} scales={tiny} window={window}")


@pytest.mark.gpu
def test_fp8_cuda_graph_replay_sees_new_scales(precompiled_fp8):
    """After ``warmup``, a graph of three launches (B = 2: cluster; B = 3:
    split partials; B = 40: 3 splits) replayed 30 times with k_scale /
    v_scale (and lengths, block tables) changed in place between replays:
    each replay matches the reference of the scales it ran with (the cache
    bytes stay, so the dequantized cache changes); counters end at 0."""
    import flintgen

    op = flintgen.get_kernel(GRAPH_SPEC, "decode_attention")
    op.warmup(torch.device("cuda"))
    rnd = random.Random(5)
    page, width = GRAPH_SPEC.page_size, 40
    cases = []
    for window, b in GRAPH_PLAN:
        case = Fp8Case(GRAPH_SPEC, [width * page] * b, None, seed=b, extra_cols=0, as_uint8=b == 3)
        case.window = window
        cases.append(case)
    # One scale pair shared by the graph's launches (a layer's), as vLLM keeps them.
    ks, vs = cases[0].k_scale, cases[0].v_scale
    for c in cases[1:]:
        c.k_scale, c.v_scale = ks, vs
    outs = [torch.empty_like(c.q) for c in cases]
    for c, o in zip(cases, outs):
        op(*c.args(o), **c.kwargs())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c, o in zip(cases, outs):
            op(*c.args(o), **c.kwargs())
    scales = [(0.02, 0.01), (0.1, 2.0), (0.003, 1e-3), (1.0, 0.5)]
    for it in range(30):
        k_new, v_new = scales[it % len(scales)]
        for c in cases:
            lens = [rnd.choice([0, 1, page - 1, page + 1, rnd.randint(1, width * page), width * page])
                    for _ in range(c.q.shape[0])]
            refill(c, rnd, lens, page)
        ks.fill_(k_new)
        vs.fill_(v_new)
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        for c, o in zip(cases, outs):
            c.set_scales(k_new, v_new)
            c.check(o, f"fp8 graph replay {it} k_scale={k_new} v_scale={v_new} window={c.window} "
                       f"b={c.q.shape[0]}")
    torch.cuda.synchronize()
    ws = op._workspaces[torch.device("cuda", torch.cuda.current_device())]
    assert int(ws.counters.abs().sum()) == 0


@pytest.mark.gpu
def test_fp8_check_inputs_on_gpu(monkeypatch):
    """FLINTGEN_CHECK_INPUTS=1: a zero or NaN scale, or q past f16's range,
    is refused before the launch; valid ones run."""
    import flintgen

    monkeypatch.setenv("FLINTGEN_CHECK_INPUTS", "1")
    spec = GRAPH_SPEC
    op = flintgen.get_kernel(spec, "decode_attention")
    case = Fp8Case(spec, [100, 0], None, seed=1)
    out = case.poisoned_out()
    op(*case.args(out), **case.kwargs())
    case.check(out, "fp8 check_inputs valid")
    for bad, match in ((0.0, "k_scale = 0.0 must be finite and > 0"), (float("nan"), "k_scale = nan must be finite")):
        case.k_scale.fill_(bad)
        with pytest.raises(ValueError, match=match):
            op(*case.args(out), **case.kwargs())
    case.k_scale.fill_(0.02)
    case.q[0, 0, 0] = 1e5
    with pytest.raises(ValueError, match="outside f16's range"):
        op(*case.args(out), **case.kwargs())
