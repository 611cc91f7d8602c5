"""Triton kernels, one module per op: attention, matmul."""
