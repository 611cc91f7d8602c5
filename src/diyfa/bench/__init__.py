"""Benchmarks: suites of cases -> providers -> harness -> JSON-lines results files.

- :mod:`diyfa.bench.suites`    named sweeps (seed, fa-sweep, cross, gqa, llm-matmul, memory)
- :mod:`diyfa.bench.providers` registry of implementations (diyfa, PyTorch SDPA backends,
  flash-attn 2/4, cuBLAS) with the reason when one cannot run
- :mod:`diyfa.bench.harness`   timing, peak memory, error vs reference -> one record each
- :mod:`diyfa.bench.results`   results files (one JSON line per measurement), resuming a run
- :mod:`diyfa.bench.progress`  the progress bar of the long commands (stderr, terminals only)
- :mod:`diyfa.bench.blocksize` the block-size experiment behind ``diyfa tune``

Importing this package imports nothing heavy and launches nothing.
"""
