"""Small decode-attention launches for compute-sanitizer (one process per tool).

    compute-sanitizer --tool memcheck python tools/sanitize_decode.py 3:128:16 12:64:32 ...

Each argument is ``gqa:head_dim:page[:kv_heads[:long[:cap[:fp8]]]]`` (kv heads
default 2, ``long`` 700 tokens, ``cap`` 0: no soft-capping, ``fp8`` 1: an
e4m3 cache with k_scale 0.02 / v_scale 0.01, checked on the dequantized cache; e.g.
``2:256:16:8:700:50`` is Gemma 2's soft-capped attention); every one runs its windowed (128) and full-attention
launch at batch 1 (one request of ``long`` tokens: global split partials
merged, several splits; ``8:128:16:2:33000`` selects the 4-CTA merge of 66
splits, ``8:64:16:1:33000`` gpt-oss at TP 8) and batch 3 (cluster or few
splits), with seq_lens 0, 1 and slice / page / window edges, and checks each
output against the fp64 reference (tests/decode_attention_cases.py). Sizes
are kept small: racecheck slows a launch down by orders of magnitude.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import flintgen  # noqa: E402
from decode_attention_cases import Case, Fp8Case  # noqa: E402
from flintgen.presets import FLINT  # noqa: E402


def main(shapes):
    for arg in shapes:
        fields = [int(x) for x in arg.split(":")]
        gqa, d, page, kv, long, cap, fp8 = (fields + [2, 700, 0, 0][len(fields) - 3:])[:7]
        spec = FLINT.replace(name=f"san-g{gqa}-d{d}-p{page}-kv{kv}" + (f"-cap{cap}" if cap else "")
                             + ("-fp8" if fp8 else ""), num_q_heads=kv * gqa, num_kv_heads=kv, head_dim=d,
                             page_size=page, max_batch=4, attn_logit_softcap=bool(cap),
                             kv_cache_dtype="fp8_e4m3" if fp8 else "bf16")
        make = Fp8Case if fp8 else Case
        op = flintgen.get_kernel(spec, "decode_attention")
        for window in (128, None):
            for lens in ([long], [0, 1, page + 1], [129, 17, 2 * page]):
                case = make(spec, lens, window, seed=len(lens) + gqa, softcap=float(cap) if cap else None,
                            q_scale=float(cap) if cap else 1.5)
                out = case.poisoned_out()
                op(*case.args(out), **case.kwargs())
                case.check(out, f"{spec.name} window={window} lens={lens} "
                                f"{op.config(len(lens), window is not None).as_params()}")
    print("sanitize_decode: all outputs match the reference")


if __name__ == "__main__":
    main(sys.argv[1:])
