#!/bin/bash
# compute-sanitizer's four tools over one command, on the GPU machine:
#   bash tools/sanitize.sh NAME TIMEOUT_S CMD ...
# (tools/sanitize_all.sh: decode-attention launches; tools/sanitize_pytest.sh: GPU tests.)
# Two files under $OUT: NAME_summary.txt and NAME_logs.txt (each log's last 60 lines).
# SANITIZE_TOOLS (default: all four) picks the tools, e.g. SANITIZE_TOOLS="initcheck racecheck".
# The first, unsanitized pass compiles the variants into the cache and runs the checks.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"; logs=$(mktemp -d)
name="$1"; limit="$2"; shift 2
"$@" > "$logs/plain.log" 2>&1
echo "plain rc=$? $(tail -1 "$logs/plain.log")" | tee "$OUT/${name}_summary.txt"
tools="${SANITIZE_TOOLS:-memcheck synccheck initcheck racecheck}"
for tool in $tools; do
    extra=""; [ "$tool" = racecheck ] && extra="--racecheck-report all"
    timeout "$limit" compute-sanitizer --tool "$tool" $extra "$@" > "$logs/$tool.log" 2>&1
    rc=$?
    tests=$(grep -E ' (passed|failed)' "$logs/$tool.log" | tail -1)
    echo "$tool rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$logs/$tool.log" | tail -1)${tests:+ | $tests}" \
        | tee -a "$OUT/${name}_summary.txt"
done
for f in plain $tools; do echo "== $f"; tail -60 "$logs/$f.log"; done \
    > "$OUT/${name}_logs.txt"
