#!/bin/bash
# compute-sanitizer's four tools over GPU tests, on the GPU machine:
#   bash tools/sanitize_pytest.sh NAME PYTEST_ARGS...
# Two files under $OUT: NAME_summary.txt and NAME_logs.txt (each log's last 60 lines).
# The first, unsanitized pass compiles the variants into the cache and runs the checks.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"; logs=$(mktemp -d)
name="$1"; shift
python3 -m pytest -m gpu -q -p no:cacheprovider "$@" > "$logs/plain.log" 2>&1
echo "plain rc=$? $(tail -1 "$logs/plain.log")" | tee "$OUT/${name}_summary.txt"
for tool in memcheck synccheck initcheck racecheck; do
    extra=""; [ "$tool" = racecheck ] && extra="--racecheck-report all"
    timeout 300 compute-sanitizer --tool "$tool" $extra python3 -m pytest -m gpu -q -p no:cacheprovider "$@" \
        > "$logs/$tool.log" 2>&1
    echo "$tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$logs/$tool.log" | tail -1)" \
        "| $(grep -E 'passed|failed' "$logs/$tool.log" | tail -1)" | tee -a "$OUT/${name}_summary.txt"
done
for f in plain memcheck synccheck initcheck racecheck; do echo "== $f"; tail -60 "$logs/$f.log"; done \
    > "$OUT/${name}_logs.txt"
