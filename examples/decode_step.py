"""A decode step of the flint preset: for every layer, the fused QKV step
(RMSNorm + NVFP4 QKV GEMV + q/k norm + RoPE + KV-cache write) then decode
attention (sliding-window or full, by layer), with a torch matmul standing in
for o_proj. Captured in one CUDA graph; reports graph time / layers, and
per-kernel times from an eager run.

    python examples/decode_step.py [--batch 8] [--context 4096]

Batch 1..64: above the preset's max_tokens (8) the spec is rebuilt with
max_tokens = batch (the fused QKV step serves up to 64 tokens, one GEMV
binary per token tile); the step is then a different spec (its own cache
entries, JIT-compiled on first use unless built with ``flintgen build
--preset flint --max-tokens N``).
"""

from __future__ import annotations

import argparse

import torch

import flintgen
from flintgen import quant


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8, help="requests, 1..64 (tokens of the fused QKV step)")
    ap.add_argument("--context", type=int, default=4096)
    args = ap.parse_args()
    spec = flintgen.get_preset("flint")
    B, L = args.batch, args.context
    if B > spec.max_tokens:
        spec = spec.replace(max_tokens=B)   # refused past 64, naming the limit
    hq, hkv, d, page, h = spec.q_heads_per_rank, spec.kv_heads_per_rank, spec.head_dim, spec.page_size, \
        spec.hidden_size
    ops = flintgen.get_kernel(spec)
    flintgen.warmup(spec)
    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g) * scale + shift).to(torch.bfloat16).to(dev)

    layers = []
    for _ in range(spec.num_layers):
        packed, scales, gs = quant.quantize_nvfp4(torch.randn(spec.qkv_out_features, h, generator=g) * 0.02)
        layers.append(dict(norm=rnd(h, scale=0.1, shift=1.0), w=packed.to(dev), ws=scales.to(dev),
                           gs=gs.to(dev), qn=rnd(d, scale=0.1, shift=1.0), kn=rnd(d, scale=0.1, shift=1.0),
                           o_proj=rnd(hq * d, h, scale=0.02)))
    cos_sin = flintgen.rope_table(spec, L + 64, dev)
    blocks_per_req = -(-(L + 1) // page)
    caches = [torch.randn(B * blocks_per_req, hkv, page, 2 * d, generator=g).to(torch.bfloat16).to(dev)
              for _ in range(spec.num_layers)]
    block_tables = torch.randperm(B * blocks_per_req, generator=g).int().view(B, blocks_per_req).to(dev)
    positions = torch.full((B,), L - 1, dtype=torch.int64, device=dev)     # the new token's position
    seq_lens = (positions + 1).int()
    slots = (block_tables.long().gather(1, (positions // page)[:, None]).squeeze(1) * page + positions % page)
    x0 = rnd(B, h)
    attn_out = torch.empty(B, hq, d, dtype=torch.bfloat16, device=dev)

    def step(timed=None):
        x, residual = x0, None
        for i, lw in enumerate(layers):
            cache = caches[i]
            k_view, v_view = cache[..., :d].transpose(1, 2), cache[..., d:].transpose(1, 2)
            window = spec.sliding_window if spec.layer_types[i] == "sliding" else None
            run_qkv = lambda: ops.qkv(x, residual, lw["norm"], lw["w"], lw["ws"], lw["gs"], lw["qn"], lw["kn"],  # noqa: E731
                                      cos_sin, positions, k_view, v_view, slots)
            q, residual = timed("qkv", run_qkv) if timed else run_qkv()
            run_attn = lambda: ops.decode_attention(q.view(B, hq, d), cache, block_tables, seq_lens,  # noqa: E731
                                                    None if not spec.sinks else sinks, window, spec.scale, attn_out)
            timed(f"decode_attention ({'sliding' if window else 'full'})", run_attn) if timed else run_attn()
            x = attn_out.view(B, hq * d) @ lw["o_proj"]
        return x, residual

    sinks = torch.randn(hq, generator=g).to(dev)
    out_eager, _ = step()
    torch.cuda.synchronize()
    assert torch.isfinite(out_eager.float()).all()

    # per-kernel times, eager (CUDA events around each launch)
    times: dict[str, list[float]] = {}

    def timed(name, fn):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        r = fn()
        b.record()
        b.synchronize()
        times.setdefault(name, []).append(a.elapsed_time(b) * 1e3)
        return r

    for _ in range(3):
        step(timed)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        out_graph, _ = step()
    graph.replay()
    torch.cuda.synchronize()
    # The graph recomputes the same step from the same inputs (the caches were
    # already written with this step's K/V), so it must match the eager run.
    rel = ((out_graph.float() - out_eager.float()).norm() / out_eager.float().norm()).item()
    assert rel < 1e-2, f"graph replay differs from the eager step (relative error {rel:.2e})"
    reps = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        reps.append(a.elapsed_time(b) * 1e3)
    reps.sort()
    print(f"flint decode step, B={B}, context {L}, {spec.num_layers} layers: graph "
          f"{reps[len(reps) // 2]:.1f} us = {reps[len(reps) // 2] / spec.num_layers:.2f} us per layer "
          "(QKV + attention + torch o_proj stand-in)")
    for name, ts in times.items():
        ts.sort()
        print(f"  eager {name:<32} median {ts[len(ts) // 2]:7.2f} us over {len(ts)} launches")


if __name__ == "__main__":
    main()
