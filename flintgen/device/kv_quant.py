"""fp8 e4m3 KV-cache writes of the fused QKV epilogue (flintgen.device.head_epilogue).

Provenance: written for flintgen's fused QKV GEMV.

A K or V element is stored as ``e4m3(bf16_row / scale)`` with one fp32
``scale`` per layer for K (``k_scale``) and one for V (``v_scale``), as
vLLM keeps them (dequantized value = e4m3 x scale). Bit-exact against torch::

    (row_bf16.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)

* ``row_bf16`` is the bf16-rounded value the bf16 path stores (converting a
  bf16 to fp32 is exact);
* the quotient is torch's fp32 ``/`` (IEEE, round to nearest even,
  subnormals kept) wherever the byte depends on it (below), from a
  reciprocal computed once; a plain multiply by ``1 / scale`` rounds twice
  and gives another byte for some values;
* ``cvt.rn.satfinite.e4m3x2.f32`` rounds to nearest even and saturates to
  +-448 (= the clamp, then torch's RNE cast, which maps [-448, 448] exactly
  as the cvt does), NaN stays NaN (torch: 0x7f / 0xff; the cvt: a NaN
  code, sign not guaranteed). Infinities saturate as the clamp does.

The quotient. ``load_scale`` reads the scale before griddepcontrol.wait (a
parameter: the kernel launched just before must not write it) and
``Scale.of`` computes ``r = rcp.rn.f32(s)`` once per thread (the cluster
design next to the load, the streaming design right after the wait: each
measured the faster, benchmarks/results/qkv_fp8_ablation.md), kept only where
``2^-64 <= s <= 2^64`` (``SAFE_LO``, ``SAFE_HI``), else ``r = 0`` (also for
NaN, inf, 0 and negative scales): ``Scale.fast()``, the same in every
thread. Per element ``x`` (``FAST_QUOTIENT_PTX``, branch-free; SASS: FMUL, 2
FFMA, 2 FSETP, the select folded into the second FFMA's predicate)::

    q0 = RN(x r)                      mul.rn.f32
    e  = RN(x - q0 s)                 fma.rn.f32: the remainder
    q1 = RN(q0 + e r)                 fma.rn.f32: Markstein's correction
    q  = q0 if |q0| >= 512 or q0 == 0 else q1          selp

For ``r = 0`` the epilogue runs a second copy of the conversion with
``div.rn.f32`` per element (one uniform branch; never taken for sane scales).
Why the fast ``q`` gives torch's byte (IEEE fp32 throughout; x a bf16, so
``x = 0`` or ``|x| >= 2^-133``; ``r`` normal and ``|s r - 1| <= 2^-24``):

* ``2^-11 <= |q0| < 512``: ``q1 = RN(x / s)``, bit for bit. For x and s in
  [1, 2) tests/test_kv_quant_division.py runs every pair, x's 128 bf16
  mantissas by s's 2^23 fp32 ones (FLINTGEN_DIV_EXHAUSTIVE=1; Markstein's
  theorem wants q0 within an ulp of x / s, but q0 is up to ~1.5 ulp off,
  the remainder then rounds (1.4 M of the 2^30 pairs), and q1 is right all
  the same; q1 != q0 in 27 % of them). Other exponents are
  the same computation scaled by powers of two: r, q0 and q1 are normal,
  and the remainder x - q0 s is a multiple of ulp(q0) ulp(s) >= 2^-34 2^-87,
  so it is exact (24 bits or fewer: representable, below 2^-126 too) or at
  least 2^24 times that, rounded in the normal range. Hence the safe range:
  with s near 2^-100 the remainder rounds among the subnormals and bytes
  change (one of the test's mutants).
* ``|q0| >= 512`` (x = +-inf, or a product past fp32, where e and q1 are
  NaN): ``|x / s| > 448``, both saturate to 448 with x's sign.
* ``q0 = +-0`` (x = +-0, or ``|x r| <= 2^-150``): torch's quotient is +-0
  or +-2^-149, its byte 0x00 / 0x80 with x's sign, and q0 is that signed
  zero (q1 is +0 for x = -0: -0 + +0 = +0).
* ``0 < |q0| < 2^-11``: torch's byte is 0x00 / 0x80 (``|x / s| < 2^-10``,
  e4m3's tie to 0). ``q0 + e r = x r + q0 (1 - s r) + eps r``, eps the
  remainder's rounding (2^-24 of it, or up to 2^-150 among the
  subnormals), is off ``x r`` by at most about ``2^-24 |q0| + 2^-150 r``,
  far below ``|x r| >= 2^-133 r``: q1 has x's sign and ``|q1| < 2^-10``.
* x NaN: q0, e and q1 are NaN, and the cvt keeps it NaN.

The test runs these PTX texts in exact arithmetic and checks every one of
the 65536 bf16 patterns against torch for ~390 scales across and past the
safe range.

A lane's runs of E = 1, 2, 4 or 8 consecutive elements
(flintgen.layout.EpilogueLanes) become one E-byte store; runs
start at multiples of E elements and the cache rows at multiples of 16
bytes (strides checked on the host), so every store is aligned.
"""

from __future__ import annotations

from typing import NamedTuple

from cutlass import Float32
from cutlass.cutlass_dsl import dsl_user_op

from flintgen.device import ldst, ptx

SAFE_LO, SAFE_HI = 2.0**-64, 2.0**64      # scales whose reciprocal-based quotient is exact (RECIP_PTX's)

# Per thread, $0 = rcp.rn(scale $1) where SAFE_LO <= scale <= SAFE_HI, else 0
# (setp is false for NaN). tests/test_kv_quant_division.py runs this text.
RECIP_PTX = (
    "{ .reg .pred ok;\n"
    "rcp.rn.f32 $0, $1;\n"
    "setp.ge.f32 ok, $1, 0f1F800000;\n"          # 2^-64
    "setp.le.and.f32 ok, $1, 0f5F800000, ok;\n"  # 2^64
    "selp.f32 $0, $0, 0f00000000, ok; }"
)

# Per element, $0 = x $1 / scale $2 from r $3 = RECIP_PTX's (non-zero): see the
# module docstring. ptxas folds the neg and abs into FFMA / FSETP operands.
FAST_QUOTIENT_PTX = (
    "{ .reg .f32 q0, nq, e, q1, a; .reg .pred keep;\n"
    "mul.rn.f32 q0, $1, $3;\n"
    "neg.f32 nq, q0;\n"
    "fma.rn.f32 e, nq, $2, $1;\n"
    "fma.rn.f32 q1, e, $3, q0;\n"
    "abs.f32 a, q0;\n"
    "setp.ge.f32 keep, a, 0f44000000;\n"         # 512
    "setp.eq.or.f32 keep, q0, 0f00000000, keep;\n"
    "selp.f32 $0, q0, q1, keep; }"
)


@dsl_user_op
def safe_recip(scale, *, loc=None, ip=None):
    """``rcp.rn.f32(scale)`` where ``SAFE_LO <= scale <= SAFE_HI``, else 0
    (``RECIP_PTX``). Marked side-effecting so that it stays where it is
    called (``Scale.of``, before or right after griddepcontrol.wait) rather
    than sinking into the epilogue."""
    return ptx._asm([Float32], [(Float32, scale)], RECIP_PTX, side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def fast_quotient(x, scale, recip, *, loc=None, ip=None):
    """``x / scale`` from ``recip = safe_recip(scale)`` (non-zero), good for the
    e4m3 byte (``FAST_QUOTIENT_PTX``; the module docstring says why)."""
    return ptx._asm(
        [Float32], [(Float32, x), (Float32, scale), (Float32, recip)], FAST_QUOTIENT_PTX, loc=loc, ip=ip,
    )  # fmt: skip


def load_scale(addr, pred):
    """The layer's fp32 k_scale or v_scale at global ``addr`` (0 where
    ``pred``, Int32, is 0: no access). Issued before griddepcontrol.wait."""
    return ldst.ldg_f32_pred(addr, pred)


class Scale(NamedTuple):
    """A layer's k_scale or v_scale for the quotients of one thread:
    ``scale`` and ``recip`` = ``safe_recip(scale)`` (0 outside the safe
    range), from ``load_scale``'s value."""

    scale: object
    recip: object

    @staticmethod
    def of(scale) -> "Scale":
        return Scale(scale, safe_recip(scale))

    def fast(self):
        """Whether ``fast_quotient`` is exact for this scale (a runtime Boolean,
        the same in every thread): the branch between the conversion's two
        copies (``e4m3_run``'s ``fast``)."""
        return self.recip != Float32(0.0)


def quotient(x, scale: Scale, fast: bool):
    """``x / scale.scale`` for the e4m3 byte: ``fast_quotient`` (``fast``,
    where ``scale.fast()``), else ``div.rn.f32``."""
    return fast_quotient(x, scale.scale, scale.recip) if fast else ptx.div_rn(x, scale.scale)


def _run_len(e: int) -> None:
    if e not in (1, 2, 4, 8):
        raise ValueError(f"an e4m3 run of {e} elements: 1, 2, 4 or 8 are supported")


def bf16_words_to_f32(words, e: int):
    """The ``e`` bf16 values packed in ``words`` (``ldst.pack_bf16_run``'s
    layout: element 2i in the low half of word i) as exact Float32."""
    _run_len(e)
    vals = []
    for w in words:
        vals += [ptx.bf16_lo(w), ptx.bf16_hi(w)]
    return vals[:e]


def e4m3_run(vals, scale: Scale, fast: bool):
    """Quantize Float32 ``vals`` (a run of 1, 2, 4 or 8) to e4m3 of
    ``vals / scale`` (``quotient``: ``fast`` only where ``scale.fast()``):
    words holding the bytes in memory order (element i in byte i % 4 of
    word i // 4; a run of 1 or 2 in the low bytes of one word)."""
    e = len(vals)
    _run_len(e)
    q = [quotient(v, scale, fast) for v in vals]
    if e == 1:
        return [ptx.e4m3x2(q[0], Float32(0.0))]
    if e == 2:
        return [ptx.e4m3x2(q[0], q[1])]
    return [ptx.e4m3x4(q[4 * i], q[4 * i + 1], q[4 * i + 2], q[4 * i + 3]) for i in range(e // 4)]


def stg_bytes_run(addr, words, e: int):
    """Store the ``e`` e4m3 bytes of ``words`` (``e4m3_run``) to global
    ``addr`` (aligned to ``e`` bytes) with one access."""
    _run_len(e)
    if e == 1:
        ptx.stg_b8(addr, words[0])
    elif e == 2:
        ptx.stg_b16(addr, words[0])
    elif e == 4:
        ptx.stg_u32(addr, words[0])
    else:
        ptx.stg_u32x2(addr, words[0], words[1])
