#!/usr/bin/env bash
# Carry a spec's kernels from a CPU build machine to a GPU serving machine as one bundle.
#
# Build machine (no GPU needed; the CuTe DSL and g++ installed):
#
#     examples/bundle_workflow.sh pack flint-sm_90a-132sm.tar.gz
#
# Serving machine (torch, apache-tvm-ffi and the DSL runtime library libcute_dsl_runtime.so;
# set FLINTGEN_RUNTIME_LIB if it is not next to an installed DSL; no compiler needed):
#
#     examples/bundle_workflow.sh serve flint-sm_90a-132sm.tar.gz SHA256
#
# SHA256 is the line pack printed; unpack refuses the file unless it matches. Options after
# the bundle name of `pack` (e.g. `--tp 2`, or `--kernel rms_norm` for a quick try) go to both
# `flintgen build` and `flintgen cache pack`; serve_from_cache.py serves the flint preset.
set -euo pipefail

usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
cmd=${1:-}
bundle=${2:-}
[ -n "$cmd" ] && [ -n "$bundle" ] || usage

case "$cmd" in
pack)
    shift 2
    target=(--arch sm_90a --num-sms 132)     # an H100 SXM / H200: unpack checks the GPU's SM count
    # Build in parallel first (pack builds the missing entries one after another) ...
    flintgen build --preset flint "${target[@]}" -j "$(nproc)" "$@"
    # ... then write exactly the entries the spec needs, with their manifest.
    flintgen cache pack --preset flint "${target[@]}" -o "$bundle" "$@" | tee "$bundle.log"
    sha=$(awk '/^sha256:/ {print $2}' "$bundle.log")
    echo
    echo "copy $bundle to the serving machine and run:"
    echo "    $0 serve $bundle $sha"
    ;;
serve)
    sha=${3:?give the sha256 that pack printed}
    export FLINTGEN_CACHE_DIR=${FLINTGEN_CACHE_DIR:-$HOME/.cache/flintgen}
    # Verify (archive hash, member hashes, layout, places, libraries load) and install atomically.
    flintgen cache unpack "$bundle" --sha256 "$sha"
    # Serve from the cache only: a missing kernel is an error, never a compile.
    FLINTGEN_NO_JIT=1 python "$(dirname "$0")/serve_from_cache.py"
    ;;
*)
    usage
    ;;
esac
