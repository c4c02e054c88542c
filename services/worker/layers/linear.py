"""A dense projection whose weights are allocated but not initialised (the checkpoint fills them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from himamba.services.worker.layers.cpu_packing import Packed, can_pack, pack, packed_linear
from himamba.services.worker.tensor_parallel import all_reduce, divide, mark, rank0_only, split


class Linear(nn.Module):
    """y = x @ weight.T (+ bias); weight [out, in] as in HF checkpoints.

    Unlike `torch.nn.Linear` nothing is initialised: building a large model must not spend time on
    random numbers that `load_weights` overwrites (it rejects a model with any weight left unloaded).

    Under tensor parallelism (sizes are always the full model's): `parallel="column"` keeps this rank's
    share of the outputs (of each of `parts`, the consecutive blocks of a fused projection, but all of
    the blocks listed in `whole`), `"row"` its
    share of the inputs and sums the ranks' outputs (one all-reduce; the bias is rank 0's).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        device: torch.device,
        dtype: torch.dtype,
        parallel: str = "none",
        parts: tuple[int, ...] | None = None,
        whole: frozenset[int] = frozenset(),
    ) -> None:
        super().__init__()
        self.row_parallel = parallel == "row"
        if parallel == "column":
            blocks = enumerate(parts or (out_features,))
            out_features = sum(p if i in whole else divide(p, "a projection's output block") for i, p in blocks)
        elif parallel == "row":
            in_features = divide(in_features, "a projection's input width")
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, device=device, dtype=dtype), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, device=device, dtype=dtype), requires_grad=False) if bias else None
        )
        if parallel == "column":
            mark(self.weight, split(0, parts, whole))
            mark(self.bias, split(0, parts, whole))
        elif parallel == "row":
            mark(self.weight, split(1))
            mark(self.bias, rank0_only)
        self._packed: Packed | None = None  # packed copy of weight (cpu_packing); not a parameter
        self._fused = False  # a parent packs this weight with its siblings' (fused_into_parent)

    def pack_for_cpu(self) -> bool:
        """Use a pre-packed copy (cpu_packing) of the weight from now on, where it applies; True if packed."""
        self._packed = pack(self.weight) if can_pack(self.weight) and not self._fused else None
        return self._packed is not None

    def fused_into_parent(self) -> None:
        """The parent module runs this projection inside one packed product with its siblings: keep no
        packed copy of its own (calling the module still works, on the plain weight)."""
        self._fused = True
        self._packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            out = packed_linear(x, self._packed, self.bias)
        else:
            out = F.linear(x, self.weight, self.bias)
        return all_reduce(out) if self.row_parallel else out
