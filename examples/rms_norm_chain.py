"""Run the flint preset's fused residual-add RMSNorm over a chain of layers,
eagerly and as one CUDA graph, and compare with torch.

    python examples/rms_norm_chain.py
"""

import torch

import flintgen
from flintgen.references.rms_norm import rms_norm_ref


def main():
    spec = flintgen.get_preset("flint")
    norm = flintgen.get_kernel(spec, "rms_norm")
    flintgen.warmup(spec, ["rms_norm"])
    h, m, layers = spec.hidden_size, 4, spec.num_layers
    weights = [torch.randn(h, device="cuda").bfloat16() for _ in range(layers)]
    x = torch.randn(m, h, device="cuda").bfloat16()
    res = torch.randn(m, h, device="cuda").bfloat16()
    out = torch.empty_like(x)

    def step():
        a, b = x, out
        for w in weights:
            norm(a, w, spec.rms_eps, res, out=b, residual_out=res)
            a, b = b, a
        return a

    x0, res0 = x.clone(), res.clone()
    got = step().clone()
    ref_x, ref_res = x0, res0
    for w in weights:
        ref, ref_res = rms_norm_ref(ref_x, w, spec.rms_eps, ref_res)
        ref_x = ref.bfloat16()
    print("max |kernel - torch| after", layers, "layers:", (got.float() - ref_x.float()).abs().max().item())

    x.copy_(x0)
    res.copy_(res0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        step()
    g.replay()
    torch.cuda.synchronize()
    print("graph replay ok")


if __name__ == "__main__":
    main()
