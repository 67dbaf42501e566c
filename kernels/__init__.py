"""Triton kernels for the GPU path, imported as `cbatch.kernels`."""
