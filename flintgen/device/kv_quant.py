"""fp8 e4m3 KV-cache writes of the fused QKV epilogue (flintgen.device.head_epilogue).

Provenance: written for flintgen's fused QKV GEMV.

A K or V element is stored as ``e4m3(bf16_row / scale)`` with one fp32
``scale`` per layer for K (``k_scale``) and one for V (``v_scale``), as
vLLM keeps them (dequantized value = e4m3 x scale). Bit-exact against torch::

    (row_bf16.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)

* ``row_bf16`` is the bf16-rounded value the bf16 path stores (converting a
  bf16 to fp32 is exact);
* the division is ``div.rn.f32`` (IEEE, round to nearest even, subnormals
  kept), what torch's fp32 ``/`` computes; a multiply by ``1 / scale``
  rounds twice and differs in the last place;
* ``cvt.rn.satfinite.e4m3x2.f32`` rounds to nearest even and saturates to
  +-448 (= the clamp, then torch's RNE cast, which maps [-448, 448] exactly
  as the cvt does), NaN stays NaN (torch: 0x7f / 0xff; the cvt: a NaN
  code, sign not guaranteed). Infinities saturate as the clamp does.

A lane's runs of E = 1, 2, 4 or 8 consecutive elements
(flintgen.configs.qkv_config.EpilogueLanes) become one E-byte store; runs
start at multiples of E elements and the cache rows at multiples of 16
bytes (strides checked on the host), so every store is aligned.
"""

from __future__ import annotations

from cutlass import Float32

from flintgen.device import ptx


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


def e4m3_run(vals, scale):
    """Quantize Float32 ``vals`` (a run of 1, 2, 4 or 8) to e4m3 of
    ``vals / scale``: words holding the bytes in memory order (element i in
    byte i % 4 of word i // 4; a run of 1 or 2 in the low bytes of one word)."""
    e = len(vals)
    _run_len(e)
    q = [ptx.div_rn(v, scale) for v in vals]
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

