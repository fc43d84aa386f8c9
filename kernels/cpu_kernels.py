"""treespec's CPU kernels for bf16 models (``cpu_kernels.c``), built on first use: a linear layer
and a tree attention, both batch-invariant.

PyTorch's bf16 ``F.linear`` on a CPU without bf16 instructions costs about one single-row product
per row (8 rows cost 5-8x one row on an AVX2 machine), and an fp32 copy of the weight doubles the
bytes a single-row step must read. The C kernel reads the bf16 weight once per step for all rows,
widens it in registers and accumulates in fp32, and gives every row the same bits whether it is
scored alone or among others (batch invariance: see the C file). The attention kernel computes
each query row and head alone over its visible keys in cache order, so a tree node's attention
has the bits of the autoregressive step that would score the same token.

The kernel is compiled with the system's C compiler into ``$TREESPEC_HOME/kernels/`` the first
time it is needed (about a second), keyed by a hash of its source and flags, and loaded with
ctypes; nothing is downloaded and nothing but this file's source is compiled. Where it cannot
serve (not x86-64 Linux, no AVX2/FMA, no compiler, a failed build) :func:`available` is False,
:func:`unavailable_reason` says why, and callers use PyTorch's own kernels.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off", "-fPIC", "-shared"]
LIBS = ["-lm"]


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _cache_dir() -> Path:
    home = os.environ.get("TREESPEC_HOME")
    return (Path(home) if home else Path.home() / ".cache" / "treespec") / "kernels"


@functools.lru_cache(maxsize=1)
def _load() -> tuple[ctypes.CDLL | None, str]:
    """The loaded library, or None and the reason it is not there."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"needs x86-64 Linux, this is {platform.system()} {platform.machine()}"
    missing = {"avx2", "fma"} - _cpu_flags()
    if missing:
        return None, f"this CPU lacks {', '.join(sorted(missing))}"
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None, "no C compiler (cc or gcc) on PATH"
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join([compiler, *FLAGS, *LIBS]).encode()).hexdigest()[:16]
    library = _cache_dir() / f"treespec_cpu_kernels_{digest}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=library.parent) as build:
            built = Path(build) / library.name
            result = subprocess.run(
                [compiler, *FLAGS, str(SOURCE), "-o", str(built), *LIBS], capture_output=True, text=True
            )
            if result.returncode != 0:
                return None, f"building {SOURCE.name} failed: {result.stderr.strip()[-500:]}"
            os.replace(built, library)  # atomic: a concurrent build never sees half a file
        for stale in library.parent.glob("treespec_cpu_kernels_*.so"):  # builds of earlier sources
            if stale != library:
                stale.unlink(missing_ok=True)  # a process that loaded one keeps its mapping
    try:
        lib = ctypes.CDLL(str(library))  # libgomp.so.1 resolves to the one torch already loaded
    except OSError as error:
        return None, f"loading {library} failed: {error}"
    lib.treespec_linear_bf16.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                         ctypes.c_void_p, ctypes.c_int] + [ctypes.c_int64] * 3  # fmt: skip
    lib.treespec_linear_bf16.restype = None
    lib.treespec_linear_bf16_many.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,
                                              ctypes.c_void_p, ctypes.c_int64]  # fmt: skip
    lib.treespec_linear_bf16_many.restype = None
    lib.treespec_tree_attention_bf16.argtypes = (
        [ctypes.c_void_p] * 9 + [ctypes.c_int64] * 6 + [ctypes.c_float]
    )
    lib.treespec_tree_attention_bf16.restype = None
    return lib, ""


def available() -> bool:
    """Whether the kernel is built and loaded (building it on first call)."""
    return _load()[0] is not None


def unavailable_reason() -> str:
    """Why the kernel cannot serve here ('' when it can)."""
    return _load()[1]


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for a bf16 ``weight`` [N, K] (and bf16 ``bias`` [N] or None), with
    ``x`` [..., K] bf16 or fp32; the result has ``x``'s dtype, accumulated in fp32 and rounded
    once, as ``nn.functional.linear`` does. Raises ``RuntimeError`` where the kernel is
    unavailable (callers check :func:`available` first) and ``ValueError`` for other inputs."""
    lib, reason = _load()
    if lib is None:
        raise RuntimeError(f"treespec's CPU linear kernel is unavailable: {reason}")
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(
            f"weight must be a 2-D bf16 CPU tensor, got {weight.dtype} {tuple(weight.shape)} on {weight.device}"
        )
    if (
        x.dtype not in (torch.bfloat16, torch.float32)
        or x.shape[-1] != weight.shape[1]
        or x.device.type != "cpu"
    ):
        raise ValueError(
            f"x must be a bf16 or fp32 CPU tensor [..., {weight.shape[1]}], got {x.dtype} {tuple(x.shape)} on {x.device}"
        )
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != weight.shape[:1]):
        raise ValueError(f"bias must be bf16 [{weight.shape[0]}], got {bias.dtype} {tuple(bias.shape)}")
    return linear_unchecked(x, weight.contiguous(), None if bias is None else bias.contiguous())


def linear_unchecked(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`linear_bf16` without its checks, for a caller that has made them: the kernel is
    available, ``weight`` (and ``bias``) are contiguous bf16 CPU tensors, ``x`` is a bf16 or fp32
    CPU tensor whose last dimension is ``weight``'s second. The per-call cost is a few
    microseconds: a layer calls it for every row count of every step."""
    rows = x.contiguous()
    out = torch.empty(x.shape[:-1] + weight.shape[:1], dtype=x.dtype)
    bf16 = x.dtype is torch.bfloat16
    n, k = weight.shape
    _load()[0].treespec_linear_bf16(rows.data_ptr(), bf16, weight.data_ptr(), bias if bias is None else bias.data_ptr(),
                                    out.data_ptr(), bf16, rows.numel() // k, n, k)  # fmt: skip
    return out


def linear_many_unchecked(
    x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]
) -> list[torch.Tensor]:
    """``[linear_unchecked(x, w, b) for w, b in zip(weights, biases)]`` in one call (the same
    bits: each output is computed as its own call would), for layers that read the same input:
    one parallel pass over all their rows, one call's overhead. Same preconditions."""
    rows = x.contiguous()
    count, k = len(weights), weights[0].shape[1]
    outs = [torch.empty(x.shape[:-1] + w.shape[:1], dtype=x.dtype) for w in weights]
    pointers = ctypes.c_void_p * count
    bf16 = x.dtype is torch.bfloat16
    _load()[0].treespec_linear_bf16_many(
        rows.data_ptr(), bf16, count, pointers(*[w.data_ptr() for w in weights]),
        pointers(*[None if b is None else b.data_ptr() for b in biases]), pointers(*[o.data_ptr() for o in outs]),
        bf16, rows.numel() // k, (ctypes.c_int64 * count)(*[w.shape[0] for w in weights]), k,
    )  # fmt: skip
    return outs


def tree_attention_bf16(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    row_slot: torch.Tensor,
    row_prefix: torch.Tensor,
    row_index: torch.Tensor,
    row_new: torch.Tensor,
    tree_mask: torch.Tensor | None,
    sm_scale: float,
) -> torch.Tensor:
    """Batch-invariant tree attention (see the C file): q [T, Hq, D] bf16 over caches
    [S, Hkv, L, D] bf16; per row its cache slot, committed length, index among its request's new
    tokens and that request's count of new tokens ([T] int64 each); ``tree_mask`` [T, W] int32
    ancestor words, or None for causal chains. Returns [T, Hq, D] bf16. The caller has checked
    the contract (``kernels.tree_attention.check_attention_inputs``) and that the kernel is
    available."""
    q = q.contiguous()
    out = torch.empty_like(q)
    num_rows, num_heads, head_dim = q.shape
    _, kv_heads, max_len, _ = k_cache.shape
    mask = None if tree_mask is None else tree_mask.contiguous()
    words = 0 if mask is None else mask.shape[1]
    _load()[0].treespec_tree_attention_bf16(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), row_slot.data_ptr(),
        row_prefix.data_ptr(), row_index.data_ptr(), row_new.data_ptr(), None if mask is None else mask.data_ptr(),
        words, num_rows, num_heads, kv_heads, max_len, head_dim, sm_scale,
    )  # fmt: skip
    return out
