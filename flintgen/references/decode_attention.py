"""References for paged decode attention with sinks (cute-free, torch only).

* ``decode_attention_ref``: fp64, the sink appended as an extra softmax
  column and dropped after the softmax (FlashInfer's sink oracle).
* ``decode_attention_seed_rounding``: what a careful single-pass torch
  implementation with the kernel's roundings gives: S in fp32 from bf16 q, K;
  p = exp2(S c - m c) in fp32 with c = scale log2 e; l = sum(p) + exp2(sink
  log2 e - m c); O = (bf16(p) @ V) / l in fp32, rounded to bf16. The kernel's
  error must stay within 2x of this one's. Soft-capped: S <- cap tanh(S scale
  / cap) in fp32 (torch's tanh), then c = log2 e.

Both take the op's arguments (q [B, Hq, D], HND cache [blocks, Hkv, page,
2D], block_tables [B, max_blocks], seq_lens [B], sinks [Hq] or None, window
or None, scale, and ``softcap`` None or the logit cap) and return [B, Hq, D];
seq_len 0 gives zeros. With ``softcap`` the logits are soft-capped before the
softmax as transformers does for Gemma 2 (``attn_logit_softcapping``):
``s = softcap * tanh(q.k * scale / softcap)``; sinks are not capped.

fp8 e4m3 caches (vLLM's per-layer scales, dequantized = e4m3 x scale):
``quantize_kv`` writes one from a bf16 cache as vLLM does, and
``dequantize_kv`` returns the fp64 cache both references above then take
(``decode_attention_ref(q, dequantize_kv(kv8, ks, vs), ...)``): the error
contract is against the dequantized cache, so the quantization itself is
not the kernel's error.
"""

from __future__ import annotations

import math

LOG2E = 1.4426950408889634


def _gather(kv_cache, block_tables, b, seq_len, window):
    """(K, V) of request b's attended positions: [Hkv, n, D] each."""
    page = kv_cache.shape[2]
    d = kv_cache.shape[3] // 2
    n_pages = min(-(-seq_len // page), block_tables.shape[1])
    seq_len = min(seq_len, n_pages * page)
    ids = block_tables[b, :n_pages].long()
    rows = kv_cache[ids]                                   # [n_pages, Hkv, page, 2D]
    rows = rows.permute(1, 0, 2, 3).reshape(kv_cache.shape[1], n_pages * page, 2 * d)
    start = max(seq_len - window, 0) if window is not None else 0
    rows = rows[:, start:seq_len]
    return rows[..., :d], rows[..., d:]


def _requests(q, kv_cache, block_tables, seq_lens, window):
    """(b, q[b] as [Hkv, G, D], K, V) for every request with seq_len > 0."""
    batch, hq, d = q.shape
    hkv = kv_cache.shape[1]
    lens = seq_lens.tolist()
    for b in range(batch):
        if lens[b] > 0:
            k, v = _gather(kv_cache, block_tables, b, lens[b], window)
            yield b, q[b].view(hkv, hq // hkv, d), k, v


def decode_attention_ref(q, kv_cache, block_tables, seq_lens, sinks, window, scale, softcap=None):
    """fp64 reference, [B, Hq, D] float64."""
    import torch

    batch, hq, d = q.shape
    hkv = kv_cache.shape[1]
    gqa = hq // hkv
    out = torch.zeros(batch, hq, d, dtype=torch.float64, device=q.device)
    for b, qb, k, v in _requests(q, kv_cache, block_tables, seq_lens, window):
        s = torch.einsum("hgd,hnd->hgn", qb.double(), k.double()) * scale          # [Hkv, G, n]
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        if sinks is not None:
            sk = sinks.double().view(hkv, gqa, 1)
        else:
            sk = torch.full((hkv, gqa, 1), -math.inf, dtype=torch.float64, device=q.device)
        p = torch.softmax(torch.cat([s, sk], dim=-1), dim=-1)[..., :-1]
        out[b] = torch.einsum("hgn,hnd->hgd", p, v.double()).reshape(hq, d)
    return out


def decode_attention_seed_rounding(q, kv_cache, block_tables, seq_lens, sinks, window, scale, softcap=None):
    """Single-pass torch computation with the kernel's roundings, [B, Hq, D] bf16."""
    import torch

    batch, hq, d = q.shape
    hkv = kv_cache.shape[1]
    gqa = hq // hkv
    c = scale * LOG2E if softcap is None else LOG2E
    out = torch.zeros(batch, hq, d, dtype=torch.bfloat16, device=q.device)
    for b, qb, k, v in _requests(q, kv_cache, block_tables, seq_lens, window):
        s = torch.einsum("hgd,hnd->hgn", qb.float(), k.float())                    # fp32 from bf16
        if softcap is not None:
            s = softcap * torch.tanh(s * (scale / softcap))
        m = s.amax(dim=-1, keepdim=True)
        p = torch.exp2(s * c - m * c)
        l = p.sum(dim=-1, keepdim=True)
        if sinks is not None:
            l = l + torch.exp2(sinks.float().view(hkv, gqa, 1) * LOG2E - m * c)
        o = torch.einsum("hgn,hnd->hgd", p.bfloat16().float(), v.float()) / l
        out[b] = o.reshape(hq, d).bfloat16()
    return out


def _split_scales(k_scale, v_scale):
    return float(k_scale), float(v_scale)


def quantize_kv(kv, k_scale, v_scale, *, as_uint8=False):
    """An e4m3 HND cache from a bf16 / fp32 one [blocks, Hkv, page, 2D]:
    ``(x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)`` for K
    (``[..., :D]``, ``k_scale``) and V (``v_scale``): vLLM's order,
    saturating, NaN stays NaN. ``as_uint8``: the same bytes as torch.uint8
    (how vLLM allocates fp8 caches). Scales: numbers or one-element tensors."""
    import torch

    ks, vs = _split_scales(k_scale, v_scale)
    d = kv.shape[-1] // 2
    x = kv.float()
    q = torch.cat([(x[..., :d] / ks).clamp(-448.0, 448.0), (x[..., d:] / vs).clamp(-448.0, 448.0)], dim=-1)
    q = q.to(torch.float8_e4m3fn)
    return q.view(torch.uint8) if as_uint8 else q


def dequantize_kv(kv8, k_scale, v_scale):
    """fp64 cache [blocks, Hkv, page, 2D] of an e4m3 one (float8_e4m3fn or
    uint8 bytes): K = e4m3 x k_scale, V = e4m3 x v_scale, exact in fp64
    (NaN bytes stay NaN)."""
    import torch

    ks, vs = _split_scales(k_scale, v_scale)
    if kv8.dtype == torch.uint8:
        kv8 = kv8.view(torch.float8_e4m3fn)
    d = kv8.shape[-1] // 2
    x = kv8.to(torch.float64)
    return torch.cat([x[..., :d] * ks, x[..., d:] * vs], dim=-1)


def head_errors(x, ref, v_max=0.0):
    """Relative error of every (request, head) row of [B, H, D] outputs:
    ||x - ref|| / max(||ref||, floor) over D in fp64 ([B, H]), floor =
    sqrt(D) * max(2^-126, 2^-120 * v_max).

    The floor is what fp32 with flush-to-zero can hold: a stored bf16 has no
    relative precision below its smallest normal (2^-126), and a head whose
    sink takes all but 2^-126 of the mass (87 nats above every logit) has
    an output factor that flushes to 0 (``attention_combine.norm_factor``):
    an output below 2^-126 |V| comes out as 0. ``v_max``: max |V| of the
    attended values (0: the bf16 floor alone); 2^-120 leaves 64x of margin
    over the flush so that heads near it count as exact."""
    import torch

    floor = math.sqrt(ref.shape[-1]) * max(2.0 ** -126, 2.0 ** -120 * float(v_max))
    diff = torch.linalg.vector_norm(x.double() - ref.double(), dim=-1)
    norm = torch.linalg.vector_norm(ref.double(), dim=-1)
    return diff / norm.clamp_min(floor)


def rel_error(x, ref) -> float:
    """Relative Frobenius error ||x - ref|| / ||ref|| in fp64 (0 when both are 0)."""
    import torch

    diff = torch.linalg.vector_norm((x.double() - ref.double()).flatten()).item()
    norm = torch.linalg.vector_norm(ref.double().flatten()).item()
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / norm
