"""Fragment math of the skinny GEMV ``out[n, m] = sum_k W[n, k] x[m, k]`` for
M <= 64 tokens on ``mma.sync.m16n8k16`` (bf16 in, fp32 accumulate).

Provenance: written for flintgen's fused QKV GEMV.

Mapping: weight rows are the MMA's M (16 rows per tile), tokens its N (8):
one MMA covers 8 tokens (an n-tile), a token tile of ``max_m`` tokens takes
``max_m / 8`` n-tiles, each multiplying the same A (weight) fragments with its
own B (activation) fragments into its own accumulators. The K order inside an
MMA is free (it is a sum), so each thread feeds contiguous data: a quad
``t = lane % 4`` covers 64 consecutive k per step, thread ``t`` the 16 values
``[16 t, 16 t + 16)`` of rows ``g, g + 8`` (``g = lane / 4``) and of token
``g`` of each n-tile (token ``8 nt + g``); those 16 values are 4 MMAs of 4
values each::

    MMA k-slot          2t, 2t+1        2t+8, 2t+9
    bf16 weights j      values 4j,4j+1  values 4j+2,4j+3      (words 2j, 2j+1)
    NVFP4 weights j     values v, v+4   values v+1, v+5       (v = 8 (j//2) + 2 (j%2))

The NVFP4 pairing (nibbles i and i+4 of a 32-bit word share a register, see
``nvfp4.e2m1x8_to_bf16x2``) is mirrored on the activations with one ``prmt``
per register. Accumulator ``c`` of a tile and n-tile ``nt``: ``c0, c1`` = row
g, tokens 8 nt + 2t, 8 nt + 2t + 1; ``c2, c3`` = row g+8, same tokens.
"""

from __future__ import annotations

from cutlass import Int64, Uint32

from flintgen.device import ldst, nvfp4, ptx

# prmt selectors: (lo half of a, lo half of b) and (hi half of a, hi half of b)
_LO_LO = 0x5410
_HI_HI = 0x7632


def act_fragments_nvfp4(xw):
    """8 activation words (token g, values 0..15 as bf16 pairs) -> the 8 B
    registers of the 4 MMAs, (b0, b1) of MMA j at 2j, 2j+1."""
    b = []
    for j in range(4):
        lo = xw[4 * (j // 2) + (j % 2)]
        hi = xw[4 * (j // 2) + (j % 2) + 2]
        b.append(ptx.prmt(lo, hi, Uint32(_LO_LO)))
        b.append(ptx.prmt(lo, hi, Uint32(_HI_HI)))
    return b


def dequant_rows_nvfp4(q_g, q_g8, s_bytes_g, s_bytes_g8):
    """Rows g and g+8: 2 packed words each plus their scale bytes -> the 16 A
    registers of the 4 MMAs, (a0, a1, a2, a3) of MMA j at 4j..4j+3."""
    s_g, s_g8 = nvfp4.e4m3x2_to_bf16x2(s_bytes_g, s_bytes_g8)
    pg = list(nvfp4.e2m1x8_to_bf16x2(q_g[0])) + list(nvfp4.e2m1x8_to_bf16x2(q_g[1]))
    pg8 = list(nvfp4.e2m1x8_to_bf16x2(q_g8[0])) + list(nvfp4.e2m1x8_to_bf16x2(q_g8[1]))
    a = []
    for j in range(4):
        i = 4 * (j // 2) + 2 * (j % 2)
        a += [nvfp4.mul_bf16x2(pg[i], s_g), nvfp4.mul_bf16x2(pg8[i], s_g8),
              nvfp4.mul_bf16x2(pg[i + 1], s_g), nvfp4.mul_bf16x2(pg8[i + 1], s_g8)]
    return a


def a_fragments_bf16(w_g, w_g8):
    """Rows g and g+8 as 8 words each (16 bf16) -> the 16 A registers."""
    a = []
    for j in range(4):
        a += [w_g[2 * j], w_g8[2 * j], w_g[2 * j + 1], w_g8[2 * j + 1]]
    return a


def mma4(acc, a, b):
    """The 4 MMAs of one step into ``acc`` (4 Float32), in k order."""
    for j in range(4):
        acc = list(ptx.mma_bf16_16816(acc, a[4 * j:4 * j + 4], b[2 * j], b[2 * j + 1]))
    return acc


# ---------------------------------------------------------------- one warp step
# Trace-time helpers of the main loop (straight-line code, no control flow).
# A step is 64 k; ``tiles`` 16-row MMA tiles; ``row_bytes`` one weight row;
# accumulators ``acc[tile][n_tile]`` (4 Float32 each), activations ``xws[n_tile]``.
def load_weights_nvfp4(weight, weight_scale, row0, s, g, t, pred, *, tiles: int, row_bytes: int,
                       k_steps: int, policy=None):
    """Step ``s`` of rows g, g+8 of every tile: per tile (2 words, 2 words,
    scale byte, scale byte). Zeros where ``pred`` (Int32) is 0 (steps past K).
    ``policy``: the loads' L2 policy (ldst.evict_first_policy) or None."""
    out = []
    for rt in range(tiles):
        r = row0 + rt * 16 + g
        addr = weight.iterator.toint() + Int64(r) * row_bytes + Int64(s * 32 + t * 8)
        sc = weight_scale.iterator.toint() + Int64(nvfp4.scale_row_offset(r, k_steps) + s * 512 + t)
        out.append((
            ldst.ldg_weight_u32x2(addr, pred, policy),
            ldst.ldg_weight_u32x2(addr + 8 * row_bytes, pred, policy),
            ldst.ldg_weight_u8(sc, pred, policy),
            ldst.ldg_weight_u8(sc + 128, pred, policy),   # row + 8: same 32-row group, j + 8
        ))
    return out


def load_weights_bf16(weight, row0, s, g, t, pred, *, tiles: int, row_bytes: int, policy=None):
    """Step ``s`` of rows g, g+8 of every tile: per tile (8 words, 8 words)."""
    out = []
    for rt in range(tiles):
        r = row0 + rt * 16 + g
        addr = weight.iterator.toint() + Int64(r) * row_bytes + Int64(s * 128 + t * 32)
        g0 = list(ldst.ldg_weight_u32x4(addr, pred, policy)) + list(ldst.ldg_weight_u32x4(addr + 16, pred, policy))
        a8 = addr + 8 * row_bytes
        g8 = list(ldst.ldg_weight_u32x4(a8, pred, policy)) + list(ldst.ldg_weight_u32x4(a8 + 16, pred, policy))
        out.append((g0, g8))
    return out


def load_acts(x_row, s):
    """Token g's 16 values of step ``s`` from shared memory (``x_row`` = the
    thread's address at step 0), as 8 bf16x2 words."""
    addr = x_row + s * 128
    return list(ptx.lds_u32x4(addr)) + list(ptx.lds_u32x4(addr + 16))


def dequant(wts):
    """Raw NVFP4 words and scales of one step -> the A registers per tile."""
    return [dequant_rows_nvfp4(*w) for w in wts]


def fold(bufs):
    """XOR of every dequantized register of ``bufs`` (a value a later
    instruction can be made to depend on)."""
    regs = [r for buf in bufs for a in buf for r in a]
    while len(regs) > 1:
        regs += [Uint32(0)] * (-len(regs) % 3)
        regs = [ldst.xor3(*regs[i:i + 3]) for i in range(0, len(regs), 3)]
    return regs[0]


def step_nvfp4(acc, wts, xws):
    """The 4 MMAs of one step for every tile and n-tile (``xws``: each n-tile's
    8 activation words); ``wts`` raw or already dequantized."""
    bs = [act_fragments_nvfp4(xw) for xw in xws]
    a = wts if isinstance(wts[0], list) else dequant(wts)
    return [[mma4(acc[rt][nt], a[rt], b) for nt, b in enumerate(bs)] for rt in range(len(a))]


def step_bf16(acc, wts, xws):
    """The 4 MMAs of one step for every tile and n-tile."""
    return [[mma4(acc[rt][nt], a_fragments_bf16(w_g, w_g8), xw) for nt, xw in enumerate(xws)]
            for rt, (w_g, w_g8) in enumerate(wts)]
