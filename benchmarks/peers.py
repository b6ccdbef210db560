"""Peer decode-attention kernels on the same paged cache, called as the peer
table in shared/docs was measured. Each factory returns ``(fn, None)`` or
``(None, reason)`` when the peer is not importable or rejects the case."""

from __future__ import annotations

import torch


def _xqa_decode():
    """FlashInfer's decode entry point, or (None, why) when not importable."""
    try:
        from flashinfer.decode import trtllm_batch_decode_with_kv_cache
    except Exception as e:  # noqa: BLE001
        return None, f"flashinfer not importable: {e}"
    return trtllm_batch_decode_with_kv_cache, None


def _xqa_call(decode, q, k, v, ws, block_tables, seq_lens, sinks, window, max_len, bmm1_scale, bmm2_scale):
    return decode(q, (k, v), ws, block_tables, seq_lens, max_len, bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale,
                  window_left=(window - 1) if window else -1, sinks=sinks, kv_layout="HND", backend="xqa")


def xqa(q, kv, block_tables, seq_lens, sinks, window, scale, max_len):
    """FlashInfer's XQA (bf16 KV runs its generic mma.sync kernel on sm_90),
    with its own zeroed workspace (sharing one with another wrapper gave NaN).
    ``sinks`` None: no sinks. XQA has no logit soft-cap (no ``softcap``
    argument: a soft-capped model's XQA rows run without it)."""
    decode, why = _xqa_decode()
    if decode is None:
        return None, why
    d = q.shape[-1]
    k, v = kv[..., :d], kv[..., d:]
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=q.device)

    def fn():
        return _xqa_call(decode, q, k, v, ws, block_tables, seq_lens, sinks, window, max_len, scale, 1.0)

    try:
        fn()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        return None, f"xqa failed: {type(e).__name__}: {e}"
    return fn, None


def xqa_fp8(q, kvs, block_tables, seq_lens, sinks, window, scale, max_len, kv_scale):
    """XQA on e4m3 caches: FlashInfer's Hopper fp8 kernel (csrc/xqa/mha_sm90.cu;
    q and P enter its gmma as e4m3 too). ``kvs``: HND caches [blocks, Hkv,
    page, 2D] of e4m3 bytes (float8_e4m3fn, or uint8 viewed as such: FlashInfer
    takes a uint8 cache for NVFP4), dequantized = e4m3 x ``kv_scale`` for K and
    V alike (XQA has one scale: "Same scale for K and V cache", csrc/xqa/mha.cu);
    ``block_tables``: one per cache. Calls rotate through the caches, as
    flintgen's do (``Case.flintgen_fn``). One zeroed workspace for all of them
    (the calls are ordered on one stream).

    Scale convention, as FlashInfer 0.7.2.post1 reads (the version the GPU
    machine stages, .device-aot): flashinfer/decode.py
    ``xqa_batch_decode_with_kv_cache`` passes ``kv_scale = bmm2_scale *
    o_scale`` (o_scale 1) and ``q_scale = bmm1_scale / kv_scale *
    sqrt(head_dim)`` to flashinfer/xqa.py ``xqa``; csrc/xqa/mha_sm90.cu then
    scales q . k_e4m3 by ``qkScale = q_scale * kv_scale / sqrt(head_dim)``
    (= bmm1_scale) before the softmax and P . v_e4m3 by ``xvoScale = (1 / 448)
    * kv_scale`` (the 1 / 448 undoes P's scaling to e4m3). So with K, V =
    e4m3 x kv_scale, logits = q . k_deq * scale needs ``bmm1_scale = scale *
    kv_scale`` and out = P . v_deq needs ``bmm2_scale = kv_scale``.

    The K | V halves go as strided views of each cache (XQA reads the strides;
    TMA needs 16-byte ones, which D bytes are); if XQA refuses them, contiguous
    copies of K and V are made and ``fn.notes`` says so. Returns ``(fn,
    None)`` or ``(None, why)``; ``fn()`` runs the next cache, ``fn.call(i)``
    cache i (its output)."""
    decode, why = _xqa_decode()
    if decode is None:
        return None, why
    d = q.shape[-1]
    kvs = [kv.view(torch.float8_e4m3fn) if kv.dtype == torch.uint8 else kv for kv in kvs]
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=q.device)
    bmm1, bmm2 = scale * kv_scale, kv_scale
    refusals = []
    for contiguous in (False, True):
        if contiguous:
            pairs = [(kv[..., :d].contiguous(), kv[..., d:].contiguous()) for kv in kvs]
        else:
            pairs = [(kv[..., :d], kv[..., d:]) for kv in kvs]
        it = {"i": 0}

        def call(i, pairs=pairs):
            k, v = pairs[i]
            return _xqa_call(decode, q, k, v, ws, block_tables[i], seq_lens, sinks, window, max_len, bmm1, bmm2)

        def fn(call=call, it=it, n=len(pairs)):
            i = it["i"] = (it["i"] + 1) % n
            return call(i)

        try:
            call(0)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            refusals.append(f"{type(e).__name__}: {e}")
            del pairs
            continue
        fn.call = call
        fn.notes = [f"contiguous copy (XQA refused the strided K|V views: {refusals[0]})"] if contiguous else []
        return fn, None
    return None, f"xqa-fp8 failed: strided K|V views: {refusals[0]}; contiguous copies: {refusals[1]}"


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
