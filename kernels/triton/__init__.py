"""Triton twins of the reference ops, for CUDA tensors: the same signatures, contracts and result types.

Only `himamba.kernels.dispatch` imports these modules, and only when a call's inputs are on CUDA
(or HIMAMBA_KERNELS=triton), so a CPU process never has triton in `sys.modules`. This package
itself imports nothing; each module imports triton at its top.

Every twin reads and writes the layouts its callers already use (strided views of projections,
rows of the state pool, the paged KV pool) through explicit strides: no copies to fit a kernel.
Arithmetic is float32 like the references; half-precision inputs are upcast at load.
"""
