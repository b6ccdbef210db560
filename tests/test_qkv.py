"""Fused QKV step: validation (any machine), the compiled variants (compile
marker), numerics, cache writes, PDL chains and composition with decode
attention (GPU). The NVFP4 layout and quantizer on the CPU:
tests/test_nvfp4_layout.py.

Numerics checked on the GPU, on fresh random inputs with poisoned outputs:
* residual_out bit-exact against torch's bf16 add;
* every pre-norm row (debug binary) within 1 bf16 ulp of the fp64 product of
  the same dequantized weights (+ bias), plus a floor of 2^-17 sum|x w| where
  fp32 accumulation cannot resolve a cancellation;
* q and k within 1 bf16 ulp of an fp32 q/k-norm + RoPE of the kernel's own
  pre-norm rows (floor 2^-19 (|a| + |b|) for RoPE's a - b cancellations);
* v bit-equal to its pre-norm rows; untouched cache slots keep their poison.

ROPE_CASES are the epilogue's variants beyond flint's whole-head NeoX (head_dim
96, partial rotary, interleaved pairs, norm_weight_offset): compiled here, run
on the GPU here; their lane mapping and references are checked on the CPU in
tests/test_qkv_epilogue.py.
"""

from __future__ import annotations

import re

import pytest
import torch
from decode_attention_cases import check_compiled

import flintgen
from flintgen import quant
from flintgen.configs.qkv_config import QKVConfig
from flintgen.kernels.base import Target
from flintgen.kernels.qkv import QKVDef
from flintgen.presets import FLINT
from flintgen.references.qkv import bf16_ulp, gemv_ref, qk_norm_rope_ref, within_ulp
from test_nvfp4_layout import HAND_GS, _hand_expected, _hand_nvfp4

KDEF = QKVDef()
T132 = Target("sm_90a", 132)
CUDA = torch.cuda.is_available()

PHI_SHORT48 = [round(1.0 + 0.0125 * i, 4) for i in range(48)]   # synthetic longrope factors (the shape of Phi-4-mini's)
PHI_LONG48 = [round(1.08 ** i, 4) for i in range(48)]

SPECS = {
    "flint": FLINT,
    "flint_bf16": FLINT.replace(weight_format="bf16"),
    "flint_norope": FLINT.replace(rope_style="none"),
    "flint_nonorm": FLINT.replace(qk_norm=False),
    "bf16_4096": FLINT.replace(hidden_size=4096, num_kv_heads=8, weight_format="bf16", sliding_window=None,
                               layer_types=("full",), sinks=False),
    "oss_nvfp4": FLINT.replace(hidden_size=2880, num_q_heads=64, num_kv_heads=8, head_dim=64, qkv_bias=True,
                               qk_norm=False),
    "oss_bf16": FLINT.replace(hidden_size=2880, num_q_heads=64, num_kv_heads=8, head_dim=64, qkv_bias=True,
                              qk_norm=False, weight_format="bf16"),
    "d256": FLINT.replace(head_dim=256, num_q_heads=16, num_kv_heads=2, rope_style="none"),
    # Hidden sizes of other models (tests/test_qkv_grid.py compiles the grid): Qwen2.5-0.5B
    # (896: 14 steps, a K tail), Qwen3-0.6B (16 x 128 q heads = 2048 != hidden 1024), Qwen2.5-7B,
    # and hidden 16384 (Llama-3.1-405B at TP 8; xn staged in two K-chunks: QKVSmem).
    "qwen_896": FLINT.replace(hidden_size=896, num_q_heads=14, num_kv_heads=2, head_dim=64, qkv_bias=True,
                              qk_norm=False, weight_format="bf16"),
    "qwen3_1024": FLINT.replace(hidden_size=1024, num_q_heads=16, num_kv_heads=8, weight_format="bf16"),
    "qwen_3584": FLINT.replace(hidden_size=3584, num_q_heads=28, num_kv_heads=4, qkv_bias=True, qk_norm=False),
    "h16384": FLINT.replace(hidden_size=16384, num_q_heads=16, num_kv_heads=1),
    "h16384_bf16": FLINT.replace(hidden_size=16384, num_q_heads=4, num_kv_heads=1, head_dim=256,
                                 weight_format="bf16", qkv_bias=True),
    # head_dim 96 (Phi-3.5-mini's head): 3-CTA clusters, 48 NeoX pairs on 24 lanes
    "d96": FLINT.replace(hidden_size=3072, num_q_heads=32, num_kv_heads=8, head_dim=96),
    # GLM-4-9B per rank (tp 1): rotary 64 of 128, interleaved pairs, qkv bias, no q/k norm
    "glm4": FLINT.replace(hidden_size=4096, num_q_heads=32, num_kv_heads=2, rotary_dim=64, rope_style="interleaved",
                          qkv_bias=True, qk_norm=False, weight_format="bf16", rope_theta=10000.0),
    # GLM-4.5-Air-like: rotary 64 of 128, NeoX pairs, q/k norm over the whole head
    "glm4_moe": FLINT.replace(hidden_size=4096, num_q_heads=12, num_kv_heads=1, rotary_dim=64, qkv_bias=True,
                              rope_theta=1e6),
    # Phi-4-mini: rotary 96 of 128 (24 lanes of 2 pairs, 32 pass-through dims), NeoX, longrope
    "phi4_mini": FLINT.replace(hidden_size=3072, num_q_heads=24, num_kv_heads=8, rotary_dim=96, qk_norm=False,
                               weight_format="bf16", rope_theta=10000.0, rope_scaling="longrope",
                               rope_scaling_params={"short_factor": PHI_SHORT48, "long_factor": PHI_LONG48,
                                                    "factor": 32.0, "original_max_position_embeddings": 4096}),
    "flint_interleaved": FLINT.replace(rope_style="interleaved"),
    # Gemma-3-4b's attention: head 256, q/k norm weights scaled by (1 + w), rope over the whole head
    # (NVFP4: with bf16 weights this shape takes 138 registers, before this epilogue too)
    "gemma3_4b": FLINT.replace(hidden_size=2560, num_q_heads=8, num_kv_heads=4, head_dim=256, norm_weight_offset=1,
                               rope_theta=1e6),
    # shapes no model above has: 8-element runs (interleaved d256, 192 pass-through dims of d256
    # 8 per lane on 24 lanes) and d96 with rotary 24 (12 pair lanes, 18 pass lanes; GPT-NeoX-20B)
    "d256_interleaved": FLINT.replace(head_dim=256, num_q_heads=16, num_kv_heads=2, rope_style="interleaved"),
    "d256_r64": FLINT.replace(head_dim=256, num_q_heads=16, num_kv_heads=2, rotary_dim=64, norm_weight_offset=1),
    "d96_r24": FLINT.replace(hidden_size=3072, num_q_heads=32, num_kv_heads=8, head_dim=96, rotary_dim=24,
                             weight_format="bf16"),
}
# fp8 e4m3 caches (K / V quantized in the epilogue): head dims 64 / 96 / 128 / 256 and
# every run length of the lane mapping (1, 2, 4, 8 bytes); GPU numerics in tests/test_qkv_fp8.py
FP8_CASES = ["flint", "oss_nvfp4", "oss_bf16", "d96", "d256", "glm4", "phi4_mini", "gemma3_4b",
             "d256_interleaved", "d256_r64", "d96_r24"]
SPECS.update({f"{n}_fp8": SPECS[n].replace(kv_cache_dtype="fp8_e4m3") for n in FP8_CASES})
# which heads rotate how (the epilogue's code paths beyond flint's whole-head NeoX)
ROPE_CASES = ["d96", "glm4", "glm4_moe", "phi4_mini", "flint_interleaved", "gemma3_4b", "d256_interleaved",
              "d256_r64", "d96_r24"]


# ============================================================== config (CPU)
def test_config_heuristic():
    assert QKVConfig.from_heuristic(2048, 128, "nvfp4") == QKVConfig(32, 4, 8, 4, early_dequant=2)
    assert QKVConfig.from_heuristic(4096, 128, "nvfp4") == QKVConfig(32, 4, 8, 5, early_dequant=1)
    assert QKVConfig.from_heuristic(4096, 128, "bf16") == QKVConfig(32, 4, 8, 2)
    assert QKVConfig.from_heuristic(2048, 256, "nvfp4") == QKVConfig(32, 8, 8, 4, early_dequant=2)
    assert QKVConfig.from_heuristic(2880, 64, "nvfp4") == QKVConfig(16, 4, 8, 6)
    assert QKVConfig.from_heuristic(2880, 64, "bf16").cluster == 4
    with pytest.raises(ValueError, match="hidden_size = 2064 .* multiple of 64"):
        QKVConfig.from_heuristic(2064, 128, "bf16")
    with pytest.raises(ValueError, match="cluster = 16 is outside 1..8"):
        QKVConfig(16, 16, 4, 4)
    with pytest.raises(ValueError, match=r"early_dequant = 5 must be a step count 0..prefetch \(4\)"):
        QKVConfig(32, 4, 8, 4, 5)
    with pytest.raises(ValueError, match="early_dequant = True must be a step count"):
        QKVConfig(32, 4, 8, 4, True)
    with pytest.raises(TypeError, match="l2_prefetch = 1 must be a bool"):
        QKVConfig(32, 4, 8, 4, l2_prefetch=1)
    with pytest.raises(TypeError, match="evict_first = 1 must be a bool"):
        QKVConfig(32, 4, 8, 4, evict_first=1)


def test_variant_names_every_code_path():
    v = KDEF.variant(FLINT)
    assert (v["weight_format"], v["rope"], v["qk_norm"], v["bias"], v["debug"]) == ("nvfp4", True, True, False, False)
    assert KDEF.variant(SPECS["oss_bf16"])["bias"] is True
    assert KDEF.variants(FLINT, T132) == [v]          # the debug binary is built on demand only


# ============================================================== validation (CPU)
def _op(spec=FLINT):
    def load(v):
        raise AssertionError("validation must fail before loading")

    return KDEF.bind(spec, T132, load)


def _cpu_args(spec=FLINT, m=2, device="cpu"):
    h, d, n = spec.hidden_size, spec.head_dim, spec.qkv_out_features
    bf = dict(dtype=torch.bfloat16, device=device)
    kv = spec.kv_heads_per_rank
    a = dict(x=torch.zeros(m, h, **bf), residual=torch.zeros(m, h, **bf), norm_weight=torch.ones(h, **bf))
    if spec.weight_format == "nvfp4":
        a.update(weight=torch.zeros(n, h // 2, dtype=torch.uint8, device=device),
                 weight_scale=torch.zeros(-(-n // 128) * 128, -(-(h // 16) // 4) * 4, dtype=torch.uint8,
                                          device=device),
                 global_scale=torch.ones(1, device=device))
    else:
        a.update(weight=torch.zeros(n, h, **bf), weight_scale=None, global_scale=None)
    a.update(q_norm_weight=torch.ones(d, **bf) if spec.qk_norm else None,
             k_norm_weight=torch.ones(d, **bf) if spec.qk_norm else None,
             cos_sin_cache=torch.zeros(64, spec.rope_dim, device=device) if spec.rope_style != "none" else None,
             positions=torch.zeros(m, dtype=torch.int64, device=device),
             k_cache=torch.zeros(4, 16, kv, d, **bf), v_cache=torch.zeros(4, 16, kv, d, **bf),
             slot_mapping=torch.zeros(m, dtype=torch.int64, device=device),
             bias=torch.zeros(n, **bf) if spec.qkv_bias else None)
    return a


def test_rejects_cpu_tensors():
    with pytest.raises(ValueError, match="x must be on a CUDA device, got cpu"):
        _op()(**_cpu_args())


def test_rejects_more_tokens_than_max_tokens():
    with pytest.raises(ValueError, match=r"M = 9 tokens exceeds spec.max_tokens = 8 of the fused QKV step .*build the "
                                         r"spec with a larger max_tokens \(up to 64.* split the batch") as e:
        _op()(**_cpu_args(m=9))
    assert "at most 8" not in str(e.value)


@pytest.mark.parametrize("change, exc, match", [
    (dict(x=torch.zeros(2, 2048)), TypeError, "x must be torch.bfloat16"),
    (dict(x=torch.zeros(2, 1024, dtype=torch.bfloat16)), ValueError, r"x must have shape \[M, 2048\]"),
    (dict(weight=torch.zeros(5120, 2048, dtype=torch.uint8)), ValueError, r"weight must have shape \(5120, 1024\)"),
    (dict(weight_scale=None), ValueError, "weight_scale is required for NVFP4"),
    (dict(weight_scale=torch.zeros(5120, 64, dtype=torch.uint8)), ValueError,
     r"weight_scale must have shape \(5120, 128\), got \(5120, 64\)"),
    (dict(global_scale=torch.ones(2)), ValueError, "global_scale must hold one fp32 value"),
    (dict(positions=torch.zeros(2, dtype=torch.int32)), TypeError, "positions must be torch.int64"),
    (dict(slot_mapping=torch.zeros(3, dtype=torch.int64)), ValueError, "at most M = 2 entries"),
    (dict(cos_sin_cache=None), ValueError, "cos_sin_cache .* is required"),
    (dict(cos_sin_cache=torch.zeros(64, 64)), ValueError, r"cos_sin_cache must have shape \[max_pos, 128\]"),
    (dict(bias=torch.zeros(5120, dtype=torch.bfloat16)), ValueError, "bias must be None: the spec has qkv_bias=False"),
    (dict(k_cache=torch.zeros(4, 16, 8, 128, dtype=torch.bfloat16)), ValueError, r"k_cache must be a \[blocks, block_size, 4, 128\]"),
    (dict(v_cache=torch.zeros(4, 16, 4, 256, dtype=torch.bfloat16)[..., :128]), ValueError,
     "v_cache strides|k_cache and v_cache must have equal"),
    (dict(k_cache=torch.zeros(4, 16, 4, 128)), TypeError, "k_cache must be torch.bfloat16"),
])
def test_rejections_name_the_argument(change, exc, match):
    a = _cpu_args()
    a.update(change)
    with pytest.raises(exc, match=match):
        _op()(**a)


def test_bf16_spec_rejects_nvfp4_arguments():
    spec = SPECS["oss_bf16"]
    a = _cpu_args(spec)
    a["weight_scale"] = torch.zeros(1, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"weight_scale must be None: .*weight_format='bf16'"):
        _op(spec)(**a)
    a = _cpu_args(spec)
    a["bias"] = None
    with pytest.raises(ValueError, match=r"bias \[5120\] bf16 is required"):
        _op(spec)(**a)


def test_residual_out_without_residual():
    a = _cpu_args()
    a["residual"] = None
    with pytest.raises(ValueError, match="residual_out was given without residual"):
        _op()(**a, residual_out=torch.zeros(2, 2048, dtype=torch.bfloat16))


def test_partial_rotary_wants_a_rotary_dim_table():
    spec = SPECS["glm4"]
    a = _cpu_args(spec)
    a["cos_sin_cache"] = torch.zeros(64, 128)
    with pytest.raises(ValueError, match=r"cos_sin_cache must have shape \[max_pos, 64\] \(cos \| sin, rotary_dim = "
                                         r"64\), got \(64, 128\): build it with flintgen.rope_table"):
        _op(spec)(**a)


# ============================================================== compiled variants
COMPILE_CASES = (["flint", "flint_bf16", "flint_norope", "bf16_4096", "oss_nvfp4", "oss_bf16", "d256"] + ROPE_CASES
                 + [f"{n}_fp8" for n in FP8_CASES])


@pytest.mark.compile
@pytest.mark.parametrize("name", COMPILE_CASES + ["flint-debug", "flint_fp8-debug"])
def test_variant_compiles_clean(name):
    from flintgen.runtime import load_variant

    spec = SPECS[name.split("-")[0]]
    v = KDEF.variant(spec, debug=name.endswith("debug"), config=cluster_config(spec))
    load_variant(KDEF, spec, v, T132)
    res, ptx = check_compiled(KDEF, spec, v, T132)
    assert res["registers"] <= 128, res            # 2 CTAs of 256 threads per SM: one wave
    check_design_ptx(ptx, spec)


@pytest.mark.compile
@pytest.mark.parametrize("name", ["bf16_4096", "flint_bf16"])
def test_l2_prefetch_variant_compiles_clean(name):
    """QKVConfig.l2_prefetch: each of the CTA's weight rows, past its prefetched steps, into L2 before the wait."""
    from dataclasses import replace

    from flintgen.runtime import load_variant

    spec = SPECS[name]
    v = KDEF.variant(spec, config=replace(cluster_config(spec), l2_prefetch=True))
    off = KDEF.variant(spec, config=replace(cluster_config(spec), l2_prefetch=False))
    assert dict(v.params)["l2_prefetch"] is True and "l2_prefetch" not in dict(off.params)
    load_variant(KDEF, spec, v, T132)
    res, ptx = check_compiled(KDEF, spec, v, T132)
    assert res["registers"] <= 128, res
    check_design_ptx(ptx, spec)
    wait = ptx.index("griddepcontrol.wait")
    assert ptx[:wait].count("cp.async.bulk.prefetch.L2.global") == 1 and "prefetch.L2" not in ptx[wait:]


@pytest.mark.compile
@pytest.mark.parametrize("name", ["flint", "flint_bf16"])
def test_evict_first_variant_compiles_clean(name):
    """QKVConfig.evict_first: every weight (and scale) load reads with the L2 evict-first policy; off, none does."""
    from dataclasses import replace

    from flintgen.runtime import load_variant

    spec = SPECS[name]
    v = KDEF.variant(spec, config=replace(cluster_config(spec), evict_first=True))
    off = KDEF.variant(spec, config=cluster_config(spec))
    assert dict(v.params)["evict_first"] is True and "evict_first" not in dict(off.params)
    load_variant(KDEF, spec, v, T132)
    res, ptx = check_compiled(KDEF, spec, v, T132)
    check_design_ptx(ptx, spec)
    weight_loads = re.findall(r"ld\.global\.L1::no_allocate\S*", ptx)
    assert weight_loads and all(".L2::cache_hint" in w for w in weight_loads), weight_loads
    assert "createpolicy.fractional.L2::evict_first.b64" in ptx
    if spec.weight_format == "nvfp4":   # the scale bytes too
        assert "ld.global.L2::cache_hint.u8" in ptx
    load_variant(KDEF, spec, off, T132)
    _, ptx_off = check_compiled(KDEF, spec, off, T132)
    assert "cache_hint" not in ptx_off and "createpolicy" not in ptx_off


def cluster_config(spec, max_m: int = 8) -> QKVConfig:
    """The cluster design's configuration of the tile (production where the op
    does not stream it: bf16 from hidden 3584 streams the 8-token tile too,
    tests/test_qkv_stream.py; the cluster design stays selectable there)."""
    return KDEF.cluster_config(spec, max_m)


def check_design_ptx(ptx: str, spec) -> None:
    """The QKV GEMV's design in its PTX: NVFP4 dequantization exactly with
    NVFP4 weights; weights requested before the grid-dependency wait (they
    stream while RMSNorm runs); nothing written to global memory and no xn
    copy before it. fp8 caches: the e4m3 conversion (saturating cvt of the
    quotient: flintgen.device.kv_quant's reciprocal-based one, and div.rn
    in the copy for scales outside its range) exactly then, the k_scale /
    v_scale load (the only plain fp32 global load) and its reciprocal
    before the wait (the streaming design computes it after the wait:
    tests/test_qkv_stream.py)."""
    fp4 = ("cvt.rn.f16x2.e4m3x2", "mul.rn.bf16x2")
    assert all(p in ptx for p in fp4) == (spec.weight_format == "nvfp4")
    wait = ptx.index("griddepcontrol.wait")
    assert ptx.index("ld.global.L1::no_allocate") < wait
    assert "st.global" not in ptx[:wait]
    assert ptx.index("cp.async.bulk.shared::cluster.global") > wait
    fp8 = spec.kv_cache_dtype == "fp8_e4m3"
    quotient = "setp.eq.or.f32 keep, q0, 0f00000000, keep;"            # kv_quant.FAST_QUOTIENT_PTX's
    assert all(p in ptx for p in ("cvt.rn.satfinite.e4m3x2.f32", "div.rn.f32", "rcp.rn.f32", quotient)) == fp8
    if fp8:
        assert ptx[:wait].count("ld.global.f32") == 1                 # the scale: a parameter
        assert ptx.count("rcp.rn.f32") == 1 and ptx.index("rcp.") < wait   # 1 / scale: once, before the wait


# ============================================================== GPU helpers
def _nvfp4_weight(n, h, gen, device):
    w = torch.randn(n, h, generator=gen) * 0.02
    w[::37] *= 3e-5                                  # rows with subnormal e4m3 scales
    packed, sw, gs = quant.quantize_nvfp4(w)
    deq = quant.dequantize_nvfp4(packed, sw, gs, dtype=torch.float64)
    return packed.to(device), sw.to(device), gs.reshape(1).to(device), deq


class Case:
    """Random inputs of one spec and M, poisoned outputs, and the checks."""

    def __init__(self, spec, m, *, seed=0, residual=True, n_slots=None, hnd=False, max_pos=4096):
        dev = torch.device("cuda")
        gen = torch.Generator().manual_seed(seed)
        self.spec, self.m = spec, m
        h, d, n = spec.hidden_size, spec.head_dim, spec.qkv_out_features
        self.qh, self.kv, self.d = spec.q_heads_per_rank, spec.kv_heads_per_rank, d

        def rnd(*shape, scale=1.0, shift=0.0):
            return (torch.randn(*shape, generator=gen) * scale + shift).bfloat16().to(dev)

        self.x = rnd(m, h)
        self.residual = rnd(m, h) if residual else None
        self.norm_weight = rnd(h, scale=0.2, shift=1.0)
        if spec.weight_format == "nvfp4":
            self.weight, self.weight_scale, self.global_scale, self.w_ref = _nvfp4_weight(n, h, gen, dev)
        else:
            self.weight = rnd(n, h, scale=0.02)
            self.weight_scale = self.global_scale = None
            self.w_ref = self.weight.double().cpu()
        self.bias = rnd(n, scale=0.5) if spec.qkv_bias else None
        # norm_weight_offset 1 (Gemma): stored weights near 0 scale by ~(1 + w); a kernel
        # scaling by w would be far off
        shift = 0.0 if spec.norm_weight_offset else 1.0
        self.q_norm = rnd(d, scale=0.3, shift=shift) if spec.qk_norm else None
        self.k_norm = rnd(d, scale=0.3, shift=shift) if spec.qk_norm else None
        self.rope = spec.rope_style != "none"
        self.cos_sin = quant.rope_table(spec, max_pos, dev) if self.rope else None
        self.positions = torch.randint(0, max_pos, (m,), generator=gen).to(dev)
        blocks, bs = 6, spec.page_size
        n_slots = m if n_slots is None else n_slots
        slots = torch.randperm(blocks * bs, generator=gen)[:n_slots]
        if n_slots > 1:
            slots[1] = -1                             # a negative slot is skipped
        self.slots = slots.to(dev)
        if hnd:                                       # flint's HND cache and its K / V views
            self.cache = torch.full((blocks, self.kv, bs, 2 * d), float("nan"), dtype=torch.bfloat16, device=dev)
            self.k_cache = self.cache[..., :d].permute(0, 2, 1, 3)
            self.v_cache = self.cache[..., d:].permute(0, 2, 1, 3)
        else:
            self.k_cache = torch.full((blocks, bs, self.kv, d), float("nan"), dtype=torch.bfloat16, device=dev)
            self.v_cache = torch.full_like(self.k_cache, float("nan"))

    def poison(self):
        self.k_cache.fill_(float("nan"))
        self.v_cache.fill_(float("nan"))

    def args(self):
        return (self.x, self.residual, self.norm_weight, self.weight, self.weight_scale, self.global_scale,
                self.q_norm, self.k_norm, self.cos_sin, self.positions, self.k_cache, self.v_cache, self.slots,
                self.bias)

    def run(self, op, debug=True):
        n = self.spec.qkv_out_features
        self.q_out = torch.full((self.m, self.qh * self.d), float("nan"), dtype=torch.bfloat16, device="cuda")
        self.xn = torch.full_like(self.x, float("nan"))
        self.pre = torch.full((self.m, n), float("nan"), dtype=torch.bfloat16, device="cuda") if debug else None
        q, res = op(*self.args(), q_out=self.q_out, xn_out=self.xn, pre_norm_out=self.pre)
        torch.cuda.synchronize()
        assert q is self.q_out
        return q, res

    def check(self, q, res, label):
        spec, d, qh, kv = self.spec, self.d, self.qh, self.kv
        if self.residual is None:
            assert res is self.x
        else:
            assert torch.equal(res, self.x + self.residual), f"{label}: residual not bit-exact"
        assert not self.xn.isnan().any()
        # GEMV rows against the fp64 product of the same weights
        ref, absref = gemv_ref(self.xn.cpu(), self.w_ref, None if self.bias is None else self.bias.cpu())
        pre = self.pre.cpu()
        assert not pre.isnan().any(), f"{label}: unwritten pre-norm rows"
        ok = within_ulp(pre, ref, floor=2.0 ** -17 * absref)
        assert ok.all(), f"{label}: {int((~ok).sum())} GEMV outputs beyond 1 ulp; worst " \
                         f"{((pre.double() - ref).abs() / bf16_ulp(ref)).max():.2f} ulp"
        # q: fp32 norm + rope of the kernel's own rows
        pos = self.positions.cpu()
        cs = None if self.cos_sin is None else self.cos_sin.cpu()
        qn = None if self.q_norm is None else self.q_norm.cpu()
        kn = None if self.k_norm is None else self.k_norm.cpu()
        eps = spec.rms_eps
        style = spec.rope_style if self.rope else "neox"
        off = spec.norm_weight_offset
        qref, qmag = qk_norm_rope_ref(pre[:, :qh * d], d, qn, eps, cs, pos, style, off)
        qk = q.cpu()
        assert not qk.isnan().any(), f"{label}: unwritten q"
        ok = within_ulp(qk, qref, floor=2.0 ** -19 * qmag)
        assert ok.all(), f"{label}: {int((~ok).sum())} q elements beyond 1 ulp"
        kref, kmag = qk_norm_rope_ref(pre[:, qh * d:(qh + kv) * d], d, kn, eps, cs, pos, style, off)
        vref = pre[:, (qh + kv) * d:]
        kc, vc = self.k_cache.cpu(), self.v_cache.cpu()
        written = torch.zeros(kc.shape[0] * kc.shape[1], dtype=torch.bool)
        bs = kc.shape[1]
        for t, s in enumerate(self.slots.cpu().tolist()):
            if s < 0:
                continue
            written[s] = True
            krow, vrow = kc[s // bs, s % bs].reshape(-1), vc[s // bs, s % bs].reshape(-1)
            ok = within_ulp(krow, kref[t], floor=2.0 ** -19 * kmag[t])
            assert ok.all(), f"{label}: token {t}: {int((~ok).sum())} k elements beyond 1 ulp"
            assert torch.equal(vrow, vref[t]), f"{label}: token {t}: v differs from its pre-norm row"
        untouched = ~written.view(kc.shape[0], bs)
        assert kc[untouched].isnan().all() and vc[untouched].isnan().all(), f"{label}: a slot not in " \
            "slot_mapping (negative, or token past its length) was written"


@pytest.fixture(scope="module")
def ops():
    return {}


def _get(ops, name):
    if name not in ops:
        ops[name] = flintgen.get_kernel(SPECS[name], "qkv")
    return ops[name]


# ============================================================== GPU numerics
GPU_CASES = [("flint", m) for m in range(1, 9)] + [
    ("flint_bf16", 3), ("flint_norope", 5), ("flint_nonorm", 2), ("bf16_4096", 1), ("bf16_4096", 8),
    ("oss_nvfp4", 1), ("oss_nvfp4", 7), ("oss_bf16", 4), ("d256", 6),
    ("qwen_896", 1), ("qwen_896", 8), ("qwen3_1024", 5), ("qwen_3584", 3), ("qwen_3584", 8),
    ("h16384", 1), ("h16384", 8), ("h16384_bf16", 6),
    # the epilogue's RoPE / norm variants (ROPE_CASES)
    ("d96", 1), ("d96", 8), ("glm4", 5), ("glm4", 8), ("glm4_moe", 8), ("phi4_mini", 4), ("phi4_mini", 8),
    ("flint_interleaved", 7), ("gemma3_4b", 2), ("gemma3_4b", 8), ("d256_interleaved", 3), ("d256_r64", 6),
    ("d96_r24", 8)]
MAX_POS = {"phi4_mini": 8192}   # longrope: positions on both sides of original_max_position_embeddings 4096


def _numerics(op, name, m, n_slots):
    c = Case(SPECS[name], m, seed=100 * m + len(name), residual=(m % 3 != 1), n_slots=n_slots,
             max_pos=MAX_POS.get(name, 4096))
    q, res = c.run(op)
    c.check(q, res, f"{name} M={m}")
    # the production binary computes the same bits as the debug one
    q_dbg, k_dbg, v_dbg = q.clone(), c.k_cache.clone(), c.v_cache.clone()
    c.poison()
    q2, _ = c.run(op, debug=False)
    assert torch.equal(q2, q_dbg)
    assert torch.equal(c.k_cache.nan_to_num(7.0), k_dbg.nan_to_num(7.0))
    assert torch.equal(c.v_cache.nan_to_num(7.0), v_dbg.nan_to_num(7.0))


@pytest.mark.gpu
@pytest.mark.parametrize("name, m", GPU_CASES, ids=[f"{n}-M{m}" for n, m in GPU_CASES])
def test_numerics(ops, name, m):
    _numerics(_get(ops, name), name, m, max(m - (m % 2), 1))


# Token tiles (max_tokens 64: binaries of 8 / 16 / 32 / 64 tokens, tests/test_qkv_tokens.py): every
# tile's edges, slot_mapping shorter than M (the last tokens write no cache row), on flint (NVFP4),
# bf16 at hidden 4096, head dims 64 / 96 / 256, a qkv bias, interleaved partial rotary and hidden
# 16384 (xn in 16 K-chunks at 64 tokens).
TILE_MS = (1, 7, 8, 9, 16, 33, 63, 64)
for _n in ("flint", "flint_bf16", "bf16_4096", "oss_nvfp4", "oss_bf16", "d96", "d256", "glm4", "gemma3_4b",
           "h16384", "h16384_bf16"):
    SPECS[f"{_n}_t64"] = SPECS[_n].replace(max_tokens=64)
TILE_CASES = ([("flint_t64", m) for m in TILE_MS] + [("bf16_4096_t64", m) for m in TILE_MS]
              + [("flint_bf16_t64", 9), ("flint_bf16_t64", 17), ("flint_bf16_t64", 33), ("flint_bf16_t64", 64),
                 ("oss_nvfp4_t64", 9), ("oss_nvfp4_t64", 64), ("oss_bf16_t64", 33), ("oss_bf16_t64", 63),
                 ("d96_t64", 24), ("d96_t64", 64), ("d256_t64", 16), ("d256_t64", 64), ("glm4_t64", 40),
                 ("gemma3_4b_t64", 64), ("h16384_t64", 33), ("h16384_t64", 64), ("h16384_bf16_t64", 20)])


@pytest.mark.gpu
@pytest.mark.parametrize("name, m", TILE_CASES, ids=[f"{n}-M{m}" for n, m in TILE_CASES])
def test_numerics_token_tiles(ops, name, m):
    # slot_mapping shorter than M (by M // 8 + 1 tokens; M = 1 keeps its one slot)
    _numerics(_get(ops, name), name, m, max(1, m - 1 - m // 8))


OTHER_CONFIGS = [("flint", QKVConfig(32, 4, 8, 4), 8), ("flint", QKVConfig(32, 4, 8, 4, 3), 2),
                 ("flint", QKVConfig(16, 8, 8, 4, 4), 8), ("flint", QKVConfig(16, 8, 8, 4), 5),
                 ("flint", QKVConfig(16, 8, 4, 8), 3), ("bf16_4096", QKVConfig(16, 8, 8, 4), 8),
                 ("oss_nvfp4", QKVConfig(16, 4, 8, 6, 6), 6),
                 ("d96", QKVConfig(16, 6, 8, 6), 8), ("d96", QKVConfig(16, 6, 8, 6), 3),   # 6-CTA clusters
                 ("bf16_4096", QKVConfig(32, 4, 8, 2, l2_prefetch=True), 7),   # rows' rest prefetched into L2
                 ("flint", QKVConfig(32, 4, 8, 4, evict_first=True), 8),     # L2 evict-first weight reads
                 ("flint_bf16", QKVConfig(32, 4, 8, 2, l2_prefetch=True, evict_first=True), 3)]


@pytest.mark.gpu
@pytest.mark.parametrize("name, cfg, m", OTHER_CONFIGS,
                         ids=[f"{n}-r{c.rows}w{c.warps}p{c.prefetch}e{c.early_dequant}{'-l2' if c.l2_prefetch else ''}"
                              f"{'-ef' if c.evict_first else ''}"
                              for n, c, _ in OTHER_CONFIGS])
def test_numerics_other_launch_configs(name, cfg, m):
    """The configurations a benchmark sweep may pick compute the same contract."""
    from flintgen import toolchain
    from flintgen.kernels.qkv import QKVOp
    from flintgen.runtime import load_variant

    spec = SPECS[name]
    t = toolchain.resolve_target()
    op = QKVOp(KDEF, spec, t, lambda v: load_variant(KDEF, spec, v, t)[0], config=cfg)
    c = Case(spec, m, seed=900 + m, n_slots=m)
    q, res = c.run(op)
    c.check(q, res, f"{name} {cfg}")


@pytest.mark.gpu
def test_hnd_views_of_flint_cache(ops):
    op = _get(ops, "flint")
    c = Case(FLINT, 8, seed=7, hnd=True, n_slots=6)
    q, res = c.run(op)
    c.check(q, res, "flint HND")
    # through the cache itself: block b, head h, token o -> K | V halves
    d = c.d
    for t, s in enumerate(c.slots.cpu().tolist()):
        if s >= 0:
            page = c.cache[s // 16, :, s % 16].cpu()            # [kv, 2D]
            assert torch.equal(page[:, d:].reshape(-1), c.pre[t, (c.qh + c.kv) * d:].cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["d96", "glm4", "phi4_mini"])
def test_hnd_views_rope_variants(ops, name):
    """head_dim 96 and partial rotary through HND cache views (a page row of 2D)."""
    spec = SPECS[name]
    c = Case(spec, 6, seed=17, hnd=True, n_slots=5, max_pos=MAX_POS.get(name, 4096))
    q, res = c.run(_get(ops, name))
    c.check(q, res, f"{name} HND")
    d, bs = c.d, spec.page_size
    for t, s in enumerate(c.slots.cpu().tolist()):
        if s >= 0:
            page = c.cache[s // bs, :, s % bs].cpu()            # [kv, 2D]
            assert torch.equal(page[:, d:].reshape(-1), c.pre[t, (c.qh + c.kv) * d:].cpu())


@pytest.mark.gpu
def test_nvfp4_dequant_is_exact_one_hot(ops):
    """One-hot activations read single weight columns: the 64 hand-built
    columns of rows 0-1 and every row's scale and nibble decoding there."""
    op = _get(ops, "flint")
    c = Case(FLINT, 8, seed=3)
    packed, sw = c.weight.cpu(), c.weight_scale.cpu()
    hp, hsw = _hand_nvfp4()
    packed[:2, :32] = hp
    lin = quant.unswizzle_scales(sw, packed.shape[0], 2 * packed.shape[1])
    lin[:2, :4] = quant.unswizzle_scales(hsw, 2, 64)
    sw = quant.swizzle_scales(lin)
    c.weight, c.weight_scale = packed.cuda(), sw.cuda()
    c.global_scale = torch.tensor([HAND_GS], device="cuda")
    w_ref = quant.dequantize_nvfp4(packed, sw, HAND_GS, dtype=torch.float64)
    assert torch.equal(w_ref[:2, :64], _hand_expected())
    c.residual = None
    c.norm_weight = torch.ones_like(c.norm_weight)
    cols = list(range(64)) + [100, 511, 1023, 1024, 1500, 1983, 2046, 2047]   # 9 x 8 tokens
    for i in range(0, len(cols), 8):
        ks = cols[i:i + 8]
        c.x = torch.zeros(8, FLINT.hidden_size, dtype=torch.bfloat16, device="cuda")
        c.x[torch.arange(8), torch.tensor(ks)] = 1.0
        c.run(op)
        xk = c.xn[torch.arange(8), torch.tensor(ks)].double().cpu()          # the one nonzero input
        ref = xk[:, None] * w_ref[:, ks].T                                     # [8, N] exact products
        pre = c.pre.cpu().double()
        assert (within_ulp(pre, ref)).all(), f"columns {ks}"
        assert (pre == ref.float().bfloat16().double()).float().mean() > 0.99


@pytest.mark.gpu
def test_check_inputs_rejects_positions_past_table(ops, monkeypatch):
    op = _get(ops, "flint")
    c = Case(FLINT, 2, seed=5, max_pos=64)
    c.positions[1] = 64
    monkeypatch.setenv("FLINTGEN_CHECK_INPUTS", "1")
    with pytest.raises(ValueError, match=r"positions \[64\] are outside \[0, max_pos = 64\)"):
        op(*c.args())


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["flint", "flint_bf16"])   # flint_bf16: weights prefetched into L2 (its rule)
def test_chain_of_layers_reusing_buffers_is_race_free(ops, name):
    """L layers back to back with PDL on shared xn / q / residual buffers must
    give the same bits as the same layers separated by synchronizations."""
    op, spec = _get(ops, name), SPECS[name]
    layers = [Case(spec, 8, seed=50 + i, n_slots=8) for i in range(6)]
    for i, c in enumerate(layers):                  # every layer writes its own 8 slots
        c.slots = torch.arange(8 * i, 8 * i + 8, device="cuda")
        c.k_cache, c.v_cache = layers[0].k_cache, layers[0].v_cache
    x0 = layers[0].x

    def chain(sync):
        res = layers[0].residual.clone()
        xn = torch.empty_like(x0)
        q = torch.empty(8, spec.num_q_heads * 128, dtype=torch.bfloat16, device="cuda")
        layers[0].k_cache.fill_(float("nan"))
        layers[0].v_cache.fill_(float("nan"))
        torch.cuda.synchronize()
        for c in layers:
            a = list(c.args())
            a[1] = res
            op(*a, q_out=q, xn_out=xn, residual_out=res)
            if sync:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        return q.clone(), res.clone(), layers[0].k_cache.clone(), layers[0].v_cache.clone()

    want = chain(True)
    for _ in range(3):
        got = chain(False)
        for a, b, what in zip(got, want, ("q", "residual", "k_cache", "v_cache")):
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), f"{what} differs without syncs"
            assert torch.equal(a.isnan(), b.isnan()), what


@pytest.mark.gpu
def test_composes_with_decode_attention(ops):
    """Write the new token's K/V with this kernel, attend with decode
    attention over the same HND cache, compare with the fp64 reference."""
    try:
        attn = flintgen.get_kernel(FLINT, "decode_attention")
    except ValueError as e:
        pytest.skip(f"decode_attention not available: {e}")
    from flintgen.references.decode_attention import decode_attention_ref, decode_attention_seed_rounding, rel_error

    op = _get(ops, "flint")
    b, d, page, blocks = 4, 128, 16, 40
    gen = torch.Generator().manual_seed(11)
    c = Case(FLINT, b, seed=11, hnd=True)
    c.cache = (torch.randn(blocks, 4, page, 2 * d, generator=gen) * 0.5).bfloat16().cuda()
    c.k_cache = c.cache[..., :d].permute(0, 2, 1, 3)
    c.v_cache = c.cache[..., d:].permute(0, 2, 1, 3)
    lens = torch.tensor([1, 17, 100, 160], dtype=torch.int32)
    tables = torch.randperm(blocks, generator=gen)[: b * 10].view(b, 10).to(torch.int32)
    pos = (lens - 1).long()
    c.positions = pos.cuda()
    c.slots = (tables[torch.arange(b), pos // page].long() * page + pos % page).cuda()
    for t in range(b):                               # poison the new token's slot
        s = int(c.slots[t])
        c.cache[s // page, :, s % page] = float("nan")
    q, _ = c.run(op, debug=False)
    assert not c.cache.isnan().any(), "the kernel left a new slot unwritten"
    qv = q.view(b, FLINT.num_q_heads, d)
    sinks = torch.randn(FLINT.num_q_heads, generator=gen).cuda() if FLINT.sinks else None
    out = torch.empty_like(qv)
    a = (qv, c.cache, tables.cuda(), lens.cuda(), sinks, None, FLINT.scale)
    attn(*a, out)
    torch.cuda.synchronize()
    ref = decode_attention_ref(*a)
    ek = rel_error(out, ref)
    et = rel_error(decode_attention_seed_rounding(*a), ref)
    assert ek <= 2 * et + 1e-6 and ek < 1e-2, (ek, et)


def test_head_dim_96_builds_3_cta_clusters():
    """Phi-3.5-mini's head: 3 CTAs of 32 rows per head (multicast mask 0b111);
    a head dim the fused step has no mapping for is refused, naming the fix."""
    spec = FLINT.replace(head_dim=96, num_q_heads=32, num_kv_heads=32, hidden_size=3072)
    (v,) = QKVDef().variants(spec, Target("sm_90a", 132))
    assert (v["head_dim"], v["rows"], v["cluster"]) == (96, 32, 3)
    assert QKVConfig.from_heuristic(3072, 96, "nvfp4") == QKVConfig(32, 3, 8, 5, early_dequant=1)
    with pytest.raises(NotImplementedError, match=r"qkv: head_dim = 80 is not supported .*\[64, 96, 128, 256\]\): "
                                                  r"use one of those head dims, or build decode attention alone"):
        QKVConfig.from_heuristic(2560, 80, "bf16")
    with pytest.raises(ValueError, match=r"rows 32 x cluster 4 must cover head_dim = 96 .*use cluster = 3"):
        QKVDef().variant(spec, config=QKVConfig(32, 4, 8, 4))


def test_quantizer_outputs_on_the_weights_device():
    packed, sw, gs = quant.quantize_nvfp4(torch.randn(64, 128) * 0.02)
    assert packed.device == sw.device == gs.device == torch.device("cpu")


@pytest.mark.gpu
def test_quantizer_output_feeds_the_op_on_cuda(ops):
    """quantize_nvfp4 of a CUDA weight returns all three tensors on that device,
    and the op takes them as returned (the global scale too: one fp32 value)."""
    spec = SPECS["flint"]
    c = Case(spec, 2, seed=7)
    w = (torch.randn(spec.qkv_out_features, spec.hidden_size, generator=torch.Generator().manual_seed(7)) * 0.02)
    packed, sw, gs = quant.quantize_nvfp4(w.cuda())
    assert packed.is_cuda and sw.is_cuda and gs.is_cuda
    c.weight, c.weight_scale, c.global_scale = packed, sw, gs
    c.w_ref = quant.dequantize_nvfp4(packed, sw, gs, dtype=torch.float64)
    q, res = c.run(_get(ops, "flint"))
    c.check(q, res, "flint quantized on the GPU")
