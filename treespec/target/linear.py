"""Linear layers for scoring a few tokens at a time on a CPU, and the module views that use them.

A tree step multiplies a handful of rows (the tree's nodes) by every weight matrix. PyTorch's CPU
``F.linear`` keeps the weight row-major ([out, in]) and, for a few rows, runs about as slowly as
one call per row; in bf16 on CPUs without native bf16 instructions (no AVX512-BF16 or AMX) it is
slower still. The same product against an fp32 copy of the weight stored column-major
(``x @ W^T`` with ``W^T`` contiguous) costs little more for 8 rows than for 1, which is what
made a tree cheap to verify on the AVX-512 machine of earlier measurements (SmolLM2-135M bf16: 8
new tokens cost 1.7x a single-token step this way, 2.5-2.8x natively). On the AVX2 machine it
loses at 2-8 rows (``docs/results/2026-12-01-cpu-kernels-and-batch-invariance.md``).

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

On a CPU with AVX2 and FMA, bf16 weights have a better road: treespec's own kernel
(:mod:`treespec.kernels.cpu_kernels`, backend ``"bf16-kernel"``, what "auto" picks for a bf16
model there) reads the bf16 weight once for all rows of a step, widens it in registers and
accumulates in fp32 (on the AVX2 road through a copy of the weight in panels of 16 output
columns, :func:`treespec.kernels.cpu_kernels.road_weight`; the other roads read it as it is).
Measured on an AVX2 machine (SmolLM2-135M, one step in place), a single row costs what PyTorch's bf16 kernel costs and 8 rows cost 1.6-1.9x one row,
where PyTorch's bf16 kernel costs 3.4-4x and an fp32 copy 3.9x (``docs/results/2026-12-01-cpu-kernels-and-batch-invariance.md``). Every
row gets the same bits whether it is scored alone or among others, which with the CPU attention
kernel makes a Target batch-invariant (``docs/architecture.md``). Layers that read the same input
(q/k/v, gate/up) run as one call.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from treespec.kernels import cpu_kernels

LINEAR_BACKENDS = ("auto", "native", "fp32-kmajor", "bf16-kernel")
VIEW_BACKENDS = LINEAR_BACKENDS[1:]  # what "auto" resolves to
_SHARED = ("_parameters", "_buffers")  # a view shares these dicts: the same tensors, always current


def resolve_linear_backend(name: str, device: torch.device | str, dtype: torch.dtype = torch.float32) -> str:
    """The backend a name stands for. "auto" is "native" off the CPU (GPU kernels need no help);
    on a CPU it is "bf16-kernel" for bf16 weights where treespec's kernel is available, else
    "fp32-kmajor". The CPU backends are refused elsewhere, and the bf16 ones where the kernel
    cannot be built (the error says why)."""
    if name not in LINEAR_BACKENDS:
        raise ValueError(f"linear backend must be one of {LINEAR_BACKENDS}, got {name!r}")
    on_cpu = torch.device(device).type == "cpu"
    if name == "auto":
        if not on_cpu:
            return "native"
        return "bf16-kernel" if dtype == torch.bfloat16 and cpu_kernels.available() else "fp32-kmajor"
    if name != "native" and not on_cpu:
        raise ValueError(f"the {name} linear backend is for CPUs; the model is on {device}")
    if name.startswith("bf16-") and not cpu_kernels.available():
        raise ValueError(
            f"the {name} linear backend needs treespec's CPU kernel: {cpu_kernels.unavailable_reason()}"
        )
    return name


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
        source_ids = (cpu_kernels.tensor_identity(weight), cpu_kernels.tensor_identity(bias))
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


# Sibling layers that read the same input in every model family treespec serves: attention's
# projections and the gated MLP's two input projections. A view computes each group in one call.
FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _SiblingGroup:
    """Layers of one module that are called one after another on the same input tensor.

    The first layer called with a new input computes every member's output in one kernel call
    and keeps the others' until they are asked for with that same tensor object (the bits are
    those of separate calls). A member called with another tensor, or twice, computes alone."""

    def __init__(self, members: list[Bf16KernelLinear]) -> None:
        self.members = members
        self._input: torch.Tensor | None = None
        self._pending: dict[int, torch.Tensor] = {}

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if x is self._input and index in self._pending:
            out = self._pending.pop(index)
            if not self._pending:
                self._input = None  # nothing left to hand out: hold no tensor
            return out
        members = self.members
        if not all(m.servable() for m in members):
            return members[index].alone(x)
        outs = cpu_kernels.linear_many_unchecked(x, [m.weight for m in members], [m.bias for m in members])
        self._input = x
        self._pending = {i: out for i, out in enumerate(outs) if i != index}
        return outs[index]


class Bf16KernelLinear(nn.Module):
    """An ``nn.Linear`` whose bf16 products on a CPU run through treespec's kernel
    (:mod:`treespec.kernels.cpu_kernels`; the AVX2 road reads a panel copy of the weight), the
    same bits for a row whatever the rows beside it, one row included. Anything else (other dtypes, gradients, a
    non-contiguous weight) takes ``nn.functional.linear``. It shares the source layer's
    parameter dict, as :class:`KMajorLinear` does. Siblings in :data:`FUSED_SIBLINGS` share a
    :class:`_SiblingGroup` (set by :func:`module_view`)."""

    def __init__(self, source: nn.Linear) -> None:
        super().__init__()
        self._parameters = source._parameters
        self.in_features, self.out_features = source.in_features, source.out_features
        self.group: _SiblingGroup | None = None
        self.group_index = 0

    def servable(self) -> bool:
        """The weight (and bias) are what the kernel reads: contiguous bf16 on the CPU."""
        weight, bias = self.weight, self.bias
        return (
            weight.dtype is torch.bfloat16
            and weight.is_cpu
            and weight.is_contiguous()
            and (bias is None or (bias.dtype is torch.bfloat16 and bias.is_contiguous()))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype is torch.bfloat16 and x.is_cpu and not torch.is_grad_enabled():
            if self.group is not None:
                return self.group.output(self.group_index, x)
            return self.alone(x)
        return nn.functional.linear(x, self.weight, self.bias)

    def alone(self, x: torch.Tensor) -> torch.Tensor:
        """This layer's product without its siblings: the kernel where it serves, else PyTorch's."""
        if self.servable():
            return cpu_kernels.linear_unchecked(x, self.weight, self.bias)
        return nn.functional.linear(x, self.weight, self.bias)


def module_view(module: nn.Module, linear_backend: str = "native") -> nn.Module:
    """A new module tree over ``module``'s tensors; ``module`` itself is left untouched.

    Each module of the tree is copied shallowly: its parameters and buffers are the original's
    (shared dicts), its children are views too, and its hook tables are its own copies (hooks
    registered on the view, such as transformers' output-capturing hooks, stay on the view).
    With ``linear_backend="fp32-kmajor"`` each plain ``nn.Linear`` becomes a :class:`KMajorLinear`,
    with ``"bf16-kernel"`` a :class:`Bf16KernelLinear`
    (subclasses, e.g. quantised layers, keep their own forward). A module that appears twice
    in the tree gets one view, so sharing is preserved.
    """
    if linear_backend not in VIEW_BACKENDS:
        raise ValueError(
            f"module_view needs a resolved backend, one of {VIEW_BACKENDS}, got {linear_backend!r}"
        )
    return _view(module, linear_backend, {})


def _view(module: nn.Module, backend: str, seen: dict[int, nn.Module]) -> nn.Module:
    if id(module) in seen:
        return seen[id(module)]
    if backend != "native" and type(module) is nn.Linear:
        if backend == "fp32-kmajor":
            view = KMajorLinear(module)
        else:
            view = Bf16KernelLinear(module)
        view.train(module.training)
    else:
        view = copy.copy(module)  # a new object with a shallow copy of __dict__
        for name, value in module.__dict__.items():
            if isinstance(value, dict) and name not in _SHARED:  # hook tables, and _modules refilled below
                view.__dict__[name] = copy.copy(value)
    seen[id(module)] = view
    if not isinstance(view, (KMajorLinear, Bf16KernelLinear)):
        for name, child in module._modules.items():
            view._modules[name] = None if child is None else _view(child, backend, seen)
        for names in FUSED_SIBLINGS:
            members = [view._modules.get(name) for name in names]
            if all(isinstance(m, Bf16KernelLinear) and m.group is None for m in members) and (
                len({m.in_features for m in members}) == 1
            ):
                group = _SiblingGroup(members)
                for index, member in enumerate(members):
                    member.group, member.group_index = group, index
    return view
