"""Block size is the most important parameter: find the best one by experiment.

For attention forward (``_attn_fwd``), the backward kernels (``_attn_bwd_dkdv``,
``_attn_bwd_dq``) and matmul, every (BLOCK_M, BLOCK_N[, BLOCK_K], num_warps 4/8/12,
num_stages 2..4) is forced through the public function with ``diyfa.tuning.pinned`` and
measured; each row shows TFLOPS, registers per thread, spills, shared memory per block (read
from the compiled kernel), blocks per SM and what limits them. Prints ranked tables, saves
heatmaps, and with ``--write-table`` writes the winners in the shape of
``diyfa.tuning.DEFAULTS``. ``diyfa tune`` runs the same code.

    python examples/block_size_experiment.py --quick
    python examples/block_size_experiment.py --kernels attn_fwd --head-dim 128 \
        --write-table report/blocksize/sm90_d128.json

Without a GPU it prints the shared-memory arithmetic of seed 000 (a 128x128 tile at head_dim
64 in fp16 is 48 KiB) and the occupancy table only.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from diyfa.cli import main as cli_main

    return cli_main(["tune", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
