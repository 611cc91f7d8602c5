# Sourced by the device-machine scripts (gpu_*.sh): the repository root as the working
# directory, src/ on PYTHONPATH, $OUT (default /tmp/out) created, the GPU's name and driver
# in $OUT/gpu.txt, and $fa4 = ",fa4-cute" when FlashAttention-4 is importable (else empty).
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
fa4=""; python3 -c "import flash_attn.cute" 2>/dev/null && fa4=",fa4-cute"
