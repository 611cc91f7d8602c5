#!/usr/bin/env bash
# diyfa against FlashAttention-4, cuDNN and FA2 in one process per suite, as one device call
# (nvidia-h200, ~9.5 minutes: give the call timeout_s=600). FA4 comes from
# ../shared/tools/fa4-prepare: the call before this one ran `bash .fa4a/fa4.sh stash`
# (carry .fa4a), this one carries .fa4b and runs
#   source .fa4b/fa4.sh install && bash benchmarks/gpu_side_by_side.sh
# Measures (results to $OUT, a table per file last):
#   fa-sweep --quick (d64/d128, 1k/4k/16k, causal or not; 3 rounds) and seed + cross + gqa
#     (2 rounds), fwd and bwd,
#     with every diyfa backward mode: diyfa ("auto"), diyfa-hopper (Gluon backward, atomic
#     dQ), diyfa-hopper-det (Gluon dK/dV + the portable dQ kernel);
#   the variants suite (window, softcap, ALiBi, sinks against full causal; diyfa-hopper is
#     the Hopper family forced: its forward, and its backward with the atomic dQ;
#     diyfa-hopper-det its backward after the portable dQ kernel), fwd and bwd.
# (benchmarks/first_call.py moved to gpu_inference.sh: this call's 600 s are full.)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
echo "fa4: ${fa4:-absent}"
bench() {  # name timeout args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m diyfa.cli bench flash --no-ceilings --no-progress \
    --out "$OUT/$name.jsonl" "$@" > "$OUT/$name.log" 2>&1 || echo "$name: exit $?"
}
all="diyfa,diyfa-hopper,diyfa-hopper-det,sdpa-cudnn,sdpa-flash$fa4"
bench fasweep 250 --suite fa-sweep --quick --modes fwd,bwd --providers "$all" --warmup 20 --rep 80 \
  --rounds 3
bench variants 120 --suite variants --modes fwd,bwd \
  --providers "diyfa,diyfa-hopper,diyfa-hopper-det,sdpa-flash$fa4" \
  --warmup 10 --rep 50 --rounds 2
bench seed 210 --suite seed,cross,gqa --modes fwd,bwd --providers "$all" --warmup 20 --rep 60 \
  --rounds 2
for f in "$OUT"/fasweep.jsonl "$OUT"/seed.jsonl "$OUT"/variants.jsonl; do
  [ -f "$f" ] || continue
  python3 benchmarks/results_table.py "$f"
done
