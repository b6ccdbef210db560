"""Benchmark fused_add_rms_norm (flint preset) against torch eager."""

from __future__ import annotations

import torch

import flintgen
from benchmarks.harness import Row, read_bandwidth, time_graph, write_results


def torch_fused_add_rms_norm(x, res, w, eps):
    r = x + res
    rf = r.float()
    return (rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).bfloat16(), r


def main():
    spec = flintgen.get_preset("flint")
    norm = flintgen.get_kernel(spec, "rms_norm")
    flintgen.warmup(spec, ["rms_norm"])
    bw = read_bandwidth()
    h = spec.hidden_size
    rows = []
    for m in (1, 8, 64):
        x, res = torch.randn(m, h, device="cuda").bfloat16(), torch.randn(m, h, device="cuda").bfloat16()
        w = torch.randn(h, device="cuda").bfloat16()
        out, res_out = torch.empty_like(x), torch.empty_like(x)
        ours = time_graph(lambda: norm(x, w, 1e-6, res, out=out, residual_out=res_out))
        peer = time_graph(lambda: torch_fused_add_rms_norm(x, res, w, 1e-6))
        nbytes = (4 * m * h + h) * 2
        rows.append(Row({"M": m, "hidden": h}, ours["median_us"], nbytes / bw * 1e6,
                        {"torch eager": peer["median_us"]}, {"p10_us": ours["p10_us"], "p90_us": ours["p90_us"]}))
    print(write_results("rms_norm", rows, bw, "Floor = bytes moved / read bandwidth (launch-bound at decode M)."))


if __name__ == "__main__":
    main()
