"""Native CPU kernels: the ops of a CPU step whose PyTorch reference is many small passes (the Mamba2
and Mamba1 scans, conv, attention over the paged pool, RMS norms), each written as one pass or one parallel
region in C, built on first use by `build` and called through ctypes.

Each module here mirrors its references' signatures, checks and results for float32 CPU tensors;
its `supports*` functions say which tensors it takes (the dispatcher gives the rest to the reference).
"""
