#!/usr/bin/env bash
# The property-based tests (tests/test_fuzz.py) under the "gpu" hypothesis profile, on CUDA,
# as one device call (nvidia-h200, about 8 minutes): parallel jobs on the one GPU, each
# running ONE fuzz test (attention fwd+bwd, varlen fwd+bwd, KV cache or matmul) for the whole
# call: FUZZ_PLAN lists the jobs' tests (default "matmul matmul attention attention varlen
# varlen fp8_attention kvcache kvcache": nine jobs; "fp8_attention" is the fp8 forward's
# test). The 16 CPU cores' compiles set the pace: six jobs gave 1,251 attention-family and
# 280 matmul examples (fuzz-summary_ba90c48), ten jobs 936 and 717 (bb3174b). The last job
# first runs the named regressions (tests/test_fuzz_regressions.py) on CUDA, and gets 100 s
# less for its test. The gpu profile: lengths up to 16k, head dims
# 1..256, thousands of examples allowed, each job stopped after DIYFA_FUZZ_SECONDS
# (FUZZ_SECONDS, default 450) unless it has found a failure, which hypothesis then shrinks
# (the run's timeout cuts what is left).
# Compiles set the pace: an example that compiles a kernel took 1.5-9 s, one that finds its
# kernels compiled 0.01-0.16 s (H200, 2026-11-23, fuzz-summary_ff6d01d). So each job draws
# its test's kernel classes (dtype, head dim, causal, window sides, softcap, pinned tiles;
# the KV cache's paging and splits) from a pool of DIYFA_FUZZ_CLASSES (default 6) chosen at
# random from seed FUZZ_SEED + i, and shapes, strides, layouts and values freely
# (tests/test_fuzz.py, "kernel classes"), and keeps its one test for the whole call, where
# the earlier jobs ran the four tests in turn and compiled every test's classes. Job i uses
# hypothesis seed FUZZ_SEED + i; the jobs share Triton's compile cache. The float64
# references of large cases take gigabytes for a moment: each job empties its CUDA cache
# after every example and retries an example that ran out of memory once (then gives it up;
# the summary lists those).
# Writes to $OUT: summary.md (per test, summed over the jobs: examples, outcome, seconds; the
# seed, to repeat a job), gpu.txt, and jobs.tar.gz holding per job N: examples.N.jsonl,
# junit.N.xml, fuzz.N.log (the whole pytest output, falsifying examples and
# @reproduce_failure blobs included). One archive because the device tool brings back at
# most 8 files (2026-11-23: six jobs' 26 files stayed behind, and the failures' logs with
# them). The defaults fit a 600 s call: jobs stop at FUZZ_TIMEOUT = 520 s (SIGINT: pytest
# still writes its junit file), then 30 s grace, then the summary.
# Every failure it finds becomes a named row of tests/test_fuzz_regressions.py.
# Two calls in a row on one machine with the same FUZZ_SEED: the second finds Triton's
# compile cache warm, replays the first's examples in seconds and goes on with new ones
# (2026-11-24 at 88e5549: 1,801 + 617 examples, then 3,580 + 1,138, both without a failure).
#
# The gpu profile needs CUDA (test_fuzz.py skips itself without it): its shapes are far
# beyond the Triton interpreter. First run (one job): benchmarks/results/
# 2026-11-23_h200_fuzz-summary_34dc924.md.
#
# Usage on the device: bash benchmarks/gpu_fuzz.sh   (OUT set by the device tool;
# FUZZ_PLAN, FUZZ_SECONDS, FUZZ_SEED, FUZZ_TIMEOUT override the defaults). FUZZ_PROFILE=ci
# runs the CI profile instead, on any machine: a check of this script's plumbing.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
SEED=${FUZZ_SEED:-$(date +%s)}
export DIYFA_FUZZ_PROFILE=${FUZZ_PROFILE:-gpu}
export DIYFA_FUZZ_SECONDS=${FUZZ_SECONDS:-450} DIYFA_FUZZ_CLASSES=${DIYFA_FUZZ_CLASSES:-6}
# Default configs, no autotuning: every new shape class would otherwise benchmark its whole
# config space; the fuzz run is about correctness, and compiles are its bottleneck already.
export DIYFA_AUTOTUNE=0
python3 -c "import hypothesis" 2>/dev/null || { [ -d .whl ] &&
  python3 -m pip install -q --no-index --find-links .whl hypothesis 2>&1 | tail -n 2; }
python3 -c "import hypothesis" || { echo "hypothesis missing: carry .whl (make gpu-wheels)"; exit 1; }
start=$(date +%s)
read -r -a PLAN <<< "${FUZZ_PLAN:-matmul matmul attention attention varlen varlen fp8_attention kvcache kvcache}"
JOBS=${#PLAN[@]}
jobs="$OUT/jobs"; rm -rf "$jobs"; mkdir -p "$jobs"
pids=()
for i in $(seq 0 $((JOBS - 1))); do
  files="tests/test_fuzz.py" seconds=$DIYFA_FUZZ_SECONDS
  if [ "$i" = $((JOBS - 1)) ]; then  # the regressions first (~100 s on an H200), then less fuzz
    files="tests/test_fuzz_regressions.py tests/test_fuzz.py"
    [[ $seconds =~ ^[0-9]+$ ]] && [ "$seconds" -gt 200 ] && seconds=$((seconds - 100))
  fi
  : > "$jobs/examples.$i.jsonl"
  # shellcheck disable=SC2086  # $files is one or two paths
  DIYFA_FUZZ_SUMMARY="$jobs/examples.$i.jsonl" DIYFA_FUZZ_POOL_SEED=$((SEED + i)) \
    DIYFA_FUZZ_SECONDS=$seconds \
    timeout -s INT -k 30 "${FUZZ_TIMEOUT:-520}" \
    python3 -m pytest -q -p no:cacheprovider -rs --hypothesis-seed=$((SEED + i)) \
    --hypothesis-show-statistics --junitxml="$jobs/junit.$i.xml" \
    -k "test_fuzz_${PLAN[$i]} or regression" $files > "$jobs/fuzz.$i.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
  wait "$pid"; rc=$?
  [ "$rc" -gt "$status" ] && status=$rc
done
echo "pytest jobs: worst exit $status after $(( $(date +%s) - start )) s" | tee -a "$jobs/fuzz.0.log"
python3 - "$jobs" "$SEED" "$status" "${PLAN[*]}" <<'EOF' | tee "$OUT/summary.md"
import collections, glob, json, os, sys
import xml.etree.ElementTree as ET

out, seed, status, plan = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split()
jobs = len(plan)
examples = collections.defaultdict(lambda: {"examples": 0, "seconds": 0.0, "failed": False,
                                             "paths": collections.Counter(), "classes": set(),
                                             "timing": collections.defaultdict(lambda: [0, 0.0]),
                                             "oom": []})
for path in glob.glob(os.path.join(out, "examples.*.jsonl")):
    for line in open(path):
        r = json.loads(line)
        e = examples[r["test"]]
        e["examples"] += r["examples"]
        e["seconds"] = max(e["seconds"], r["seconds"])
        e["failed"] = e["failed"] or r["failed"]
        e["paths"].update(r.get("paths", {}))
        e["classes"].update(r.get("classes", []))
        e["oom"] += r.get("out_of_memory", [])
        if r.get("first_failure"):
            e.setdefault("first_failures", []).append(r["first_failure"])
        for kind, (n, secs) in r.get("timing", {}).items():
            e["timing"][kind][0] += n
            e["timing"][kind][1] += secs
cases = {}  # test name -> [outcome per job, seconds of the longest job]
for path in sorted(glob.glob(os.path.join(out, "junit.*.xml"))):
    try:
        tree = ET.parse(path)
    except ET.ParseError:
        print(f"{os.path.basename(path)} unreadable (its job was cut?): see its fuzz log\n")
        continue
    for case in tree.iter("testcase"):
        name = case.get("name") or case.get("classname") or "?"
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                message = ((node.get("message") or "").splitlines() or [""])[0][:120]
                if tag == "skipped":
                    outcome = ("passed (time budget)" if "DIYFA_FUZZ_SECONDS" in message
                               else "skipped")
                else:
                    outcome = f"{tag} ({os.path.basename(path)}): {message}"
        entry = cases.setdefault(name, [[], 0.0])
        entry[0].append(outcome)
        entry[1] = max(entry[1], float(case.get("time") or 0))
print(f"# fuzz run ({os.environ['DIYFA_FUZZ_PROFILE']} profile): {jobs} jobs "
      f"({' '.join(plan)}), seeds "
      f"{seed}..{seed + jobs - 1}, DIYFA_FUZZ_SECONDS={os.environ['DIYFA_FUZZ_SECONDS']}, "
      f"worst pytest exit {status}\n")
print("| test | examples (all jobs) | outcome | seconds (longest job) |\n|---|---|---|---|")
failed = []
for name, (outcomes, secs) in cases.items():
    bad = [o for o in outcomes if o.startswith(("failure", "error"))]
    if bad:
        failed.append(name)
        outcome = "; ".join(bad)
    else:
        outcome = ", ".join(f"{o} x{outcomes.count(o)}" if outcomes.count(o) > 1 else o
                            for o in dict.fromkeys(outcomes))
    n = examples.get(name.removeprefix("test_fuzz_"), {}).get("examples", "")
    print(f"| {name} | {n} | {outcome} | {secs:.0f} |")
for test, r in examples.items():  # tests no junit file has (every job's run cut short)
    if f"test_fuzz_{test}" not in cases:
        print(f"| test_fuzz_{test} | {r['examples']} | unfinished (failed: {r['failed']}) "
              f"| {r['seconds']:.0f} |")
        if r["failed"]:
            failed.append(f"test_fuzz_{test}")
attn = sum(examples[t]["examples"] for t in ("attention", "varlen", "kvcache", "fp8_attention")
           if t in examples)
print(f"\nAttention examples (attention + varlen + kvcache + fp8_attention): {attn}; matmul: "
      f"{examples['matmul']['examples'] if 'matmul' in examples else 0}.\n")
print("| test | kernel path (as \"auto\" chose it) | examples |\n|---|---|---|")
for test, r in examples.items():
    for p, n in sorted(r["paths"].items(), key=lambda x: -x[1]):
        print(f"| {test} | {p} | {n} |")
print("\n| test | examples that compiled a kernel: n, mean s | the others: n, mean s |\n"
      "|---|---|---|")
for test, r in examples.items():
    cells = [f"{r['timing'][k][0]}, {r['timing'][k][1] / max(1, r['timing'][k][0]):.2f}"
             for k in ("compiling", "compiled")]
    print(f"| {test} | {cells[0]} | {cells[1]} |")
for test, r in examples.items():
    for f in r.get("first_failures", []):
        print(f"\n{test}: first failure (before shrinking): {f}")
for test, r in examples.items():
    if r["oom"]:
        print(f"\n{test}: {len(r['oom'])} examples given up for GPU memory (out of memory twice, "
              f"not counted above): " + "; ".join(r["oom"]))
for test, r in examples.items():
    if r["classes"]:
        print(f"\n{test}: {len(r['classes'])} kernel classes: {'; '.join(sorted(r['classes']))}")
print(f"\n{len(failed)} failing: {', '.join(failed) or 'none'}. Falsifying examples and "
      f"@reproduce_failure blobs: fuzz.N.log in jobs.tar.gz. Repeat job N alone with "
      f"FUZZ_SEED={seed} + N FUZZ_PLAN=<its test>.")
sys.exit(1 if failed else 0)
EOF
summary_status=${PIPESTATUS[0]}
tar -czf "$OUT/jobs.tar.gz" -C "$jobs" . && rm -rf "$jobs"
# The verdict is the summary's (1: a test failed), not the jobs' worst exit: a job cut at
# FUZZ_TIMEOUT exits 124, which would read as the device call's own timeout.
exit "$summary_status"
