#!/usr/bin/env bash
# The Hopper backward's first GPU run, as one device call (nvidia-h200; ~8-9 minutes):
#   1. its GPU tests and the Hopper forward's (whose gradients now run the Gluon backward
#      through backend="hopper"), stopping at the first failure, log to $OUT/tests.log;
#   2. if they pass, the backward benchmark side by side: diyfa ("auto": portable backward),
#      diyfa-hopper (Gluon backward, atomic dQ), diyfa-hopper-det (deterministic), cuDNN,
#      FA2, and fa4-cute when FlashAttention-4 is on PYTHONPATH (../shared/tools/fa4-prepare),
#      results to $OUT/bwd.jsonl, a table printed last.
# Usage on the device: bash benchmarks/gpu_hopper_bwd.sh   (OUT set by the device tool)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 330 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_hopper_bwd.py \
  "tests/test_hopper_attention.py::test_gpu_hopper_matrix" 2>&1 | tail -n 60 | tee "$OUT/tests.log"
status=${PIPESTATUS[0]}
if [ "$status" -ne 0 ]; then echo "GPU tests failed (exit $status): no benchmark"; exit "$status"; fi
providers=diyfa,diyfa-hopper,diyfa-hopper-det,sdpa-cudnn,sdpa-flash
python3 -c "import flash_attn.cute" 2>/dev/null && providers="$providers,fa4-cute"
timeout 200 python3 -m diyfa.cli bench flash --suite fa-sweep,seed --modes bwd \
  --providers "$providers" --warmup 25 --rep 100 --no-ceilings --no-progress \
  --out "$OUT/bwd.jsonl" > "$OUT/bench.log" 2>&1 || echo "bench exit $?"
python3 - "$OUT/bwd.jsonl" <<'EOF'
import collections, json, sys
rows = collections.defaultdict(dict)
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("record") != "measurement" or r.get("tflops") is None:
        continue
    key = (r["suite"], r["shape"]["head_dim"], r["options"]["causal"], r["shape"]["seqlen_q"])
    rows[key][r["provider"]] = r["tflops"]
names = sorted({p for v in rows.values() for p in v})
print("suite d causal sq " + " ".join(names))
for key in sorted(rows):
    print(*key, *(f"{rows[key].get(n, float('nan')):.0f}" for n in names))
EOF
