"""The fp8 K/V write's quotient on the CPU (flintgen.device.kv_quant): proof
that the reciprocal-based sequence gives torch's e4m3 byte bit for bit.

The kernel divides a bf16 value x by the layer's scale s with
``kv_quant.RECIP_PTX`` (r = rcp.rn(s) once per thread, 0 outside the safe
range) and per element ``kv_quant.FAST_QUOTIENT_PTX`` where r != 0, else
``div.rn.f32``, then cvt.rn.satfinite to e4m3. Here those PTX texts are run
by a small interpreter (``run_ptx``) in which every instruction is IEEE fp32
with one rounding, subnormals kept:

* ``mul.rn`` is the float64 product (exact: 24 x 24 bits) cast to fp32;
* ``fma.rn`` is the float64 product plus the addend with the error term of
  TwoSum (so ``hi + lo`` is the exact sum), rounded to odd at 53 bits, then
  cast to fp32: rounding to odd at >= p + 2 bits and then to nearest at p
  bits is rounding to nearest once (Boldo & Melquiond 2008);
* ``rcp.rn`` / ``div.rn`` are numpy's fp32 division (IEEE);

``round_to_f32`` rounds a Fraction to fp32 in exact integer arithmetic (ties
to even, subnormals, overflow to inf) and ``fma_ref`` is the exact fma built
on it; both are checked here, and the vectorized instructions against them.
The e4m3 byte of a quotient is torch's ``clamp(-448, 448).to(float8_e4m3fn)``
(= the cvt, as kv_quant's docstring says), the reference torch's fp32
division: ``(x / scale).clamp(-448, 448).to(torch.float8_e4m3fn)``.

What is checked:

* every one of the 65536 bf16 patterns (+-0, subnormals, inf, NaN included)
  for ~370 scales: 1, the test suite's, ones where the correction step
  changes bytes, powers of two, all-ones mantissas,
  the ends of the safe range and their neighbours, log-uniform random ones
  across it, and scales outside it (tiny, huge, subnormal, 0, inf, NaN,
  negative: the div.rn copy must be taken there);
* the fast path's core claim, ``q1 = RN(x / s)``, for x and s in [1, 2):
  the 128 bf16 mantissas of x against all 2^23 fp32 mantissas of s when
  FLINTGEN_DIV_EXHAUSTIVE=1 (2^30 pairs, a few minutes), else 4 of them
  (kv_quant's docstring extends it to all exponents);
* mutations (no correction step, no -0 select, no saturation select, a safe
  range wider than kv_quant's) make these checks fail.
"""

from __future__ import annotations

import math
import os
import random
from fractions import Fraction

import numpy as np
import pytest
import torch

from flintgen.device import kv_quant

F32 = np.float32


# ================================================================ exact fp32 rounding
def round_to_f32(v: Fraction, *, zero_sign: float = 1.0) -> F32:
    """The fp32 nearest to the rational ``v`` (ties to even), with subnormals
    and overflow to inf, in exact integer arithmetic. A result of zero gets
    ``v``'s sign (``zero_sign`` for ``v == 0``)."""
    if v == 0:
        return F32(math.copysign(0.0, zero_sign))
    neg = v < 0
    n, d = abs(v.numerator), v.denominator
    e = n.bit_length() - d.bit_length()          # 2^(e-1) < |v| < 2^(e+1)
    if (n << max(0, -e)) < (d << max(0, e)):
        e -= 1                                   # now 2^e <= |v| < 2^(e+1)
    k = max(e - 23, -149)                        # the quantum at |v|: 24 bits, or the subnormal one
    num, den = (n << -k, d) if k < 0 else (n, d << k)
    q, r = divmod(num, den)
    if 2 * r > den or (2 * r == den and q & 1):
        q += 1
    mag = Fraction(q) * Fraction(2) ** k
    if mag >= 2**128:
        return F32(-np.inf if neg else np.inf)
    return F32(-float(mag) if neg else float(mag))   # exact: q < 2^25, -149 <= k <= 104


def fma_ref(a, b, c) -> F32:
    """fp32 fma(a, b, c) = RN(a b + c), rounded once (exact rationals)."""
    a, b, c = float(a), float(b), float(c)
    if not all(map(math.isfinite, (a, b, c))):
        with np.errstate(all="ignore"):
            return F32(a * b + c)                # infinities and NaN as IEEE says (exact in float64)
    prod = Fraction(a) * Fraction(b)
    exact = prod + Fraction(c)
    if exact == 0:   # IEEE 754 6.3: -0 only for (-0) + (-0); an exact cancellation is +0
        neg = prod == 0 and c == 0 and math.copysign(1, a) * math.copysign(1, b) < 0 and math.copysign(1, c) < 0
        return F32(-0.0 if neg else 0.0)
    return round_to_f32(exact)


def _to_f32(v):
    """float64 -> fp32, RN (overflow to inf, no warning)."""
    with np.errstate(over="ignore"):
        return np.asarray(v, dtype=np.float64).astype(F32)


def _f64(v):
    return np.asarray(v, dtype=F32).astype(np.float64)


def mul32(a, b):
    """mul.rn.f32, vectorized: the float64 product is exact."""
    with np.errstate(all="ignore"):
        return (_f64(a) * _f64(b)).astype(F32)


def fma32(a, b, c):
    """fma.rn.f32, vectorized and exact (see the module docstring)."""
    with np.errstate(all="ignore"):
        p = _f64(a) * _f64(b)                    # exact
        c = _f64(c)
        s = p + c
        bb = s - p                               # TwoSum: s + t = p + c exactly
        t = (p - (s - bb)) + (c - bb)
        odd = (s.view(np.uint64) & 1) == 1
        fix = np.isfinite(s) & (t != 0) & ~odd   # round to odd: step toward the exact sum
        s = np.where(fix, np.nextafter(s, np.where(t > 0, np.inf, -np.inf)), s)
        return s.astype(F32)


def div32(a, b):
    with np.errstate(all="ignore"):
        return np.asarray(a, dtype=F32) / np.asarray(b, dtype=F32)


def bits(v) -> np.ndarray:
    return np.asarray(v, dtype=F32).view(np.uint32)


def same_f32(a, b) -> np.ndarray:
    """Bit-equal, or both NaN."""
    a, b = np.asarray(a, dtype=F32), np.asarray(b, dtype=F32)
    return (bits(a) == bits(b)) | (np.isnan(a) & np.isnan(b))


# ================================================================ the PTX interpreter
def _fimm(tok: str) -> F32:
    return np.array([int(tok[2:], 16)], dtype=np.uint32).view(F32)[0]


VECTOR_OPS = {"mul.rn.f32": mul32, "fma.rn.f32": fma32, "rcp.rn.f32": lambda a: div32(F32(1.0), a),
              "div.rn.f32": div32, "neg.f32": lambda a: -np.asarray(a, dtype=F32),
              "abs.f32": lambda a: np.abs(np.asarray(a, dtype=F32))}


def _scalar(fn):
    def run(*args):
        args = np.broadcast_arrays(*[np.asarray(a, dtype=F32) for a in args])
        return np.array([fn(*vals) for vals in zip(*(a.ravel() for a in args))], dtype=F32).reshape(args[0].shape)
    return run


# the same instructions, each element through exact rationals: the reference the vector ops must equal
def div_ref(a, b) -> F32:
    """fp32 a / b rounded once (exact rationals; zeros, infinities and NaN as IEEE says)."""
    a, b = float(a), float(b)
    if not (math.isfinite(a) and math.isfinite(b)) or b == 0:
        return div32(F32(a), F32(b))             # 0 / 0, x / 0, inf / x, ...: no rounding involved
    return round_to_f32(Fraction(a) / Fraction(b), zero_sign=math.copysign(1, a) * math.copysign(1, b))


REF_OPS = dict(VECTOR_OPS, **{
    "mul.rn.f32": _scalar(lambda a, b: fma_ref(a, b, -0.0)),     # a b + (-0) = a b, zeros' signs kept
    "fma.rn.f32": _scalar(fma_ref),
    "rcp.rn.f32": _scalar(lambda a: div_ref(1.0, a)),
    "div.rn.f32": _scalar(div_ref),
})


def run_ptx(text: str, args: dict, ops=VECTOR_OPS) -> dict:
    """Run an inline-asm text on numpy arrays: ``args`` maps operand numbers
    (``$1``) to fp32 arrays; returns every register (``$0`` included). Knows
    only the instructions kv_quant uses: anything else is an error."""
    regs: dict = {f"${k}": np.asarray(v, dtype=F32) for k, v in args.items()}

    def val(tok):
        if tok.startswith("0f"):
            return _fimm(tok)
        return regs[tok]

    for stmt in text.replace("{", " ").replace("}", " ").split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, _, rest = stmt.partition(" ")
        dst, *src = [t.strip() for t in rest.split(",")]
        if op in ops:
            regs[dst] = ops[op](*[val(t) for t in src])
        elif op.startswith("setp.") and op.endswith(".f32"):
            cmp, *comb = op.split(".")[1:-1]
            a, b = val(src[0]), val(src[1])
            p = {"ge": np.greater_equal, "le": np.less_equal, "eq": np.equal}[cmp](a, b)   # NaN: false
            if comb:
                p = {"and": np.logical_and, "or": np.logical_or}[comb[0]](p, regs[src[2]])
            regs[dst] = p
        elif op == "selp.f32":
            regs[dst] = np.where(regs[src[2]], val(src[0]), val(src[1])).astype(F32)
        else:
            raise AssertionError(f"run_ptx: unknown instruction {stmt!r}")
    return regs


# ================================================================ the kernel's quotient
ALL_BF16 = (np.arange(1 << 16, dtype=np.uint32) << 16).view(F32)   # every bf16 pattern, as fp32


def kernel_quotient(x, scale: float, recip_ptx=kv_quant.RECIP_PTX, quotient_ptx=kv_quant.FAST_QUOTIENT_PTX,
                    ops=VECTOR_OPS):
    """(the quotients the epilogue feeds the cvt, whether the fast copy ran):
    ``Scale.of`` then ``kv_quant.quotient`` with ``fast = Scale.fast()``."""
    s = F32(scale)
    r = run_ptx(recip_ptx, {1: s}, ops)["$0"]
    if r != 0:
        return run_ptx(quotient_ptx, {1: x, 2: s, 3: r}, ops)["$0"], True
    return ops["div.rn.f32"](x, s), False


def e4m3(q) -> np.ndarray:
    """The cvt.rn.satfinite.e4m3 byte of fp32 ``q`` (clamp, then torch's RNE cast)."""
    return torch.from_numpy(np.ascontiguousarray(q, dtype=F32)).clamp(-448, 448).to(torch.float8_e4m3fn) \
        .view(torch.uint8).numpy()


def torch_ref(x, scale: float) -> np.ndarray:
    """The formula the cache must match, torch's fp32 division included."""
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=F32)) / torch.tensor([scale], dtype=torch.float32)
    return t.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def byte_mismatches(got, want) -> np.ndarray:
    """Positions where the bytes differ; a NaN need only be a NaN (0x7f / 0xff)."""
    g_nan, w_nan = (got & 0x7F) == 0x7F, (want & 0x7F) == 0x7F
    return (g_nan != w_nan) | (~w_nan & (got != want))


def _f32s(vals) -> list[float]:
    return [float(F32(v)) for v in vals]


def _next(v, toward):
    with np.errstate(over="ignore"):
        return float(np.nextafter(F32(v), F32(toward)))


LO, HI = kv_quant.SAFE_LO, kv_quant.SAFE_HI
ONES = 2.0 - 2.0**-23                                             # the all-ones mantissa
SCALES_USED = [1.0, 0.05, 0.02, 0.015625, 0.3, 7.0, 3.0, 1e-3, 300.0, 1e3, 0.5, 0.1]
# scales where q0 alone gives other bytes for some bf16 x (found by search: rare, about 1 in
# 10^4 random mantissas; 7, 13, 15, 61 of the odd integers below 256)
SCALES_HARD = [m * 2.0**k for m in (7.0, 13.0, 15.0, 61.0, float(F32(1.065))) for k in (-40, -7, 0, 9, 40)]
_rnd = random.Random(20261202)
SCALES_IN = _f32s(
    SCALES_USED + SCALES_HARD
    + [2.0**k for k in range(-64, 65, 2)]
    + [ONES * 2.0**k for k in range(-64, 64, 3)] + [ONES * 2.0**63]
    + [_next(LO, 1), _next(HI, 0), LO * 1.5, HI * 0.75, LO * 3.0, HI / 3.0]
    + [2.0 ** _rnd.uniform(-64, 64) for _ in range(120)]          # log-uniform over the safe range
    + [_rnd.uniform(0.25, 4.0) * 10.0 ** _rnd.randint(-3, 3) for _ in range(60)]   # typical k/v scales
    + [(1 + _rnd.getrandbits(23) * 2.0**-23) * 2.0 ** _rnd.randint(-8, 8) for _ in range(40)]
)
SCALES_OUT = _f32s([_next(LO, 0), _next(HI, math.inf), LO / 2, HI * 2, 1.37 * 2.0**-100, 2.0**-100, 1e-30,
                    1.7e-38, 1e-40, 1e-45, 1.7 * 2.0**100, 1e30, 3e38, 0.0, -0.0, -0.05, -1.0, math.inf,
                    -math.inf, math.nan])


def check_scales(scales, *, expect_fast, **kw) -> dict:
    """Every bf16 pattern divided by each scale: the kernel's bytes against
    torch's; returns counters (mismatches stop at the first scale)."""
    stats = {"scales": 0, "q0_would_differ": 0, "neg_zero": 0}
    for s in scales:
        q, fast = kernel_quotient(ALL_BF16, s, **kw)
        assert fast == expect_fast, f"scale {s!r}: fast copy {'not ' if expect_fast else ''}taken"
        got, want = e4m3(q), torch_ref(ALL_BF16, s)
        bad = byte_mismatches(got, want)
        if bad.any():
            i = np.flatnonzero(bad)[:4]
            raise AssertionError(f"scale {s!r}: {int(bad.sum())} of 65536 bytes differ, e.g. x = "
                                 f"{ALL_BF16[i].tolist()}: got {got[i].tolist()}, torch {want[i].tolist()}")
        stats["scales"] += 1
        stats["neg_zero"] += int((want == 0x80).sum())
        if fast:
            q0 = mul32(ALL_BF16, run_ptx(kw.get("recip_ptx", kv_quant.RECIP_PTX), {1: F32(s)})["$0"])
            stats["q0_would_differ"] += int(byte_mismatches(e4m3(q0), want).sum())
    return stats


# ================================================================ the rounding helpers
def test_round_to_f32_by_hand():
    t = Fraction(2) ** -24
    fmax = float(np.finfo(F32).max)
    cases = [
        (1 + t, 1.0), (1 + 3 * t, 1 + 4 * t), (1 + t + Fraction(1, 2**60), 1 + 2 * t),   # ties to even, just past
        (-(1 + t), -1.0), (Fraction(1, 3), float(F32(1) / F32(3))), (Fraction(-7, 10), float(F32(-0.7))),
        (Fraction(2) ** -150, 0.0), (3 * Fraction(2) ** -150, 2.0**-148), (Fraction(2) ** -149, 2.0**-149),
        (Fraction(2) ** -150 + Fraction(2) ** -200, 2.0**-149), (Fraction(2) ** -126 - Fraction(2) ** -150, 2.0**-126),
        (Fraction(2) ** -126 - 3 * Fraction(2) ** -151, 2.0**-126 - 2.0**-149),
        (Fraction(fmax), fmax), (Fraction(fmax) + Fraction(2) ** 103, math.inf),          # the overflow tie
        (Fraction(fmax) + Fraction(2) ** 103 - Fraction(2) ** -60, fmax), (Fraction(2) ** 130, math.inf),
        (-Fraction(2) ** 130, -math.inf),
    ]
    for v, want in cases:
        got = round_to_f32(Fraction(v))
        assert same_f32(got, F32(want)), (v, got, want)
    neg_tiny = round_to_f32(-Fraction(2) ** -151)
    assert neg_tiny == 0 and math.copysign(1, neg_tiny) < 0
    assert math.copysign(1, round_to_f32(Fraction(0), zero_sign=-1)) < 0


def test_round_to_f32_matches_numpy_casts_and_division():
    """Against two independent IEEE implementations: float64 -> fp32 casts
    (any float64 is an exact rational) and fp32 division of random pairs."""
    rnd = random.Random(1)
    d = [rnd.uniform(-2, 2) * 2.0 ** rnd.randint(-160, 130) for _ in range(20000)]
    d += [float(F32(v)) * (1 + 2.0**-24) for v in d[:3000] if abs(v) < 2.0**127]      # exact fp32 midpoints
    d += [(rnd.randrange(1 << 23) + 0.5) * 2.0**-149 * rnd.choice([1, -1]) for _ in range(2000)]  # subnormal ties
    with np.errstate(over="ignore"):
        want = np.array(d).astype(F32)
    got = np.array([round_to_f32(Fraction(v), zero_sign=math.copysign(1, v)) for v in d], dtype=F32)
    assert same_f32(got, want).all()
    a = np.array([rnd.uniform(-2, 2) * 2.0 ** rnd.randint(-100, 100) for _ in range(5000)], dtype=F32)
    b = np.array([rnd.uniform(0.5, 2) * 2.0 ** rnd.randint(-60, 60) for _ in range(5000)], dtype=F32)
    got = np.array([round_to_f32(Fraction(float(x)) / Fraction(float(y))) for x, y in zip(a, b)], dtype=F32)
    assert same_f32(got, div32(a, b)).all()


def _fma_cases(n: int, seed: int):
    """Random fma operands over wide exponents, plus the hard ones: c near
    -a b (cancellation, exact zeros), a b + c near fp32 midpoints (and just
    off one, where a float64 sum rounds onto it), subnormal results, signed
    zeros and specials."""
    rnd = random.Random(seed)
    f = lambda lo, hi: float(_to_f32(rnd.uniform(-2, 2) * 2.0 ** rnd.randint(lo, hi)))   # noqa: E731
    sign = lambda: rnd.choice([1.0, -1.0])   # noqa: E731
    a, b, c = [], [], []
    for _ in range(n):
        x, y = f(-80, 80), f(-80, 80)
        kind = rnd.randrange(6)
        if kind == 0:
            z = f(-170, 170)
        elif kind == 1:      # cancellation: c = -RN(x y) (+- ulps)
            z = float(-mul32(x, y))
            for _ in range(rnd.randrange(3)):
                z = _next(z, rnd.choice([math.inf, -math.inf]))
        elif kind == 2:      # x y + z near a midpoint of the result's binade
            m = Fraction(float(F32(rnd.uniform(1, 2)) * 2.0 ** rnd.randint(-140, 100)))
            mid = m + Fraction(2) ** (math.frexp(float(m))[1] - 25)
            z = float(round_to_f32(mid - Fraction(x) * Fraction(y)))
        elif kind == 3:      # x y = (1 - 2^-46) half an ulp of z: just off the midpoint
            z = float(F32(rnd.uniform(1, 2) * 2.0 ** rnd.randint(-100, 100)))
            x = float(F32(1 + 2.0**-23)) * sign()
            y = float(F32(1 - 2.0**-23)) * 2.0 ** (math.frexp(z)[1] - 25) * math.copysign(1, x)
            z *= sign()
        elif kind == 4:      # subnormal results
            x, y = f(-75, -60), f(-75, -60)
            z = float(F32(rnd.uniform(-1, 1) * 2.0**-126))
        else:
            z = f(-40, 40)
        a.append(x)
        b.append(y)
        c.append(z)
    sp = [0.0, -0.0, math.inf, -math.inf, math.nan, 1.0, -1.0, 2.0**-149, float(np.finfo(F32).max)]
    for x in sp:
        for y in sp:
            for z in sp:
                a.append(x)
                b.append(y)
                c.append(z)
    return np.array(a, dtype=F32), np.array(b, dtype=F32), np.array(c, dtype=F32)


def test_fma_ref_against_float64_where_it_is_exact():
    """fma_ref = the float64 evaluation wherever that has no rounding to
    double (the product and the sum exact in float64)."""
    a, b, c = _fma_cases(6000, 2)
    ok = 0
    for x, y, z in zip(a.tolist(), b.tolist(), c.tolist()):
        with np.errstate(all="ignore"):
            s = x * y + z
        if all(map(math.isfinite, (x, y, z))) and Fraction(x) * Fraction(y) + Fraction(z) == Fraction(s):
            assert same_f32(fma_ref(x, y, z), _to_f32(s)), (x, y, z)
            ok += 1
    assert ok > 1000


def test_vectorized_fma_matches_exact_rationals():
    a, b, c = _fma_cases(30000, 3)
    got, want = fma32(a, b, c), REF_OPS["fma.rn.f32"](a, b, c)
    bad = ~same_f32(got, want)
    assert not bad.any(), list(zip(a[bad][:3], b[bad][:3], c[bad][:3]))
    # the hard cases are there: results that a float64 fma (rounded twice) gets wrong
    with np.errstate(all="ignore"):
        twice = (_f64(a) * _f64(b) + _f64(c)).astype(F32)
    assert (~same_f32(twice, want)).sum() >= 20


def test_interpreter_vector_ops_equal_the_exact_ones_on_the_real_sequence():
    """The kernel's two PTX texts, run with the vector ops and with exact
    rationals per element: the same registers, on random, near-tie and
    special operands."""
    rnd = random.Random(4)
    x = ALL_BF16[np.array([rnd.randrange(1 << 16) for _ in range(1500)])]
    for s in _f32s([0.3, 7.0, 0.05, ONES * 2.0**-30, _next(LO, 1), HI / 3, 1e-30, 0.0, math.nan]):
        r_vec = run_ptx(kv_quant.RECIP_PTX, {1: F32(s)})
        r_ref = run_ptx(kv_quant.RECIP_PTX, {1: F32(s)}, REF_OPS)
        assert same_f32(r_vec["$0"], r_ref["$0"]), s
        if r_vec["$0"] == 0:
            assert same_f32(div32(x, F32(s)), REF_OPS["div.rn.f32"](x, F32(s))).all(), s
            continue
        args = {1: x, 2: F32(s), 3: r_vec["$0"]}
        v, ref = run_ptx(kv_quant.FAST_QUOTIENT_PTX, args), run_ptx(kv_quant.FAST_QUOTIENT_PTX, args, REF_OPS)
        for name in ("q0", "e", "q1", "$0"):
            assert same_f32(v[name], ref[name]).all(), (s, name)


def test_interpreter_knows_only_the_real_instructions():
    with pytest.raises(AssertionError, match="unknown instruction"):
        run_ptx("{ add.rn.f32 $0, $1, $1; }", {1: F32(1)})


# ================================================================ the proof
def test_every_bf16_value_for_scales_in_the_safe_range():
    """All 65536 bf16 patterns / each scale in [2^-64, 2^64]: the fast copy,
    torch's bytes. It is not vacuous: q0 alone (no correction) gives other
    bytes, and -0 is in the table."""
    st = check_scales(SCALES_IN, expect_fast=True)
    assert st["scales"] == len(SCALES_IN) >= 300
    assert st["q0_would_differ"] > 300, st
    assert st["neg_zero"] > 0


def test_every_bf16_value_for_scales_outside_it_takes_div_rn():
    st = check_scales(SCALES_OUT, expect_fast=False)
    assert st["scales"] == len(SCALES_OUT)


def _canonical_pairs(xm: float, s: np.ndarray):
    """For x = xm (a bf16 in [1, 2)) and every s: the sequence's registers,
    whether q is RN(x / s) and whether the remainder e is exact."""
    x = np.full(s.shape, xm, dtype=F32)
    r = div32(F32(1.0), s)                       # = RECIP_PTX's (s in [1, 2) is in range)
    regs = run_ptx(kv_quant.FAST_QUOTIENT_PTX, {1: x, 2: s, 3: r})
    e_exact = _f64(x) - _f64(regs["q0"]) * _f64(s)   # exact: q0 s within a factor 2 of x (Sterbenz)
    return regs, same_f32(regs["$0"], div32(x, s)), _f64(regs["e"]) == e_exact


MANTISSAS_X = [1 + k / 128 for k in range(128)]
MANTISSAS_X_CI = [1.0, 1 + 1 / 128, 1.5078125, 2 - 1 / 128]   # 1.5078125: inexact remainders


def test_mantissa_pairs_q1_is_the_correctly_rounded_quotient():
    """x in [1, 2) bf16, s in [1, 2) fp32 (all 2^23): q1 = RN(x / s) for
    every pair. FLINTGEN_DIV_EXHAUSTIVE=1 runs all 128 x mantissas (the
    complete proof, minutes), else ``MANTISSAS_X_CI``. q0 (up to ~1.5 ulp
    off x / s) is not always faithful, so the remainder is not always exact
    (Markstein's premise): q1 is right all the same, which is what counts."""
    s = ((np.arange(1 << 23, dtype=np.uint32)) | np.uint32(0x3F800000)).view(F32)
    xms = MANTISSAS_X if os.environ.get("FLINTGEN_DIV_EXHAUSTIVE") == "1" else MANTISSAS_X_CI
    corrected = inexact = 0
    for xm in xms:
        for part in np.array_split(s, 4):
            regs, ok, exact = _canonical_pairs(xm, part)
            assert ok.all(), f"x = {xm}: q != RN(x / s) for s = {part[~ok][:4].tolist()}"
            assert not ((np.abs(regs["q0"]) >= 512) | (regs["q0"] == 0)).any()   # q is q1 here
            corrected += int((~same_f32(regs["q0"], regs["$0"])).sum())
            inexact += int((~exact).sum())
    assert corrected > len(xms) << 18   # q0 alone is wrong for a good share of the pairs
    if xms is MANTISSAS_X_CI:
        assert inexact > 0              # the premise fails for some pairs: covered, not assumed


# ================================================================ mutations: the checks can fail
def _mutate(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


def _mutants() -> dict:
    q, r = kv_quant.FAST_QUOTIENT_PTX, kv_quant.RECIP_PTX
    return {
        "no correction": dict(quotient_ptx=_mutate(q, "selp.f32 $0, q0, q1, keep", "selp.f32 $0, q0, q0, keep")),
        "no -0 select": dict(quotient_ptx=_mutate(q, "setp.eq.or.f32 keep, q0, 0f00000000, keep;", "")),
        "no saturation select": dict(quotient_ptx=_mutate(_mutate(q, "setp.ge.f32 keep, a, 0f44000000;\n", ""),
                                                          "setp.eq.or.f32 keep, q0, 0f00000000, keep;",
                                                          "setp.eq.f32 keep, q0, 0f00000000;")),
        "safe range from 2^-100": dict(recip_ptx=_mutate(r, "0f1F800000", "0f0D800000")),
    }


MUTANT_SCALES = {"no correction": [7.0, 0.3], "no -0 select": [0.05], "no saturation select": [0.05],
                 "safe range from 2^-100": _f32s([1.37 * 2.0**-100, 1.11 * 2.0**-97, ONES * 2.0**-95])}


@pytest.mark.parametrize("name", list(MUTANT_SCALES))
def test_mutants_fail(name):
    """Each mutant of kv_quant's PTX gives other bytes than torch for some
    bf16 value (the last: a safe range reaching 2^-100)."""
    with pytest.raises(AssertionError, match="bytes differ"):
        check_scales(MUTANT_SCALES[name], expect_fast=True, **_mutants()[name])
