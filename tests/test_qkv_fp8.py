"""fp8 e4m3 KV cache written by the fused QKV step (issue 17): the k_scale /
v_scale API and every refusal (any machine), the conversion torch defines
(CPU), and on the GPU the kernel's K / V bytes bit-exact against

    (k_bf16.float() / k_scale).clamp(-448, 448).to(torch.float8_e4m3fn)

where k_bf16 is what the bf16 binary of the same spec writes (K after q/k
norm and RoPE, V = the GEMV rows; 'the bf16 twin'), with q bit-equal to the
twin's. NaN compares as NaN (torch keeps the sign bit, the cvt need not).
The fp8 variants' compile checks (spill-free, the cvt, the reciprocal-based
quotient and the div.rn fallback in the PTX, the scales loaded and their
reciprocals computed before griddepcontrol.wait) are in tests/test_qkv.py's
compile list (FP8_CASES); the quotient's proof on the CPU is
tests/test_kv_quant_division.py.
"""

from __future__ import annotations

import pytest
import torch
from test_qkv import FP8_CASES, KDEF, SPECS, T132, Case, _cpu_args, _op

import flintgen
from flintgen import codegen, layout

FLINT8 = SPECS["flint_fp8"]
POISON = 0x7F                       # e4m3 NaN: a slot the kernel must not write keeps it


def e4m3_ref(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The issue's formula (vLLM's order), as uint8 bytes; on the CPU."""
    return (rows.cpu().float() / scale.cpu().float()).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)


def assert_e4m3_equal(got: torch.Tensor, want: torch.Tensor, label: str) -> None:
    """Bytes equal, except that a NaN need only be a NaN (0x7f / 0xff)."""
    got, want = got.cpu().view(torch.uint8), want.cpu().view(torch.uint8)
    g_nan, w_nan = (got & 0x7F) == 0x7F, (want & 0x7F) == 0x7F
    assert torch.equal(g_nan, w_nan), f"{label}: NaN at {int((g_nan != w_nan).sum())} other positions"
    bad = (got != want) & ~w_nan
    assert not bad.any(), (f"{label}: {int(bad.sum())} of {got.numel()} bytes differ, e.g. got "
                           f"{got[bad][:6].tolist()} want {want[bad][:6].tolist()}")


# ============================================================== the conversion (CPU)
def test_torch_formula_saturates_keeps_nan_and_rounds_to_even():
    """What the kernel must match, by hand (scale 3: its reciprocal is inexact)."""
    vals = [3.0, 448 * 3, 1e4, -1e4, float("inf"), float("-inf"), 465 * 3, 3 * 2 ** -9, 3 * 2 ** -10,
            3 * 1.5 * 2 ** -9, 1e-30, -1e-30, 0.0]
    got = e4m3_ref(torch.tensor(vals).bfloat16(), torch.tensor([3.0])).tolist()
    assert got == [0x38, 0x7E, 0x7E, 0xFE, 0x7E, 0xFE, 0x7E, 0x01, 0x00, 0x02, 0x00, 0x80, 0x00]
    nan = e4m3_ref(torch.tensor([float("nan")]).bfloat16(), torch.tensor([3.0]))
    assert (nan & 0x7F).item() == 0x7F


def _recip_ref(rows, scale):
    return (rows.float() * (1 / scale.float())).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)


# bf16 values whose e4m3 byte differs between x / 7 and x * fl(1 / 7) (found by
# exhausting the positive bf16 values): a kernel multiplying by a reciprocal fails on them
RECIP_7 = [0.0888671875, 0.1708984375, 0.1982421875]
RECIP_03 = [0.00439453125]          # the one such value for scale 0.3


def test_division_is_not_a_reciprocal_multiply():
    for vals, s in ((RECIP_7, 7.0), (RECIP_03, 0.3)):
        x, sc = torch.tensor(vals).bfloat16(), torch.tensor([s])
        assert (e4m3_ref(x, sc) != _recip_ref(x, sc)).all(), (vals, s)


# ============================================================== validation (CPU)
def _fp8_args(spec=FLINT8, m=2, dtype=torch.uint8, hnd=False):
    a = _cpu_args(spec, m)
    kv, d = spec.kv_heads_per_rank, spec.head_dim
    if hnd:
        cache = torch.zeros(4, kv, 16, 2 * d, dtype=dtype)
        a.update(k_cache=cache[..., :d].permute(0, 2, 1, 3), v_cache=cache[..., d:].permute(0, 2, 1, 3))
    else:
        a.update(k_cache=torch.zeros(4, 16, kv, d, dtype=dtype), v_cache=torch.zeros(4, 16, kv, d, dtype=dtype))
    a.update(k_scale=torch.ones(1), v_scale=torch.ones(()))
    return a


@pytest.mark.parametrize("name", ["flint", "oss_bf16", "d96", "d256"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn])
@pytest.mark.parametrize("hnd", [False, True])
def test_fp8_arguments_pass_every_check_but_the_device(name, dtype, hnd):
    """uint8 and float8 caches, separate or HND K | V views (strides in bytes),
    scales of shape [1] and []: only the CPU device is refused."""
    spec = SPECS[name + "_fp8"]
    with pytest.raises(ValueError, match="x must be on a CUDA device, got cpu"):
        _op(spec)(**_fp8_args(spec, dtype=dtype, hnd=hnd))


_KV = FLINT8.kv_heads_per_rank


@pytest.mark.parametrize("change, exc, match", [
    (dict(k_scale=None), ValueError, r"spec '.*' has kv_cache_dtype='fp8_e4m3': pass k_scale, the layer's fp32 "
                                     r"K scale as a one-element CUDA tensor .*1\.0 where the checkpoint has none"),
    (dict(v_scale=None), ValueError, r"pass v_scale, the layer's fp32 V scale"),
    (dict(k_scale=0.5), TypeError, r"k_scale must be a one-element fp32 torch.Tensor .*got float 0.5: pass e.g. "
                                   r"torch.tensor"),
    (dict(v_scale=torch.ones(1, dtype=torch.float64)), TypeError, r"v_scale must be torch.float32, got "
                                                                  r"torch.float64: convert it with .float\(\)"),
    (dict(k_scale=torch.ones(_KV)), ValueError, r"k_scale must hold one fp32 value \(one scale per layer\), got "
                                                r"shape \(4,\): per-kv-head scale vectors are not supported"),
    (dict(v_scale=torch.ones(0)), ValueError, r"v_scale must hold one fp32 value"),
    (dict(k_cache=torch.zeros(4, 16, _KV, 128, dtype=torch.bfloat16),
          v_cache=torch.zeros(4, 16, _KV, 128, dtype=torch.bfloat16)), TypeError,
     r"k_cache must be torch.float8_e4m3fn or torch.uint8 \(spec kv_cache_dtype 'fp8_e4m3'\), got "
     r"torch.bfloat16: allocate the cache as torch.float8_e4m3fn or torch.uint8"),
    (dict(v_cache=torch.zeros(4, 16, _KV, 128, dtype=torch.int8)), TypeError, r"v_cache must be torch.float8_e4m3fn"),
    (dict(v_cache=torch.zeros(4, 16, _KV, 128, dtype=torch.float8_e4m3fn)), TypeError,
     r"k_cache and v_cache must have one dtype, got torch.uint8 and torch.float8_e4m3fn"),
    (dict(k_cache=torch.zeros(4, 16, _KV, 136, dtype=torch.uint8)[..., :128]), ValueError,
     r"k_cache strides \(8704, 544, 136, 1\) are not supported: .*multiples of 16 elements of 1 byte \(16 bytes\)"),
    (dict(k_cache=torch.zeros(4 * 16 * _KV * 128 + 8, dtype=torch.uint8)[8:].view(4, 16, _KV, 128)), ValueError,
     "k_cache must start 16-byte aligned"),
    (dict(k_cache=torch.zeros(4, 16, _KV, 64, dtype=torch.uint8)), ValueError,
     r"k_cache must be a \[blocks, block_size, 4, 128\] view"),
])
def test_fp8_rejections_name_the_argument(change, exc, match):
    a = _fp8_args()
    a.update(change)
    with pytest.raises(exc, match=match):
        _op(FLINT8)(**a)


@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
def test_bf16_spec_refuses_scales(name):
    a = _cpu_args()
    with pytest.raises(ValueError, match=rf"{name} given but spec '.*' has kv_cache_dtype='bf16' .*build a spec "
                                         r"with kv_cache_dtype='fp8_e4m3'"):
        _op()(**a, **{name: torch.ones(1)})


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn])
def test_bf16_spec_refuses_an_fp8_cache(dtype):
    a = _cpu_args()
    a.update(k_cache=torch.zeros(4, 16, 4, 128, dtype=dtype), v_cache=torch.zeros(4, 16, 4, 128, dtype=dtype))
    with pytest.raises(TypeError, match=rf"k_cache must be torch.bfloat16 \(spec kv_cache_dtype 'bf16'\), got {dtype}: "
                                        r"for an fp8 cache use a spec with kv_cache_dtype='fp8_e4m3'"):
        _op()(**a)


@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
@pytest.mark.parametrize("bad", [0.0, -0.5, float("nan"), float("inf"), float("-inf")])
def test_check_inputs_scale_contract(which, bad):
    """FLINTGEN_CHECK_INPUTS=1's scale check (the GPU test runs it through the op)."""
    op, a = _op(FLINT8), _fp8_args()
    sc = dict(k_scale=torch.ones(1), v_scale=torch.ones(1))
    op._check_device_contracts(a["positions"], a["cos_sin_cache"], a["slot_mapping"], a["k_cache"], **sc)
    sc[which] = torch.tensor([bad])
    with pytest.raises(ValueError, match=rf"{which} = {bad!r} must be finite and > 0 .*pass the layer's {which}"):
        op._check_device_contracts(a["positions"], a["cos_sin_cache"], a["slot_mapping"], a["k_cache"], **sc)


# ============================================================== the variant (CPU)
def test_fp8_variant_and_render_params_come_from_layout():
    v = KDEF.variants(FLINT8, T132)
    assert len(v) == 1 and v[0]["kv_dtype"] == "fp8_e4m3" and "kv_dtypefp8_e4m3" in v[0].name
    bf = KDEF.variant(SPECS["flint"])
    assert "kv_dtype" not in dict(bf.params)              # bf16 names (and cache keys) as before
    e = layout.kv_dtype("fp8_e4m3")
    p = KDEF.render_params(FLINT8, v[0])
    assert (p["kv_type"], p["kv_elem_bytes"], p["kv_fp8"]) == (e.cutlass_type, e.elem_bytes, True) == \
        ("Float8E4M3FN", 1, True)
    pb = KDEF.render_params(SPECS["flint"], bf)
    assert (pb["kv_type"], pb["kv_elem_bytes"], pb["kv_fp8"]) == ("BFloat16", 2, False)
    src = codegen.render(v[0].kernel, KDEF.template, dict(p))
    assert "KV_FP8 = True" in src and "KV_ELEM_BYTES = 1" in src and "k_scale: cute.Tensor" in src
    src_bf = codegen.render(bf.kernel, KDEF.template, dict(pb))
    assert "KV_FP8 = False" in src_bf and "k_scale: cute.Tensor" not in src_bf and "kv_scale = " not in src_bf


def test_every_fp8_compile_case_is_a_spec():
    for n in FP8_CASES:
        assert SPECS[n + "_fp8"].kv_cache_dtype == "fp8_e4m3" and SPECS[n].kv_cache_dtype == "bf16"
    assert {SPECS[n + "_fp8"].head_dim for n in FP8_CASES} == {64, 96, 128, 256}


# ============================================================== GPU
class Pair:
    """One case run through the bf16 twin and then the fp8 binary on the
    same inputs: ``q_b`` / ``k_b`` / ``v_b`` the twin's q and (HND bf16)
    cache, ``q``, ``k8`` / ``v8`` the fp8 binary's."""

    def __init__(self, name, m, *, seed=0, f8=False, hnd=True, mutate=None, scales=None, spec8=None,
                 spec_b=None, op_b=None, op8=None):
        self.spec_b = spec_b or SPECS[name]
        self.spec8 = spec8 or SPECS[name + "_fp8"]
        c = self.c = Case(self.spec_b, m, seed=seed, residual=(m % 2 == 0), n_slots=max(m - (m % 3 == 2), 1),
                          hnd=True)
        if mutate is not None:
            mutate(c)
        self.op_b = op_b or flintgen.get_kernel(self.spec_b, "qkv")
        self.op8 = op8 or flintgen.get_kernel(self.spec8, "qkv")
        q_b, _ = c.run(self.op_b, debug=False)
        self.q_b, self.k_b, self.v_b = q_b.clone(), c.k_cache.clone(), c.v_cache.clone()
        kv, d = c.kv, c.d
        blocks, bs = c.k_cache.shape[0], c.k_cache.shape[1]
        if hnd:       # vLLM-style: one uint8 (or float8) [blocks, kv_heads, page, 2D] tensor, K | V views
            self.cache8 = torch.full((blocks, kv, bs, 2 * d), POISON, dtype=torch.uint8, device="cuda")
            if f8:
                self.cache8 = self.cache8.view(torch.float8_e4m3fn)
            self.k8 = self.cache8[..., :d].permute(0, 2, 1, 3)
            self.v8 = self.cache8[..., d:].permute(0, 2, 1, 3)
        else:
            self.k8 = torch.full((blocks, bs, kv, d), POISON, dtype=torch.uint8, device="cuda")
            self.v8 = torch.full_like(self.k8, POISON)
            if f8:
                self.k8, self.v8 = self.k8.view(torch.float8_e4m3fn), self.v8.view(torch.float8_e4m3fn)
        ks, vs = scales(self) if callable(scales) else (scales or (0.05, 0.02))
        self.k_scale = torch.tensor([ks], dtype=torch.float32, device="cuda")
        self.v_scale = torch.tensor([vs], dtype=torch.float32, device="cuda")

    def args(self):
        a = list(self.c.args())
        a[10], a[11] = self.k8, self.v8
        return a

    def run(self):
        self.poison()
        self.q = torch.full_like(self.q_b, float("nan"))
        q, _ = self.op8(*self.args(), k_scale=self.k_scale, v_scale=self.v_scale, q_out=self.q)
        torch.cuda.synchronize()
        assert q is self.q
        return self

    def poison(self):
        self.k8.view(torch.uint8).fill_(POISON)
        self.v8.view(torch.uint8).fill_(POISON)

    def check(self, label, *, q=True):
        if q:
            assert torch.equal(self.q.view(torch.int16), self.q_b.view(torch.int16)), f"{label}: q differs from bf16"
        bs = self.k8.shape[1]
        k8, v8 = self.k8.view(torch.uint8).cpu(), self.v8.view(torch.uint8).cpu()
        kref, vref = e4m3_ref(self.k_b, self.k_scale), e4m3_ref(self.v_b, self.v_scale)
        written = torch.zeros(k8.shape[0] * bs, dtype=torch.bool)
        for t, s in enumerate(self.c.slots.cpu().tolist()):
            if s < 0:
                continue
            written[s] = True
            assert_e4m3_equal(k8[s // bs, s % bs], kref[s // bs, s % bs], f"{label}: token {t} K")
            assert_e4m3_equal(v8[s // bs, s % bs], vref[s // bs, s % bs], f"{label}: token {t} V")
        untouched = ~written.view(k8.shape[0], bs)
        assert (k8[untouched] == POISON).all() and (v8[untouched] == POISON).all(), \
            f"{label}: a slot not in slot_mapping was written"
        return k8[~untouched], v8[~untouched]


def _spread_scales(p):
    """Scales that put each cache's largest |value| near 400 (not a power of two)."""
    amax = lambda t: float(t.float().nan_to_num(0.0).abs().max())   # noqa: E731
    return amax(p.k_b) / 400 * 1.0173, amax(p.v_b) / 400 * 0.9871


FP8_GPU = ([("flint", m) for m in range(1, 9)]
           + [("oss_nvfp4", 1), ("oss_nvfp4", 7), ("oss_bf16", 4), ("d96", 1), ("d96", 8), ("d256", 6),
              ("gemma3_4b", 2), ("gemma3_4b", 8), ("glm4", 5), ("phi4_mini", 8), ("d256_interleaved", 3),
              ("d256_r64", 6), ("d96_r24", 8)])


FP8_TILES = [("flint", m) for m in (9, 16, 33, 64)] + [("oss_bf16", 40), ("d256", 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("name, m", FP8_TILES, ids=[f"{n}-M{m}" for n, m in FP8_TILES])
def test_fp8_token_tiles_bit_exact(name, m):
    """max_tokens 64: the 16 / 32 / 64-token binaries quantize like the bf16 twin's tile."""
    p = Pair(name, m, seed=500 + m, f8=m % 2 == 1, hnd=m % 2 == 0, scales=_spread_scales,
             spec_b=SPECS[name].replace(max_tokens=64), spec8=SPECS[name + "_fp8"].replace(max_tokens=64)).run()
    p.check(f"{name} M={m} (max_tokens 64)")


@pytest.mark.gpu
@pytest.mark.parametrize("name, m", FP8_GPU, ids=[f"{n}-M{m}" for n, m in FP8_GPU])
def test_fp8_bytes_bit_exact(name, m):
    """Every head dim (64 / 96 / 128 / 256), run length (1..8 bytes) and M 1..8;
    uint8 HND views for even M, float8 separate caches for odd M."""
    p = Pair(name, m, seed=300 + 11 * m + len(name), f8=m % 2 == 1, hnd=m % 2 == 0, scales=_spread_scales).run()
    k8, v8 = p.check(f"{name} M={m}")
    assert ((k8 & 0x7F) >= 0x7C).any() and ((v8 & 0x7F) >= 0x7C).any()   # the largest |value| lands near 400


@pytest.mark.gpu
def test_fp8_tiny_scales_saturate():
    p = Pair("flint", 8, seed=5, scales=(1e-3, 1e-3)).run()
    k8, v8 = p.check("scale 1e-3")
    sat = lambda t: float(((t & 0x7F) == 0x7E).float().mean())   # noqa: E731
    assert sat(k8) > 0.5 and sat(v8) > 0.5, (sat(k8), sat(v8))


@pytest.mark.gpu
def test_fp8_huge_scales_give_subnormals():
    p = Pair("flint", 7, seed=6, f8=True, scales=(300.0, 1e3)).run()
    k8, v8 = p.check("scale 300 / 1000")
    for t in (k8, v8):
        sub = ((t & 0x78) == 0) & ((t & 0x07) != 0)
        assert sub.any() and ((t & 0x7F) == 0).any()


@pytest.mark.gpu
def test_fp8_values_beyond_range_and_nan_inputs():
    """Weights scaled 2000x (K and V far past 448 at scale 1), one weight row
    NaN in a K head and one in a V head, one of 3e38 (inf or NaN sums)."""
    spec = SPECS["oss_bf16"]
    qh, kv, d = spec.q_heads_per_rank, spec.kv_heads_per_rank, spec.head_dim

    def mutate(c):
        c.weight.mul_(2000)
        c.weight[qh * d + 3] = float("nan")                       # K head 0, dim 3 (and its RoPE partner)
        c.weight[(qh + kv) * d + 5] = float("nan")                # V head 0, dim 5
        c.weight[(qh + kv + 1) * d + 7] = 3e38                    # V head 1, dim 7

    p = Pair("oss_bf16", 6, seed=7, mutate=mutate, scales=(1.0, 1.0)).run()
    k8, v8 = p.check("beyond range + NaN")
    assert ((v8 & 0x7F) == 0x7E).float().mean() > 0.5
    assert ((k8 & 0x7F) == 0x7F).any() and ((v8 & 0x7F) == 0x7F).any()    # the NaN rows stayed NaN


# a spec whose K / V rows are exactly their bias (bf16 weights set to 0, no norm, no RoPE)
HAND = SPECS["oss_bf16"].replace(rope_style="none")
HAND8 = HAND.replace(kv_cache_dtype="fp8_e4m3")


def _hand_table(scale: float, recip, gen):
    specials = [1.0, -1.0, 3.0, 448.0, 464.0, 465.0, 480.0, 1e4, -1e4, float("inf"), float("-inf"), float("nan"),
                2 ** -9, 2 ** -10, 1.5 * 2 ** -9, 2.5 * 2 ** -9, 1e-30, -1e-30, 0.0, -0.0, 1.0625, 1.1875, -1.0625]
    vals = [v * scale for v in specials] + recip
    vals += (torch.randn(512 - len(vals), generator=gen) * scale * 50).tolist()
    return torch.tensor(vals).bfloat16()


@pytest.mark.gpu
@pytest.mark.parametrize("f8", [False, True])
def test_fp8_hand_picked_values(f8):
    """K rows = bias, V rows = bias: saturation (448, the 464 tie, 480, inf),
    subnormal ties to even, signed zeros, NaN, and the values where a
    reciprocal multiply gives another byte (k_scale 0.3, v_scale 7)."""
    qh, kv, d = HAND.q_heads_per_rank, HAND.kv_heads_per_rank, HAND.head_dim
    gen = torch.Generator().manual_seed(8)
    tk, tv = _hand_table(0.3, RECIP_03, gen), _hand_table(7.0, RECIP_7, gen)
    assert kv * d == 512

    def mutate(c):
        c.weight.zero_()
        c.bias[qh * d:(qh + kv) * d] = tk.cuda()
        c.bias[(qh + kv) * d:] = tv.cuda()

    p = Pair("hand", 4, seed=9, mutate=mutate, scales=(0.3, 7.0), spec_b=HAND, spec8=HAND8, f8=f8,
             hnd=not f8).run()
    rows_k = (tk.float() + 0.0).bfloat16().view(kv, d)   # the GEMV adds its zero sum first: -0 becomes +0
    rows_v = (tv.float() + 0.0).bfloat16().view(kv, d)
    bs, s = p.k8.shape[1], int(p.c.slots[0])
    twin_k = p.k_b[s // bs, s % bs].cpu()
    ok = (twin_k.view(torch.int16) == rows_k.view(torch.int16)) | (twin_k.isnan() & rows_k.isnan())
    assert ok.all(), "the bf16 twin's K rows are not the bias"
    p.check("hand-picked", q=False)
    k8, v8 = p.k8.view(torch.uint8)[s // bs, s % bs].cpu(), p.v8.view(torch.uint8)[s // bs, s % bs].cpu()
    assert_e4m3_equal(k8, e4m3_ref(rows_k, torch.tensor([0.3])), "K vs the table")
    assert_e4m3_equal(v8, e4m3_ref(rows_v, torch.tensor([7.0])), "V vs the table")
    assert (v8 != _recip_ref(rows_v, torch.tensor([7.0]))).any()   # a reciprocal multiply would fail here
    assert k8.view(-1)[:6].tolist() == [0x38, 0xB8, 0x44, 0x7E, 0x7E, 0x7E]


# (k_scale, v_scale): one inside kv_quant's fast range [2^-64, 2^64], near an end, one outside
EDGE_SCALES = [(1.37 * 2.0**-70, 1.9 * 2.0**63), (1.5 * 2.0**-64, 1.3 * 2.0**70)]


@pytest.mark.gpu
@pytest.mark.parametrize("ks, vs", EDGE_SCALES, ids=["k-outside", "v-outside"])
def test_fp8_scales_at_and_past_the_fast_quotient_range(ks, vs):
    """The hand-picked table scaled to scales near and past the ends of
    kv_quant's reciprocal-based range: past them the epilogue's div.rn copy
    runs (tests/test_kv_quant_division.py proves both on the CPU)."""
    qh, kv, d = HAND.q_heads_per_rank, HAND.kv_heads_per_rank, HAND.head_dim
    gen = torch.Generator().manual_seed(13)
    tk, tv = _hand_table(ks, [], gen), _hand_table(vs, [], gen)

    def mutate(c):
        c.weight.zero_()
        c.bias[qh * d:(qh + kv) * d] = tk.cuda()
        c.bias[(qh + kv) * d:] = tv.cuda()

    p = Pair("hand", 4, seed=14, mutate=mutate, scales=(ks, vs), spec_b=HAND, spec8=HAND8).run()
    p.check("scales at the ends", q=False)
    bs, s = p.k8.shape[1], int(p.c.slots[0])
    for got, table, scale in ((p.k8, tk, p.k_scale), (p.v8, tv, p.v_scale)):
        rows = (table.float() + 0.0).bfloat16().view(kv, d)
        b = got.view(torch.uint8)[s // bs, s % bs].cpu()
        assert_e4m3_equal(b, e4m3_ref(rows, scale), f"scale {float(scale)} vs the table")
        assert (((b & 0x7F) != 0) & ((b & 0x7F) < 0x7E)).sum() > 100   # mostly neither 0 nor saturated


@pytest.mark.gpu
def test_fp8_graph_replay_sees_scales_updated_in_place():
    p = Pair("flint", 4, seed=10, scales=(0.05, 0.02))
    flintgen.warmup(p.spec8, ["qkv"])
    p.run().check("eager")
    q = torch.empty_like(p.q_b)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        p.op8(*p.args(), k_scale=p.k_scale, v_scale=p.v_scale, q_out=q)
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=s):
            p.op8(*p.args(), k_scale=p.k_scale, v_scale=p.v_scale, q_out=q)
    torch.cuda.synchronize()
    for ks, vs in ((0.011, 0.3), (2.5, 1e-3), (0.05, 0.02)):
        p.k_scale.fill_(ks)
        p.v_scale.fill_(vs)
        p.poison()
        q.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        p.q = q
        p.check(f"replay k_scale {ks} v_scale {vs}")


@pytest.mark.gpu
def test_fp8_scale_on_the_cpu_and_check_inputs(monkeypatch):
    p = Pair("flint", 2, seed=11)
    with pytest.raises(ValueError, match="k_scale must be on a CUDA device, got cpu"):
        p.op8(*p.args(), k_scale=p.k_scale.cpu(), v_scale=p.v_scale)
    monkeypatch.setenv("FLINTGEN_CHECK_INPUTS", "1")
    for bad in (0.0, float("nan")):
        with pytest.raises(ValueError, match="v_scale = .* must be finite and > 0"):
            p.op8(*p.args(), k_scale=p.k_scale, v_scale=torch.tensor([bad], device="cuda"))
    p.run().check("checked inputs")


@pytest.mark.gpu
def test_fp8_torch_op_passes_the_scales():
    import flintgen.torch_ops  # noqa: F401

    p = Pair("flint", 3, seed=12).run()
    want_k, want_v = p.k8.clone(), p.v8.clone()
    p.poison()
    a = p.args()
    s = p.spec8
    q, _ = torch.ops.flintgen.qkv(*a, s.rms_eps, s.rms_eps, s.canonical_json(), p.k_scale, p.v_scale)
    torch.cuda.synchronize()
    assert torch.equal(q.view(torch.int16), p.q_b.view(torch.int16))
    assert torch.equal(p.k8.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(p.v8.view(torch.uint8), want_v.view(torch.uint8))
