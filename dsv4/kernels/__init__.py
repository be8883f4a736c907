"""Compiled kernels. `dsv4.kernels.cuda`: the CUDA C++ sources and their build (ops in dsv4/ops call them)."""
