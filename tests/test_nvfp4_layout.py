"""NVFP4 weights on the CPU (flintgen.quant): a hand-built 2 x 64 matrix
dequantized to hand-computed values, the swizzled scale layout's positions and
padding, the quantizer's error bound and e2m1 ties to even, and a Python model
of the register dequantization's bit tricks (flintgen.device.nvfp4). The GPU
check of the same hand-built matrix through the kernel is in tests/test_qkv.py
(test_nvfp4_dequant_is_exact_one_hot).
"""

from __future__ import annotations

import struct

import torch

from flintgen import quant


def _f32(bits16: int) -> float:
    """Value of a bf16 bit pattern (Python float, subnormals included)."""
    return struct.unpack("<f", struct.pack("<I", (bits16 & 0xFFFF) << 16))[0]


# ============================================================== NVFP4 layout (CPU)
# A hand-built 2 x 64 NVFP4 matrix: rows 0 and 1, 4 scale blocks each.
# e2m1 codes: 0x1 = 0.5 (subnormal), 0x7 = 6, 0x9 = -0.5, 0xF = -6, 0x3 = 1.5, 0xA = -1.
# e4m3 scales: 0x38 = 1.0, 0x40 = 2.0, 0x01 = 2^-9 (subnormal), 0x7E = 448.
HAND_SCALES = [[0x38, 0x40, 0x01, 0x7E], [0x7E, 0x01, 0x40, 0x38]]
HAND_GS = 0.5


def _hand_codes():
    """[2, 64] codes: block b of row r repeats a pattern of 16 codes."""
    pats = [[0x1, 0x7, 0x9, 0xF, 0x3, 0xA, 0x0, 0x8] * 2,
            [0x2, 0x4, 0x5, 0x6, 0xC, 0xD, 0xE, 0xB] * 2]
    rows = []
    for r in range(2):
        row = []
        for b in range(4):
            row += pats[(r + b) % 2]
        rows.append(row)
    return torch.tensor(rows, dtype=torch.uint8)


def _hand_expected():
    """Worked out by hand: e2m1 value x e4m3 scale x 0.5 for every element."""
    e2m1 = {0x0: 0.0, 0x1: 0.5, 0x2: 1.0, 0x3: 1.5, 0x4: 2.0, 0x5: 3.0, 0x6: 4.0, 0x7: 6.0,
            0x8: -0.0, 0x9: -0.5, 0xA: -1.0, 0xB: -1.5, 0xC: -2.0, 0xD: -3.0, 0xE: -4.0, 0xF: -6.0}
    e4m3 = {0x38: 1.0, 0x40: 2.0, 0x01: 2.0 ** -9, 0x7E: 448.0}
    codes = _hand_codes()
    out = torch.empty(2, 64, dtype=torch.float64)
    for r in range(2):
        for k in range(64):
            out[r, k] = e2m1[int(codes[r, k])] * e4m3[HAND_SCALES[r][k // 16]] * HAND_GS
    return out


def _hand_nvfp4():
    codes = _hand_codes()
    packed = quant.pack_nibbles(codes)
    scales = torch.tensor(HAND_SCALES, dtype=torch.uint8).view(torch.float8_e4m3fn)
    return packed, quant.swizzle_scales(scales)


def test_hand_built_nvfp4_dequantizes_to_hand_values():
    packed, sw = _hand_nvfp4()
    # even k in the low nibble: byte 0 of row 0 holds codes k=0 (0x1) and k=1 (0x7)
    assert packed[0, 0].item() == 0x71 and packed[0, 1].item() == 0xF9
    assert tuple(sw.shape) == (128, 4)   # 2 rows padded to 128, 4 columns (no column padding)
    got = quant.dequantize_nvfp4(packed, sw, torch.tensor(HAND_GS), dtype=torch.float64)
    exp = _hand_expected()
    assert torch.equal(got, exp)
    # a few by hand (code value x scale x 0.5):
    assert exp[0, 0] == 0.5 * 1.0 * 0.5            # 0x1 in block 0 of row 0 (scale 0x38 = 1)
    assert exp[0, 3] == -6.0 * 1.0 * 0.5           # 0xF
    assert exp[1, 3] == 4.0 * 448.0 * 0.5 == 896   # row 1, block 0: 0x6, scale 0x7E = 448
    assert exp[0, 32] == 0.5 * 2.0 ** -9 * 0.5     # subnormal code x subnormal scale 0x01
    assert exp[1, 17] == 6.0 * 2.0 ** -9 * 0.5     # row 1, block 1: 0x7, scale 0x01
    assert exp[0, 61] == -3.0 * 448.0 * 0.5        # row 0, block 3: 0xD, scale 0x7E


def test_swizzle_layout_positions_and_padding():
    n, k = 200, 80                      # 200 rows -> 256; 5 scale columns -> 8
    lin = torch.arange(n * (k // 16), dtype=torch.int32).remainder(251).add(1).to(torch.uint8).view(n, k // 16)
    sw = quant.swizzle_scales(lin)
    assert tuple(sw.shape) == (256, 8)
    flat = sw.flatten()
    for r in (0, 1, 8, 31, 32, 100, 127, 128, 199):
        for c in range(k // 16):
            assert flat[quant.scale_offset(r, c, 8)] == lin[r, c], (r, c)
    assert int(sw.sum()) == int(lin.to(torch.int64).sum())      # padding is zero
    assert torch.equal(quant.unswizzle_scales(sw, n, k), lin)
    # row r and r + 8 of one 32-row group are 128 bytes apart (the kernel relies on it)
    assert quant.scale_offset(8, 1, 8) - quant.scale_offset(0, 1, 8) == 128


def test_quantizer_roundtrip_error_bound():
    torch.manual_seed(0)
    w = torch.randn(256, 128) * 0.02
    w[3] *= 3e-5                        # tiny rows: subnormal e4m3 scales
    packed, sw, gs = quant.quantize_nvfp4(w)
    deq = quant.dequantize_nvfp4(packed, sw, gs, dtype=torch.float64)
    sc = quant.unswizzle_scales(sw, 256, 128).float().double() * float(gs)
    step = sc.repeat_interleave(16, dim=1) * 2          # widest e2m1 gap is 2 (4 -> 6)
    assert ((deq - w.double()).abs() <= step / 2 + 1e-12).all()
    assert (quant.unswizzle_scales(sw, 256, 128).view(torch.uint8)[3] < 8).any()   # subnormal scales occur
    codes = quant.unpack_nibbles(packed)
    assert torch.equal(quant.e2m1_encode(quant.e2m1_decode(codes)) & 7, codes & 7)


def test_e2m1_encode_ties_to_even():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.75, -0.1])
    assert quant.e2m1_decode(quant.e2m1_encode(x)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0,
                                                                -1.0, -0.0]


def _pattern_model(q: int):
    """Python model of nvfp4.e2m1x8_to_bf16x2 (same constants as the PTX)."""
    h = q >> 8
    out = []
    for src, mask, mul in ((q, 0x000F000F, 4160), (q, 0x00F000F0, 260), (h, 0x000F000F, 4160),
                           (h, 0x00F000F0, 260)):
        out.append((((src & mask) * mul) & 0xFFFFFFFF) & 0x81C081C0)
    return out


def test_register_dequant_model_is_exact():
    """The bit tricks of flintgen.device.nvfp4, modelled on the CPU: patterns
    are 2^-126 e2m1, bf16(e4m3 * 2^118) is exact, and their product e2m1 *
    e4m3 * 2^-8 is a bf16 normal (so HMUL2's rounding is exact)."""
    e2m1 = [float(v) for v in quant.e2m1_decode(torch.arange(16, dtype=torch.uint8))]
    words = [sum(((i + j) % 16) << (4 * j) for j in range(8)) for i in range(16)]
    for q in words:
        regs = _pattern_model(q)
        for i in range(4):
            assert _f32(regs[i]) == 2.0 ** -126 * e2m1[(q >> 4 * i) & 15]
            assert _f32(regs[i] >> 16) == 2.0 ** -126 * e2m1[(q >> 4 * (i + 4)) & 15]
    codes = torch.arange(256, dtype=torch.uint8)
    fin = codes[(codes & 0x7F) != 0x7F]                      # 0x7F / 0xFF are NaN
    s = fin.view(torch.float8_e4m3fn).double()
    s118 = s * 2.0 ** 118
    assert torch.equal(s118.float().bfloat16().double(), s118)              # exact in bf16
    for v in e2m1[:8]:
        prod = v * s * 2.0 ** -8
        nz = prod != 0
        assert torch.equal(prod.float().bfloat16().double(), prod)          # exact product
        assert (prod[nz].abs() >= 2.0 ** -126).all()                        # never subnormal
