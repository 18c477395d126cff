"""Ops with a plain PyTorch reference (the oracle, and the CPU path) and, where it pays, a GPU fast path.

Each public function dispatches on the device of its inputs: CUDA tensors go to the Triton version when
one is registered and Triton imports; everything else runs the reference.
"""
