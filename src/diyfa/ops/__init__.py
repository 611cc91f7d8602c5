"""Matmul kernels (matmul.py, matmul_ws.py); attention has its own package, diyfa.attention."""
