"""Linear layers for scoring a few tokens at a time on a CPU, and the module views that use them.

A tree step multiplies a handful of rows (the tree's nodes) by every weight matrix. PyTorch's CPU
``F.linear`` keeps the weight row-major ([out, in]) and, for a few rows, runs about as slowly as
one call per row; in bf16 on CPUs without native bf16 instructions (no AVX512-BF16 or AMX) it is
slower still. The same product against an fp32 copy of the weight stored column-major
(``x @ W^T`` with ``W^T`` contiguous) costs little more for 8 rows than for 1, which is what
makes a tree cheap to verify. On the SmolLM2-135M target (bf16, 2 cores) a step of 8 new tokens
costs 2.5-2.8x a single-token step natively and 1.7x this way; 64 tokens cost 7.5x and 3.8x
(``docs/architecture.md``).

Nothing here changes the user's model. :func:`module_view` builds a *view*: a structural copy of
a module tree whose modules are new objects sharing the original's parameters and buffers (the
same tensors, so the weights are never duplicated and an in-place update or a replaced parameter
shows through), with every ``nn.Linear`` replaced by a :class:`KMajorLinear` when the
``"fp32-kmajor"`` backend is asked for. Whoever builds a view (a ``Target``, a head proposer) owns
it and the fp32 copies it makes; dropping it drops them, and the original modules never knew.

:class:`KMajorLinear` uses its copy (4 bytes per weight, made on first use and remade if the
weight is changed in place or replaced) only for inputs of more than one row and without
gradients: a single row (an autoregressive step) reads half the bytes through the native bf16
kernel. The weights keep their values (bf16 widens to fp32 exactly); products accumulate in fp32,
as PyTorch's bf16 kernels do, and are rounded back to the layer's dtype, so a bf16 model stays a
bf16 model and differs from its native kernels only by summation order, as a different batch size
already does.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

LINEAR_BACKENDS = ("auto", "native", "fp32-kmajor")
_SHARED = ("_parameters", "_buffers")  # a view shares these dicts: the same tensors, always current


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


def _identity(tensor: torch.Tensor | None) -> tuple[int, int, int] | None:
    """What changes when a tensor is replaced or updated in place: (id, data_ptr, version)."""
    if tensor is None:
        return None
    try:
        version = tensor._version
    except RuntimeError:  # an inference tensor has no version counter (nor in-place updates outside one)
        version = -1
    return id(tensor), tensor.data_ptr(), version


class KMajorLinear(nn.Module):
    """An ``nn.Linear`` seen through a column-major fp32 copy of its weight, for several rows.

    It shares the source layer's parameter dict, so ``weight`` and ``bias`` are always the
    source's current tensors.
    """

    def __init__(self, source: nn.Linear) -> None:
        super().__init__()
        self._parameters = source._parameters  # shared: never a second set of weights
        self.in_features, self.out_features = source.in_features, source.out_features
        self._source_ids: tuple | None = None  # identities of the weight and bias copied
        self._weight_t: torch.Tensor | None = None  # [in, out] fp32, contiguous
        self._bias: torch.Tensor | None = None  # [out] fp32

    def _refresh(self) -> None:
        weight, bias = self.weight, self.bias
        source_ids = (_identity(weight), _identity(bias))
        if source_ids != self._source_ids:
            self._weight_t = weight.detach().float().t().contiguous()
            self._bias = None if bias is None else bias.detach().float()
            self._source_ids = source_ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.numel() == x.shape[-1]  # one row: the native kernel reads half the bytes in bf16
            or x.device.type != "cpu"
            or self.weight.device.type != "cpu"
            or torch.is_grad_enabled()
        ):
            return nn.functional.linear(x, self.weight, self.bias)
        self._refresh()
        y = x.float() @ self._weight_t
        if self._bias is not None:
            y = y + self._bias
        return y.to(x.dtype)


def module_view(module: nn.Module, linear_backend: str = "native") -> nn.Module:
    """A new module tree over ``module``'s tensors; ``module`` itself is left untouched.

    Each module of the tree is copied shallowly: its parameters and buffers are the original's
    (shared dicts), its children are views too, and its hook tables are its own copies (hooks
    registered on the view, such as transformers' output-capturing hooks, stay on the view).
    With ``linear_backend="fp32-kmajor"`` each plain ``nn.Linear`` becomes a :class:`KMajorLinear`
    (subclasses, e.g. quantised layers, keep their own forward). A module that appears twice
    in the tree gets one view, so sharing is preserved.
    """
    if linear_backend not in ("native", "fp32-kmajor"):
        raise ValueError(
            f"module_view needs a resolved backend 'native' or 'fp32-kmajor', got {linear_backend!r}"
        )
    return _view(module, linear_backend == "fp32-kmajor", {})


def _view(module: nn.Module, kmajor: bool, seen: dict[int, nn.Module]) -> nn.Module:
    if id(module) in seen:
        return seen[id(module)]
    if kmajor and type(module) is nn.Linear:
        view = KMajorLinear(module)
        view.train(module.training)
    else:
        view = copy.copy(module)  # a new object with a shallow copy of __dict__
        for name, value in module.__dict__.items():
            if isinstance(value, dict) and name not in _SHARED:  # hook tables, and _modules refilled below
                view.__dict__[name] = copy.copy(value)
    seen[id(module)] = view
    if not isinstance(view, KMajorLinear):
        for name, child in module._modules.items():
            view._modules[name] = None if child is None else _view(child, kmajor, seen)
    return view
