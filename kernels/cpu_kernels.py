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
import sys
import tempfile
import weakref
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_kernels.c")
# the files SOURCE includes, one per concern: one translation unit, one build; a change to any of
# them rebuilds
INCLUDED = tuple(
    Path(__file__).with_name(name)
    for name in ("cpu_common.h", "linear_avx2.c", "linear_avx512bf16.c", "linear_amx.c", "linear.c",
                 "attention.c", "decoder.c", "probe.c", "draft_tree.c")
)  # fmt: skip
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


# The instruction-set roads of the linear kernel, slowest first: name -> (the code the library
# takes, the CPU flags it needs), as the library states them (treespec_road_*, cpu_common.h). The
# roads differ in their last bits (each is batch-invariant on its own), so a process takes one.
_ROADS: dict[str, tuple[int, frozenset[str]]] = {}


def _road_table(lib: ctypes.CDLL) -> dict[str, tuple[int, frozenset[str]]]:
    lib.treespec_road_name.restype = lib.treespec_road_flags.restype = ctypes.c_char_p
    lib.treespec_road_name.argtypes = lib.treespec_road_code.argtypes = lib.treespec_road_flags.argtypes = [
        ctypes.c_int
    ]
    return {
        lib.treespec_road_name(i).decode(): (lib.treespec_road_code(i), frozenset(lib.treespec_road_flags(i).decode().split()))
        for i in range(lib.treespec_road_count())
    }  # fmt: skip


def _roads() -> dict[str, tuple[int, frozenset[str]]]:
    """The library's road table ({} where the kernels cannot be built or loaded)."""
    if not _ROADS:
        _load()
    return _ROADS


def __getattr__(name: str):
    """``ISAS`` (road -> code) and ``ISA_FLAGS`` (road -> CPU flags), read from the library."""
    if name == "ISAS":
        return {road: code for road, (code, _) in _roads().items()}
    if name == "ISA_FLAGS":
        return {road: set(flags) for road, (_, flags) in _roads().items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def phase_names(lib: ctypes.CDLL) -> list[str]:
    """The fused decoder's phases in the order its profiling build counts them (decoder.c)."""
    lib.treespec_phase_name.restype = ctypes.c_char_p
    lib.treespec_phase_name.argtypes = [ctypes.c_int]
    return [lib.treespec_phase_name(i).decode() for i in range(lib.treespec_phase_count())]


_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18  # x86-64 Linux


@functools.lru_cache(maxsize=1)
def amx_refusal() -> str | None:
    """Why this process may not use AMX's tiles, or None when Linux has granted them (it hands
    their 8 KB of state only to a process that asks; asking again is harmless)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"AMX needs x86-64 Linux, this is {platform.system()} {platform.machine()}"
    if "amx" not in _roads():
        return f"treespec's CPU kernels are unavailable: {unavailable_reason()}"
    missing = _roads()["amx"][1] - _cpu_flags()
    if missing:
        return f"this CPU lacks {', '.join(sorted(missing))}"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
        return f"Linux refused the AMX tile state (arch_prctl errno {ctypes.get_errno()})"
    return None


def roads(flags: set[str] | None = None) -> list[str]:
    """The roads this machine can take, slowest first: the CPU has their instructions (``flags``,
    default this CPU's) and, for AMX, the OS grants its tiles."""
    flags = _cpu_flags() if flags is None else flags
    return [
        name
        for name, (_, needs) in _roads().items()
        if needs <= flags and (name != "amx" or amx_refusal() is None)
    ]


def best_isa(flags: set[str] | None = None) -> str | None:
    """The fastest road this machine can take (None: not even AVX2 and FMA)."""
    available = roads(flags)
    return available[-1] if available else None


def _chosen_isa() -> str:
    """The best road, capped by ``TREESPEC_CPU_ISA`` (``avx2`` runs the AVX2 road on a CPU that
    has more, which is how the tests reach every road on one machine)."""
    best = best_isa() or "avx2"
    cap = os.environ.get("TREESPEC_CPU_ISA", "").strip().lower()
    if not cap:
        return best
    codes = {road: code for road, (code, _) in _roads().items()}
    if cap not in codes:
        raise ValueError(f"TREESPEC_CPU_ISA must be one of {', '.join(codes)}, got {cap!r}")
    return cap if codes[cap] <= codes[best] else best


def isa() -> str:
    """The road the kernels take in this process (building them first)."""
    lib = _load()[0]
    if lib is None:
        raise RuntimeError(f"treespec's CPU kernels are unavailable: {unavailable_reason()}")
    code = lib.treespec_get_isa()
    return next(name for name, (value, _) in _roads().items() if value == code)


def set_isa(name: str) -> str:
    """Switch the road and return the previous one. For tests and benchmarks that compare the
    roads: outputs computed before and after a switch are not batch-invariant to each other, so
    nothing that mixes them (an engine's run) may be in flight. Refuses a road this CPU lacks."""
    table = _roads()
    if name not in table:
        raise ValueError(f"the CPU kernels' roads are {', '.join(table)}, got {name!r}")
    missing = table[name][1] - _cpu_flags()
    if missing:
        raise ValueError(f"the {name} road needs {', '.join(sorted(missing))}, which this CPU lacks")
    if name == "amx" and (reason := amx_refusal()) is not None:
        raise ValueError(f"the amx road is not available here: {reason}")
    previous = isa()
    _load()[0].treespec_set_isa(table[name][0])
    return previous


def _cache_dir() -> Path:
    home = os.environ.get("TREESPEC_HOME")
    return (Path(home) if home else Path.home() / ".cache" / "treespec") / "kernels"


BUILD_TIMEOUT_S = 120.0  # a compiler that hangs is a failed build, not a hung import


def build_library(
    extra_flags: tuple[str, ...] = (), name: str = "treespec_cpu_kernels"
) -> tuple[Path | None, str]:
    """Compile the C file (with ``extra_flags``, e.g. ``-DTREESPEC_PHASE_TIMES`` for the profiling
    build) into the kernel cache, keyed by a hash of source, compiler and flags. Returns the
    library's path, or None and why it could not be built (no compiler, an unwritable cache, a
    compiler error, a timeout); never raises for those."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None, "no C compiler (cc or gcc) on PATH"
    flags = [*FLAGS, *extra_flags]
    source = b"".join(path.read_bytes() for path in (SOURCE, *INCLUDED))
    digest = hashlib.sha256(source + " ".join([compiler, *flags, *LIBS]).encode()).hexdigest()[:16]
    library = _cache_dir() / f"{name}_{digest}.so"
    if library.exists():
        return library, ""
    try:
        library.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=library.parent) as build:
            built = Path(build) / library.name
            command = [compiler, *flags, str(SOURCE), "-o", str(built), *LIBS]
            result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            if result.returncode != 0:
                return None, f"building {SOURCE.name} failed: {result.stderr.strip()[-500:]}"
            os.replace(built, library)  # atomic: a concurrent build never sees half a file
        # once per source, compiler and flags: the installed package's own folder is never written
        print(f"treespec: built its CPU kernels from {SOURCE} into {library}", file=sys.stderr)
    except subprocess.TimeoutExpired:
        return None, f"building {SOURCE.name} took over {BUILD_TIMEOUT_S:g} s ({compiler})"
    except OSError as error:  # an unwritable or full cache directory, a compiler that cannot start
        return None, f"building {SOURCE.name} in {library.parent} failed: {error}"
    for stale in library.parent.glob(f"{name}_*.so"):  # this build's earlier sources
        if stale != library:
            stale.unlink(missing_ok=True)  # a process that loaded one keeps its mapping
    return library, ""


@functools.lru_cache(maxsize=1)
def _load() -> tuple[ctypes.CDLL | None, str]:
    """The loaded library, or None and the reason it is not there."""
    return load_library()


def load_library(
    extra_flags: tuple[str, ...] = (), name: str = "treespec_cpu_kernels"
) -> tuple[ctypes.CDLL | None, str]:
    """Build (:func:`build_library`) and load the kernels, declaring their signatures; None and
    the reason where this machine cannot have them."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"needs x86-64 Linux, this is {platform.system()} {platform.machine()}"
    missing = {"avx2", "fma"} - _cpu_flags()
    if missing:
        return None, f"this CPU lacks {', '.join(sorted(missing))}"
    library, reason = build_library(extra_flags, name)
    if library is None:
        return None, reason
    try:
        lib = ctypes.CDLL(str(library))  # libgomp.so.1 resolves to the one torch already loaded
    except OSError as error:
        return None, f"loading {library} failed: {error}"
    lib.treespec_get_isa.restype = ctypes.c_int
    lib.treespec_peak_flops.argtypes = [ctypes.c_int, ctypes.c_int64]
    lib.treespec_peak_flops.restype = ctypes.c_double
    lib.treespec_linear_bf16.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                         ctypes.c_void_p, ctypes.c_int] + [ctypes.c_int64] * 3  # fmt: skip
    lib.treespec_linear_bf16.restype = ctypes.c_int
    lib.treespec_linear_bf16_many.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,
                                              ctypes.c_void_p, ctypes.c_int64]  # fmt: skip
    lib.treespec_linear_bf16_many.restype = ctypes.c_int
    lib.treespec_tree_attention_bf16.argtypes = (
        [ctypes.c_void_p] * 9 + [ctypes.c_int64] * 6 + [ctypes.c_float]
    )
    lib.treespec_tree_attention_bf16.restype = ctypes.c_int
    lib.treespec_decoder_bf16.argtypes = (
        [ctypes.c_void_p] * 4
        + [ctypes.c_int64] * 7
        + [ctypes.c_float] * 2
        + [ctypes.c_void_p] * 4
        + [ctypes.c_int64] * 2
        + [ctypes.c_void_p] * 5
        + [ctypes.c_int64, ctypes.c_void_p]
    )
    lib.treespec_decoder_bf16.restype = ctypes.c_int
    lib.treespec_draft_tree_bf16.argtypes = (
        [ctypes.c_void_p] * 4
        + [ctypes.c_int64, ctypes.c_void_p]
        + [ctypes.c_int64] * 5
        + [ctypes.c_float] * 2
        + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
        + [ctypes.c_void_p] * 5
        + [ctypes.c_int64] * 3
        + [ctypes.c_void_p] * 11
        + [ctypes.c_int64] * 4
        + [ctypes.c_void_p] * 4
    )
    lib.treespec_draft_tree_bf16.restype = ctypes.c_int
    lib.treespec_rmsnorm_bf16.argtypes = (
        [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float] + [ctypes.c_int64] * 2 + [ctypes.c_void_p]
    )
    lib.treespec_rmsnorm_bf16.restype = ctypes.c_int
    lib.treespec_set_isa.argtypes = [ctypes.c_int]
    _ROADS.update(_road_table(lib))  # the same table in every build of the sources
    road = _chosen_isa()  # it asked Linux for AMX's tiles where it picks amx
    lib.treespec_set_isa(_ROADS[road][0])
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


PANEL = 16  # output columns per panel of the AVX2 road's weights (PANEL in linear_avx2.c)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] bf16 in the AVX2 road's panel layout (linear_avx2.c): ceil(N / 16)
    panels of [K, 16], panel p holding output columns 16p .. 16p + 15 (zeros past N), position
    2j of a k's 16 values W[16p + j, k] and position 2j + 1 W[16p + 8 + j, k]. A new tensor of
    the weight's bytes; the weight is not changed."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = weight.detach().new_zeros(panels * PANEL, k)
    padded[:n] = weight.detach()
    return padded.view(panels, 2, PANEL // 2, k).permute(0, 3, 2, 1).contiguous()  # [p, k, j, half]


def tensor_identity(tensor: torch.Tensor | None) -> tuple[int, int, int] | None:
    """What changes when a tensor is replaced or updated in place: (id, data_ptr, version)."""
    if tensor is None:
        return None
    try:
        version = tensor._version
    except RuntimeError:  # an inference tensor has no version counter (nor in-place updates outside one)
        version = -1
    return id(tensor), tensor.data_ptr(), version


_PANELS: dict[int, tuple[tuple, torch.Tensor]] = {}  # id(weight) -> (its identity packed, the panels)


def reads_panels(x_bf16: bool = True) -> bool:
    """Whether a linear over x (bf16 or fp32) reads its weight in panels in this process: on the
    AVX2 road always, on the others where x is fp32 (their products take x in bf16)."""
    lib = _load()[0]
    return not x_bf16 or lib.treespec_get_isa() == _ROADS["avx2"][0]


def road_weight(weight: torch.Tensor, x_bf16: bool = True) -> torch.Tensor:
    """What the kernels read for ``weight`` [N, K] bf16 in a linear over x (bf16 or fp32): its
    panels (:func:`pack_panels`) where the linear reads panels (:func:`reads_panels`), else the
    weight itself. The panels are made once and kept while the weight lives and is unchanged (a
    new tensor or an in-place update is packed again): the AVX2 road holds the weights' bytes a
    second time, and the model's own tensors are never touched."""
    if not reads_panels(x_bf16):
        return weight
    key, identity = id(weight), tensor_identity(weight)
    entry = _PANELS.get(key)
    if entry is not None and entry[0] == identity:
        return entry[1]
    if entry is None:
        weakref.finalize(weight, _PANELS.pop, key, None)  # the panels go with their weight
    packed = pack_panels(weight)
    _PANELS[key] = (identity, packed)
    return packed


NO_MEMORY = 1  # TREESPEC_NO_MEMORY in the C file


def _raise_on_failure(code: int, what: str) -> None:
    """An entry point's return code: 0 done, NO_MEMORY when it could not allocate its work
    buffers (it returned before computing anything)."""
    if code == NO_MEMORY:
        raise MemoryError(f"treespec's CPU kernels could not allocate the work buffers of {what}")
    if code != 0:
        raise RuntimeError(f"treespec's CPU kernels returned {code} for {what}")


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The plain specification of :func:`linear_bf16`: ``x @ weight.T + bias`` summed in float64
    (every bf16 product is exact there, and the sum's rounding is far below fp32's), then
    rounded once to ``x``'s dtype. The kernel's fixed fp32 order differs from it by fp32
    rounding only; tests hold the two together."""
    out = x.double() @ weight.double().t()
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)


def linear_unchecked(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp32_out: bool = False
) -> torch.Tensor:
    """:func:`linear_bf16` without its checks, for a caller that has made them: the kernel is
    available, ``weight`` (and ``bias``) are contiguous bf16 CPU tensors, ``x`` is a bf16 or fp32
    CPU tensor whose last dimension is ``weight``'s second. The output has ``x``'s dtype, or fp32
    with ``fp32_out`` (the sums unrounded). The per-call cost is a few microseconds: a layer
    calls it for every row count of every step."""
    rows = x.contiguous()
    out = torch.empty(x.shape[:-1] + weight.shape[:1], dtype=torch.float32 if fp32_out else x.dtype)
    bf16 = x.dtype is torch.bfloat16
    n, k = weight.shape
    code = _load()[0].treespec_linear_bf16(rows.data_ptr(), bf16, road_weight(weight, bf16).data_ptr(),
                                           bias if bias is None else bias.data_ptr(), out.data_ptr(),
                                           out.dtype is torch.bfloat16, rows.numel() // k, n, k)  # fmt: skip
    _raise_on_failure(code, f"the linear layer over {rows.numel() // k} rows x {n} outputs")
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
    code = _load()[0].treespec_linear_bf16_many(
        rows.data_ptr(), bf16, count, pointers(*[road_weight(w, bf16).data_ptr() for w in weights]),
        pointers(*[None if b is None else b.data_ptr() for b in biases]), pointers(*[o.data_ptr() for o in outs]),
        bf16, rows.numel() // k, (ctypes.c_int64 * count)(*[w.shape[0] for w in weights]), k,
    )  # fmt: skip
    _raise_on_failure(code, f"{count} linear layers over {rows.numel() // k} rows")
    return outs


def rmsnorm_unchecked(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``hidden`` [..., H] bf16 with ``weight`` [H] bf16, rounded where a bf16 model
    rounds it, as the fused decoder's norms compute it (its bits). The caller has checked that
    the kernels are available and both tensors are bf16 CPU tensors of width H."""
    rows = hidden.contiguous()
    out = torch.empty_like(rows)
    size = rows.shape[-1]
    code = _load()[0].treespec_rmsnorm_bf16(rows.data_ptr(), weight.contiguous().data_ptr(), eps,
                                            rows.numel() // size, size, out.data_ptr())  # fmt: skip
    _raise_on_failure(code, f"an RMSNorm over {rows.numel() // size} rows")
    return out


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
    code = _load()[0].treespec_tree_attention_bf16(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), row_slot.data_ptr(),
        row_prefix.data_ptr(), row_index.data_ptr(), row_new.data_ptr(), None if mask is None else mask.data_ptr(),
        words, num_rows, num_heads, kv_heads, max_len, head_dim, sm_scale,
    )  # fmt: skip
    _raise_on_failure(code, f"the tree attention over a cache of {max_len} positions")
    return out


def decoder_bf16(
    hidden: torch.Tensor,
    table: ctypes.Array,
    final_norm: torch.Tensor | None,
    num_layers: int,
    num_rows: int,
    hidden_size: int,
    intermediate_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
    sm_scale: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    num_slots: int,
    max_len: int,
    row_slot: torch.Tensor,
    row_prefix: torch.Tensor,
    row_index: torch.Tensor,
    row_new: torch.Tensor,
    mask: torch.Tensor | None,
    words: int,
    layer_out: ctypes.Array,
    embeds: torch.Tensor | None = None,
) -> None:
    """The fused decoder stack (``treespec_decoder_bf16`` in the C file) over ``hidden`` [T, H]
    bf16 in place (no final norm when ``final_norm`` is None); ``embeds`` [T, H] the rows' token
    embeddings where the table holds an EAGLE-3 layer (its W_EMBED_NORM set). Raw pointers: :class:`treespec.target.fused.FusedDecoder` lays out and owns every
    argument; nothing here checks them beyond the cache's layout."""
    if not (keys.is_contiguous() and values.is_contiguous() and keys.dtype is torch.bfloat16):
        raise ValueError(f"the fused decoder needs contiguous bf16 caches, got {keys.dtype}")
    code = _load()[0].treespec_decoder_bf16(
        hidden.data_ptr(), None if embeds is None else embeds.data_ptr(), table, None if final_norm is None else final_norm.data_ptr(), num_layers, num_rows, hidden_size, intermediate_size,
        num_heads, num_kv_heads, head_dim, eps, sm_scale, cos.data_ptr(), sin.data_ptr(), keys.data_ptr(),
        values.data_ptr(), num_slots, max_len, row_slot.data_ptr(), row_prefix.data_ptr(), row_index.data_ptr(),
        row_new.data_ptr(), None if mask is None else mask.data_ptr(), words, layer_out,
    )  # fmt: skip
    _raise_on_failure(code, f"the fused decoder over {num_rows} rows and a cache of {max_len} positions")


def draft_tree_bf16(
    stack: tuple,
    readout: tuple[torch.Tensor | None, torch.Tensor | None],
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    keys: torch.Tensor | None,
    values: torch.Tensor | None,
    rows: tuple[torch.Tensor | None, ...],
    shape: tuple[int, int, int],
    catch_up: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor] | None = None,
    conditioned_heads: int = 0,
) -> tuple[tuple[torch.Tensor, ...], float]:
    """One EAGLE-2 tree per request in one call (``treespec_draft_tree_bf16`` in
    ``draft_tree.c``), drafted by an EAGLE-1 or EAGLE-3 head or a draft model. ``stack``:
    (embeddings [vocab, H], fc weight [H, 2H] (EAGLE-1), [H, 3H] (EAGLE-3, whose layer's table
    entry has its embedding norm) or None (a draft model), fc bias or None, the layers' pointer
    table, the number of layers, the final norm or None, (hidden, MLP width, query heads, KV
    heads, head dim), eps, sm_scale); ``readout``: (weight [V, H], column ids [V] long or None,
    a norm [H] the rows go through first or None (EAGLE-3's)), read out in fp32; ``cos``, ``sin`` [R, D] rotary rows; ``rows``: per request
    its cache slot, committed length, the rotary row of its first level (level s reads row
    first + s - 1), root token (long), then the root feature [B, H] bf16 (an EAGLE head's, read
    out here) or None, and the root logits [B, V] fp32 (a draft model's), or [B, heads, V]
    (Medusa's: nothing runs, head s scores depth s; the stack, read-out weight, rotary rows and
    caches may be None), or None; ``shape``: (top_k, depth, num_nodes). ``catch_up``: (tokens
    [C] long, an EAGLE head's target features [C, H] (EAGLE-3: [C, 3H]) bf16 or None, per request its count >= 1 and
    the rotary row of its first catch-up row, long): run first as each request's chain past its
    committed length (K/V written there, for the caller to commit), the roots taken from its last
    rows (the root feature and logits in ``rows`` are then None) and the levels drafted past it.
    Returns ((tokens, parents, depths [B * n] long, the mask [B * n, W] int32; n = num_nodes + 1),
    the catch-up's seconds). ``conditioned_heads``: that many conditioned Medusa heads, the
    stack's table (:func:`medusa_table`) holding their layers and its layer count their blocks a
    head, the root feature the target's state behind each root, read through the read-out.
    Raw pointers: :func:`treespec.target.fused.draft_tree` (EAGLE heads, draft models) and
    :class:`treespec.proposers.MedusaProposer` lay out and check every argument."""
    embed, fc_weight, fc_bias, table, num_layers, final_norm, dims, eps, sm_scale = stack
    weight, column_ids, readout_norm = readout
    slots, committed, first_row, roots, root_h, root_logits = rows
    heads = conditioned_heads or (
        root_logits.shape[1] if root_logits is not None and root_logits.dim() == 3 else 0
    )
    catch_tokens, catch_features, catch_counts, catch_row = (None,) * 4 if catch_up is None else catch_up
    seconds = ctypes.c_double(0.0)
    top_k, depth, num_nodes = shape
    batch, kept = len(slots), num_nodes + 1
    tokens, parents, depths = (torch.empty(batch * kept, dtype=torch.long) for _ in range(3))
    mask = torch.empty(batch * kept, (kept + 31) // 32, dtype=torch.int32)

    def pointer(tensor: torch.Tensor | None) -> int | None:
        return None if tensor is None else tensor.data_ptr()

    def linear_weight(tensor: torch.Tensor | None) -> int | None:  # as the road reads it
        return None if tensor is None else road_weight(tensor).data_ptr()

    vocab = root_logits.shape[-1] if weight is None else weight.shape[0]
    cache_sizes = (0, 0) if keys is None else (keys.shape[1], keys.shape[3])

    code = _load()[0].treespec_draft_tree_bf16(
        pointer(embed), linear_weight(fc_weight), pointer(fc_bias), table, num_layers, pointer(final_norm), *dims,
        eps, sm_scale, linear_weight(weight), vocab, pointer(column_ids), pointer(readout_norm), pointer(cos), pointer(sin),
        pointer(keys), pointer(values), *cache_sizes, batch, slots.data_ptr(), committed.data_ptr(),
        first_row.data_ptr(), roots.data_ptr(), pointer(root_h), pointer(root_logits), pointer(catch_tokens),
        pointer(catch_features), pointer(catch_counts), pointer(catch_row), ctypes.addressof(seconds), heads,
        top_k, depth, num_nodes, tokens.data_ptr(), parents.data_ptr(), depths.data_ptr(), mask.data_ptr(),
    )  # fmt: skip
    _raise_on_failure(code, f"a drafted tree of {num_nodes} nodes for {batch} requests")
    return (tokens, parents, depths, mask), seconds.value


def medusa_table(heads) -> tuple[ctypes.Array, list[torch.Tensor]]:
    """The pointer table :func:`draft_tree_bf16` reads for conditioned Medusa ``heads`` (bf16
    :class:`treespec.heads.medusa.MedusaHeads`): per head its input layer's weight (as the road
    reads it) and bias, then each block's. Returns the table and the tensors it points into (keep
    them while the table is used)."""
    tensors = []
    for i, blocks in enumerate(heads.blocks):
        for layer in [heads.inputs[i], *(block.linear for block in blocks)]:
            tensors += [road_weight(layer.weight), layer.bias]
    return (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors]), tensors


def peak_flops(road: str, iterations: int = 20_000_000) -> float:
    """Measured arithmetic peak of a road over all threads (flops/s): twelve independent chains
    per thread of fp32 FMAs (avx2) or bf16 dot products (avx512bf16), or four of AMX tile
    products (amx), from registers."""
    if road not in roads():
        raise ValueError(f"no {road!r} road on this machine (roads: {', '.join(roads())})")
    return _load()[0].treespec_peak_flops(_roads()[road][0], iterations)


def read_bandwidth(megabytes: int = 512, repeats: int = 7) -> float:
    """Measured read bandwidth (bytes/s): the median of ``torch.sum`` over an fp32 buffer far
    larger than the caches, on torch's threads."""
    import statistics
    import time

    buffer = torch.ones(megabytes * 2**20 // 4)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - start)
    return buffer.numel() * 4 / statistics.median(times)
