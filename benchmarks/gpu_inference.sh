#!/usr/bin/env bash
# The inference suites as one device call (nvidia-h200, about 5 minutes; give it
# timeout_s=600): decode, paged-decode and varlen (issue 13) with diyfa ("auto"; and
# diyfa-nosync, max_seqlen_k given: nothing read back), the Hopper
# family forced where it takes the problem (diyfa-hopper: its packed-sequence forward, which
# "auto" leaves to the portable kernel until this run times the two), cuDNN and FA2 through
# SDPA (over the contiguous cache / padded to the longest sequence), FA4 where the machine
# has it; the copy-bandwidth ceiling measured first (the decode target is a share of it).
# Then benchmarks/first_call.py (time to the first result, cold and warm caches, with a
# profile of the first forward in first_call.log). Results to $OUT/inference.jsonl and
# first_call.jsonl; tables last (TB/s for the decode suites, TFLOPS for varlen).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
timeout "${BENCH_TIMEOUT:-480}" python3 -m diyfa.cli bench flash --no-progress \
  --suite decode,paged-decode,varlen,varlen-equal --out "$OUT/inference.jsonl" \
  --providers "diyfa,diyfa-nosync,diyfa-hopper,sdpa-cudnn,sdpa-flash,sdpa-cudnn-padded$fa4" \
  --warmup 10 --rep 50 > "$OUT/inference.log" 2>&1 || echo "bench: exit $?"
tail -n 5 "$OUT/inference.log"
timeout 60 python3 benchmarks/first_call.py --dtype bfloat16 --head-dim 128 --causal \
  > "$OUT/first_call.log" 2>&1 || echo "first_call: exit $?"
tail -n 4 "$OUT/first_call.log"
python3 benchmarks/results_table.py "$OUT/inference.jsonl" --tbps | grep -v " varlen "
python3 benchmarks/results_table.py "$OUT/inference.jsonl" | grep -E "TFLOPS|^varlen"
