#!/usr/bin/env bash
# The property-based tests (tests/test_fuzz.py) under the "gpu" hypothesis profile, on CUDA,
# as one device call (nvidia-h200, about 8 minutes):
#   1. the named regressions (tests/test_fuzz_regressions.py) on CUDA;
#   2. the four fuzz tests (attention fwd+bwd, varlen fwd+bwd, KV cache, matmul) with the gpu
#      profile: lengths up to 16k, head dims 1..256, thousands of examples allowed, each test
#      stopped after DIYFA_FUZZ_SECONDS (default 80) unless it has found a failure, which
#      hypothesis then shrinks (up to about five minutes; the run's timeout cuts what is left).
# Writes to $OUT: summary.md (per test: examples, outcome, seconds; the seed, to repeat the
# run with FUZZ_SEED=...), examples.jsonl, junit.xml, fuzz.log (the whole pytest output,
# falsifying examples and @reproduce_failure blobs included), gpu.txt.
# Every failure it finds becomes a named row of tests/test_fuzz_regressions.py.
#
# It cannot run on the CPU machine that wrote it: the gpu profile needs CUDA (test_fuzz.py
# skips itself without it) and its shapes are far beyond the Triton interpreter. It has not
# been run yet (no device machine was lent to the session that wrote it).
#
# Usage on the device: bash benchmarks/gpu_fuzz.sh   (OUT set by the device tool;
# FUZZ_SECONDS, FUZZ_SEED, FUZZ_TIMEOUT override the defaults). FUZZ_PROFILE=ci runs the CI
# profile instead, on any machine: a check of this script's plumbing.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SEED=${FUZZ_SEED:-$(date +%s)}
export DIYFA_FUZZ_PROFILE=${FUZZ_PROFILE:-gpu} DIYFA_FUZZ_SECONDS=${FUZZ_SECONDS:-80}
export DIYFA_FUZZ_SUMMARY="$OUT/examples.jsonl"
# Default configs, no autotuning: every new shape class would otherwise benchmark its whole
# config space; the fuzz run is about correctness, and compiles are its bottleneck already.
export DIYFA_AUTOTUNE=0
: > "$DIYFA_FUZZ_SUMMARY"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
python3 -c "import hypothesis" || { echo "hypothesis missing: carry its wheel"; exit 1; }
start=$(date +%s)
timeout -s INT -k 30 "${FUZZ_TIMEOUT:-540}" python3 -m pytest -q -p no:cacheprovider -rs \
  --hypothesis-seed="$SEED" --hypothesis-show-statistics --junitxml="$OUT/junit.xml" \
  tests/test_fuzz_regressions.py tests/test_fuzz.py > "$OUT/fuzz.log" 2>&1
status=$?
echo "pytest exit $status after $(( $(date +%s) - start )) s" | tee -a "$OUT/fuzz.log"
python3 - "$OUT" "$SEED" "$status" <<'EOF' | tee "$OUT/summary.md"
import json, os, sys
import xml.etree.ElementTree as ET

out, seed, status = sys.argv[1], sys.argv[2], int(sys.argv[3])
examples = {}
for line in open(os.path.join(out, "examples.jsonl")):
    r = json.loads(line)
    examples[r["test"]] = r
cases = {}
try:
    for case in ET.parse(os.path.join(out, "junit.xml")).iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = tag
                message = (node.get("message") or "").splitlines()[0][:120]
                if tag == "skipped" and "DIYFA_FUZZ_SECONDS" in message:
                    outcome = "passed (time budget)"
                elif tag != "skipped":
                    outcome = f"{tag}: {message}"
        cases[case.get("name")] = (outcome, float(case.get("time", 0)))
except (FileNotFoundError, ET.ParseError):
    print(f"no junit.xml (pytest exit {status}: cut by the timeout?); fuzz.log has the output")
print(f"# fuzz run ({os.environ['DIYFA_FUZZ_PROFILE']} profile): seed {seed}, "
      f"DIYFA_FUZZ_SECONDS={os.environ['DIYFA_FUZZ_SECONDS']}, pytest exit {status}\n")
print("| test | examples | outcome | seconds |\n|---|---|---|---|")
for name, (outcome, secs) in cases.items():
    n = examples.get(name.removeprefix("test_fuzz_"), {}).get("examples", "")
    print(f"| {name} | {n} | {outcome} | {secs:.0f} |")
for test, r in examples.items():  # tests the junit file does not have (run cut short)
    if f"test_fuzz_{test}" not in cases:
        print(f"| test_fuzz_{test} | {r['examples']} | unfinished (failed: {r['failed']}) "
              f"| {r['seconds']:.0f} |")
failed = [n for n, (o, _) in cases.items() if o.startswith(("failure", "error"))]
print(f"\n{len(failed)} failing: {', '.join(failed) or 'none'}. Falsifying examples and "
      "@reproduce_failure blobs: fuzz.log. Repeat with FUZZ_SEED=" + seed + ".")
EOF
exit "$status"
