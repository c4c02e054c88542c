"""Native CPU kernels: the decode-step ops whose PyTorch reference is many small passes, written as
one pass in C, built on first use by `build` and called through ctypes.

Each module here mirrors its reference's signature and contract for float32 CPU tensors;
`supports(...)` says whether it takes the given tensors (else the dispatcher uses the reference).
"""
