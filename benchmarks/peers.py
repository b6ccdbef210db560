"""Peer decode-attention kernels on the same paged cache, called as the peer
table in shared/docs was measured. Each factory returns ``(fn, None)`` or
``(None, reason)`` when the peer is not importable or rejects the case."""

from __future__ import annotations

import torch


def xqa(q, kv, block_tables, seq_lens, sinks, window, scale, max_len):
    """FlashInfer's XQA (bf16 KV runs its generic mma.sync kernel on sm_90),
    with its own zeroed workspace (sharing one with another wrapper gave NaN).
    ``sinks`` None: no sinks. XQA has no logit soft-cap (no ``softcap``
    argument: a soft-capped model's XQA rows run without it)."""
    try:
        from flashinfer.decode import trtllm_batch_decode_with_kv_cache
    except Exception as e:  # noqa: BLE001
        return None, f"flashinfer not importable: {e}"
    d = q.shape[-1]
    k, v = kv[..., :d], kv[..., d:]
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=q.device)

    def fn():
        return trtllm_batch_decode_with_kv_cache(
            q, (k, v), ws, block_tables, seq_lens, max_len, bmm1_scale=scale, bmm2_scale=1.0,
            window_left=(window - 1) if window else -1, sinks=sinks, kv_layout="HND", backend="xqa")

    try:
        fn()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        return None, f"xqa failed: {type(e).__name__}: {e}"
    return fn, None


def fa4(q, kv, block_tables, seq_lens, sinks, window, scale, max_len, softcap=None):
    """FA4 (flash_attn.cute) paged varlen forward with learnable sinks (None:
    none) and an optional logit soft-cap; on sm_90 it has no split-KV."""
    try:
        from flash_attn.cute.interface import flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001
        return None, f"flash_attn.cute not importable: {e}"
    b, hq, d = q.shape
    k, v = kv[..., :d].permute(0, 2, 1, 3), kv[..., d:].permute(0, 2, 1, 3)
    q4 = q.view(b, 1, hq, d)

    def fn():
        return flash_attn_varlen_func(
            q4, k, v, seqused_k=seq_lens, page_table=block_tables, softmax_scale=scale,
            window_size=(window - 1, 0) if window else (None, None), learnable_sink=sinks,
            max_seqlen_q=1, max_seqlen_k=max_len, **({"softcap": softcap} if softcap else {}))

    try:
        fn()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        return None, f"fa4 failed: {type(e).__name__}: {e}"
    return fn, None


PEERS = {"XQA": xqa, "FA4": fa4}
PEER_SOFTCAP = {"FA4"}     # peers that take softcap=
