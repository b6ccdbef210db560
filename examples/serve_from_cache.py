"""Serve kernels from a cache built on another machine, without the CuTe DSL.

On the build machine (no GPU needed):

    FLINTGEN_CACHE_DIR=/tmp/flint-cache flintgen build --preset flint --arch sm_90a --num-sms 132

Copy /tmp/flint-cache to the serving machine, which needs only torch,
apache-tvm-ffi and the DSL runtime library (libcute_dsl_runtime.so; set
FLINTGEN_RUNTIME_LIB if it is not next to an installed DSL), then:

    FLINTGEN_CACHE_DIR=/tmp/flint-cache FLINTGEN_NO_JIT=1 python examples/serve_from_cache.py

FLINTGEN_NO_JIT=1 turns a cache miss into an error instead of a compile.

Instead of copying the folder, carry one verified archive of exactly the
entries the spec needs: `flintgen cache pack` / `flintgen cache unpack`, as in
examples/bundle_workflow.sh.
"""

import sys

import torch

import flintgen


def main():
    spec = flintgen.get_preset("flint")
    flintgen.warmup(spec)                     # loads every binary of the spec from the cache
    print("cutlass imported:", any(m == "cutlass" or m.startswith("cutlass.") for m in sys.modules))
    norm = flintgen.get_kernel(spec, "rms_norm")
    x = torch.randn(4, spec.hidden_size, device="cuda").bfloat16()
    w = torch.ones(spec.hidden_size, device="cuda").bfloat16()
    y = norm(x, w)
    ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + spec.rms_eps)).bfloat16()
    print("rms_norm from the carried cache, max |diff| vs torch:", (y.float() - ref.float()).abs().max().item())


if __name__ == "__main__":
    main()
