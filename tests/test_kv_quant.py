"""The fp8 K/V write's division (flintgen.device.kv_quant, ptx.div_rn_recip) on the CPU.

``div_rn_recip(a, b, rb)`` replaces one ``div.rn.f32`` per element by a
corrected product from ``rb = div.rn(1, b)``; it must stay bit-exact with
fp32 division (torch's ``/``, which vLLM's quantization uses). ``_mirror``
follows the PTX sequence instruction by instruction with exact rational
arithmetic (each ``mul.rn`` / ``fma.rn`` rounded once to fp32); the H200
bit-exact tests in test_qkv_fp8.py check the compiled code.
"""

from __future__ import annotations

import math
import random
import struct
from fractions import Fraction

import numpy as np
import pytest

TWO_M100 = struct.unpack("<f", struct.pack("<I", 0x0D800000))[0]    # 2^-100
TWO_M125 = struct.unpack("<f", struct.pack("<I", 0x01000000))[0]    # 2^-125


def _rn32(x: Fraction) -> float:
    """Round a rational to the nearest fp32 (ties to even), exactly."""
    if x == 0:
        return 0.0
    if abs(x) >= 2 ** 128 - 2 ** 103:              # past the largest fp32 by half an ulp: inf
        return math.copysign(math.inf, x)
    c = np.float32(float(x))                       # within an ulp (double rounding at most)
    cands = [v for v in (c, np.nextafter(c, np.float32(np.inf)), np.nextafter(c, np.float32(-np.inf)))
             if np.isfinite(v)]
    return float(min(cands, key=lambda v: (abs(Fraction(float(v)) - x), int(v.view(np.uint32)) & 1)))


def _op(x: float, y: float, z: float = 0.0) -> float:
    """fp32 fma / mul rounded once (IEEE specials through numpy)."""
    if not all(math.isfinite(v) for v in (x, y, z)):
        return float(np.float32(np.float64(x) * np.float64(y) + np.float64(z)))
    return _rn32(Fraction(x) * Fraction(y) + Fraction(z))


def _mirror(a: float, b: float, rb: float) -> float:
    """ptx.div_rn_recip: q = a rb; r = fma(-q, b, a); q1 = fma(r, rb, q);
    q1 where q != 0 and finite, else q; div.rn where |a| < 2^-100 or rb < 2^-125."""
    if abs(a) < TWO_M100 or rb < TWO_M125:
        return float(np.float32(a) / np.float32(b))
    q = _op(a, rb)
    if q == 0 or not math.isfinite(q):
        return q
    r = _op(-q, b, a)
    return _op(r, rb, q)


def _recip(b: float) -> float:
    return float(np.float32(1.0) / np.float32(b))


def _same(x: float, y: float) -> bool:
    if math.isnan(x) or math.isnan(y):
        return math.isnan(x) and math.isnan(y)
    return x == y and math.copysign(1.0, x) == math.copysign(1.0, y)


def _bf16(x: float) -> float:
    u = struct.unpack("<I", struct.pack("<f", float(np.float32(x))))[0]
    return struct.unpack("<f", struct.pack("<I", u & 0xFFFF0000))[0]


def _check(pairs):
    bad = [(a, b) for a, b in pairs if not _same(_mirror(a, b, _recip(b)), float(np.float32(a) / np.float32(b)))]
    assert not bad, f"{len(bad)} quotients differ from fp32 division, e.g. {bad[:3]}"


@pytest.mark.parametrize("bf16_values", [True, False], ids=["bf16-a", "fp32-a"])
def test_random_quotients_bit_exact(bf16_values):
    """K / V values (bf16, and any fp32 for a stronger check) over 2^+-60,
    scales over 2^+-40 (past e4m3's range both ways)."""
    rnd = random.Random(11 + bf16_values)
    pairs = []
    for _ in range(20000):
        a = float(np.float32(rnd.gauss(0, 1) * 2.0 ** rnd.randint(-60, 60)))
        pairs.append((_bf16(a) if bf16_values else a, float(np.float32(rnd.uniform(0.5, 1) * 2.0 ** rnd.randint(-40, 40)))))
    _check(pairs)


def test_near_midpoint_quotients_bit_exact():
    """a = RN(mid b) for mid halfway between two fp32: the quotients a plain
    multiply by 1 / b rounds the wrong way most often."""
    rnd = random.Random(3)
    pairs, naive_wrong = [], 0
    for _ in range(10000):
        q = np.float32(rnd.uniform(1, 2) * 2.0 ** rnd.randint(-20, 20))
        mid = (Fraction(float(q)) + Fraction(float(np.nextafter(q, np.float32(np.inf))))) / 2
        b = float(np.float32(rnd.uniform(0.5, 1.0) * 2.0 ** rnd.randint(-30, 30)))
        a = _rn32(mid * Fraction(b))
        pairs.append((a, b))
        naive_wrong += float(np.float32(a) * np.float32(_recip(b))) != float(np.float32(a) / np.float32(b))
    _check(pairs)
    assert naive_wrong > 100     # the correction step is what makes these exact


def test_special_values():
    """Signed zeros keep their sign, NaN stays NaN, infinities and quotients
    past fp32 give inf (saturated to 448 by the cvt), tiny values and huge
    scales take the div.rn path."""
    inf, nan = float("inf"), float("nan")
    pairs = [(0.0, 0.05), (-0.0, 0.05), (nan, 0.05), (inf, 0.05), (-inf, 0.05), (3.0e38, 1e-3), (-3.0e38, 1e-30),
             (1e-35, 1e-30), (-2e-31, 3e-33), (1e-44, 1e-40), (1.0, 3e38), (5e37, 4.2e37), (448.0, 1.0),
             (1.5e-45, 0.5), (2.0 ** -100, 0.7), (2.0 ** -99, 0.7)]
    _check(pairs)
    assert _mirror(-0.0, 0.05, _recip(0.05)) == 0 and math.copysign(1, _mirror(-0.0, 0.05, _recip(0.05))) < 0


def test_ptx_sequence_is_the_mirrored_one():
    """The asm the kernel emits is the sequence ``_mirror`` follows."""
    import inspect

    from flintgen.device import ptx

    src = inspect.getsource(ptx.div_rn_recip)
    order = ["mul.rn.f32 q, $1, $3", "neg.f32 nq, q", "fma.rn.f32 r, nq, $2, $1", "fma.rn.f32 q1, r, $3, q",
             "testp.finite.f32 fin, q", "setp.ne.and.f32 use1, q, 0f00000000, fin", "selp.f32 $0, q1, q, use1",
             "setp.lt.f32 slow, aa, 0f0D800000", "setp.lt.or.f32 slow, $3, 0f01000000, slow",
             "@slow div.rn.f32 $0, $1, $2"]
    pos = [src.index(s) for s in order]
    assert pos == sorted(pos)
