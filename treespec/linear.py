"""Linear layers for scoring a few tokens at a time on a CPU.

A tree step multiplies a handful of rows (the tree's nodes) by every weight matrix. PyTorch's CPU
``F.linear`` keeps the weight row-major ([out, in]) and, for a few rows, runs about as slowly as
one call per row; in bf16 on CPUs without native bf16 instructions (no AVX512-BF16 or AMX) it is
slower still. The same product against an fp32 copy of the weight stored column-major
(``x @ W^T`` with ``W^T`` contiguous) costs little more for 8 rows than for 1, which is what
makes a tree cheap to verify. On the SmolLM2-135M target (bf16, 2 cores) a step of 8 new tokens
costs 2.5-2.8x a single-token step natively and 1.7x this way; 64 tokens cost 7.5x and 3.8x
(``docs/architecture.md``).

The ``"fp32-kmajor"`` backend keeps such a copy for every ``nn.Linear`` of a model (4 bytes per
weight, made on first use and remade if the weight is changed in place or replaced) and uses it
only inside :func:`active` blocks, which treespec's forwards open, and only for inputs of more
than one row: a single row (an autoregressive step) reads half the bytes through the native bf16
kernel, so it keeps the layer's own ``forward``. Everywhere else, the user's own
``model.generate`` included, each layer runs its own ``forward`` unchanged. The weights keep their
values (bf16 widens to fp32 exactly); products accumulate in fp32, as PyTorch's bf16 kernels do,
and are rounded back to the layer's dtype, so a bf16 model stays a bf16 model and differs from
its native kernels only by summation order, as a different batch size already does.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
from torch import nn

LINEAR_BACKENDS = ("auto", "native", "fp32-kmajor")

_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("treespec_linear_active", default=False)


def resolve_linear_backend(name: str, device: torch.device | str) -> str:
    """The backend a name stands for: "auto" is "fp32-kmajor" on a CPU and "native" elsewhere
    (GPU kernels need no help)."""
    if name not in LINEAR_BACKENDS:
        raise ValueError(f"linear backend must be one of {LINEAR_BACKENDS}, got {name!r}")
    if name == "auto":
        return "fp32-kmajor" if torch.device(device).type == "cpu" else "native"
    if name == "fp32-kmajor" and torch.device(device).type != "cpu":
        raise ValueError(f"the fp32-kmajor linear backend is for CPUs; the model is on {device}")
    return name


@contextlib.contextmanager
def active() -> Iterator[None]:
    """Within this block, layers set up by :func:`install` use their column-major fp32 copies."""
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _identity(tensor: torch.Tensor | None) -> tuple[int, int, int] | None:
    """What changes when a tensor is replaced or updated in place: (id, data_ptr, version)."""
    if tensor is None:
        return None
    try:
        version = tensor._version
    except RuntimeError:  # an inference tensor has no version counter (nor in-place updates outside one)
        version = -1
    return id(tensor), tensor.data_ptr(), version


class _KMajorForward:
    """Replaces one layer's ``forward``: the copy inside :func:`active`, the original outside."""

    def __init__(self, layer: nn.Linear) -> None:
        self.layer = layer
        self.source: tuple | None = None  # identities of the weight and bias copied
        self.weight_t: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    def _refresh(self) -> None:
        weight, bias = self.layer.weight, self.layer.bias
        source = (_identity(weight), _identity(bias))
        if source != self.source:
            self.weight_t = weight.detach().float().t().contiguous()
            self.bias = None if bias is None else bias.detach().float()
            self.source = source

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.layer.weight
        if (
            not _ACTIVE.get()
            or x.numel() == x.shape[-1]  # one row: the native kernel reads half the bytes in bf16
            or x.device.type != "cpu"
            or weight.device.type != "cpu"
            or torch.is_grad_enabled()
        ):
            return type(self.layer).forward(self.layer, x)
        self._refresh()
        y = x.float() @ self.weight_t
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)


def install(model: nn.Module) -> int:
    """Give every ``nn.Linear`` of ``model`` the column-major fp32 path (idempotent); returns how
    many layers have it. Copies are made on first use, not here."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:  # subclasses (quantised layers) keep their own forward
            if not isinstance(module.__dict__.get("forward"), _KMajorForward):
                module.forward = _KMajorForward(module)
            count += 1
    return count
