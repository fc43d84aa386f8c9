"""generate() and the Engine against HF generate, the oracle, token for token (fp32, greedy)."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, oracle_table

import treespec
from treespec import Engine, SamplingParams, Target

PROMPTS = [list(range(5, 12)), [20, 21, 22], list(range(30, 60)), [7]]  # lengths 7, 3, 30, 1
NEW = 24


@pytest.fixture(scope="module")
def oracles():
    """HF greedy continuations of PROMPTS, per family, computed once."""
    return oracle_table(PROMPTS, NEW)


@pytest.mark.parametrize("chunk", [1, 7, 64, None])
@pytest.mark.parametrize("batch", [1, 2, 3, 4])
def test_greedy_equals_hf(family, oracles, batch, chunk):
    model, expected = oracles(family)
    prompts = PROMPTS[-batch:] if batch % 2 else PROMPTS[:batch]  # vary which lengths share a batch
    want = expected[-batch:] if batch % 2 else expected[:batch]
    out = treespec.generate(model, prompts, max_new_tokens=NEW, prefill_chunk_size=chunk)
    assert out.sequences == want
    assert out.stats.new_tokens == NEW * batch and out.stats.prompt_tokens == sum(map(len, prompts))


def test_padded_tensor_input_equals_lists(oracles):
    model, expected = oracles("llama")
    width = max(map(len, PROMPTS))
    ids = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(PROMPTS):  # left padding
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    out = treespec.generate(model, ids, attention_mask=mask, max_new_tokens=NEW)
    assert out.sequences == expected


def test_eos_stops_each_request_on_its_own(oracles):
    model, expected = oracles("llama")
    eos = expected[0][3]  # request 0 emits it as its 4th token
    out = treespec.generate(model, PROMPTS, max_new_tokens=NEW, eos_token_id=eos)
    for seq, full in zip(out.sequences, expected, strict=False):
        cut = full.index(eos) + 1 if eos in full else len(full)
        assert seq == full[:cut]
    assert out.sequences[0] == expected[0][:4]
    # HF agrees on the single-prompt case.
    hf = model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=NEW, do_sample=False, eos_token_id=eos)
    assert hf[0, len(PROMPTS[0]) :].tolist() == out.sequences[0]


def test_default_eos_comes_from_generation_config(oracles):
    model, expected = oracles("qwen2")
    model.generation_config.eos_token_id = expected[1][2]
    try:
        out = treespec.generate(model, [PROMPTS[1]], max_new_tokens=NEW)
        assert out.sequences == [expected[1][:3]]
        assert treespec.generate(model, [PROMPTS[1]], max_new_tokens=NEW, eos_token_id=[]).sequences == [
            expected[1]
        ]
    finally:
        model.generation_config.eos_token_id = None


def test_requests_join_while_others_decode(oracles):
    model, expected = oracles("gemma3")
    engine = Engine(Target(model), max_batch_size=2, max_len=64, prefill_chunk_size=4)
    first = engine.add_request(PROMPTS[2], max_new_tokens=NEW)
    for _ in range(12):  # request 0 is mid-decode when the others arrive
        engine.step()
    later = [engine.add_request(p, max_new_tokens=10) for p in (PROMPTS[0], PROMPTS[3])]
    steps_with_mixed_work = 0
    while engine.has_unfinished():
        engine.step()
        steps_with_mixed_work += 1
    assert engine.pop(first).output == expected[2]
    assert [engine.pop(i).output for i in later] == [expected[0][:10], expected[3][:10]]
    assert engine.cache.num_free == 2  # all slots returned


def test_streamer_sees_prompt_then_tokens_then_end(oracles):
    model, expected = oracles("llama")

    class Recorder:
        def __init__(self):
            self.calls = []

        def put(self, value):
            self.calls.append(value.tolist())

        def end(self):
            self.calls.append("end")

    rec = Recorder()
    treespec.generate(model, [PROMPTS[0]], max_new_tokens=5, streamer=rec)
    assert rec.calls == [[PROMPTS[0]]] + [[t] for t in expected[0][:5]] + ["end"]
    with pytest.raises(ValueError, match="streamer needs exactly one prompt"):
        treespec.generate(model, PROMPTS[:2], max_new_tokens=5, streamer=rec)


def test_sampling_matches_hf_with_the_same_seed(oracles):
    model, _ = oracles("llama")
    prompt = PROMPTS[0]
    torch.manual_seed(123)
    hf = model.generate(
        torch.tensor([prompt]), max_new_tokens=16, do_sample=True, temperature=0.8, top_k=20, top_p=0.9
    )[0, len(prompt) :].tolist()
    torch.manual_seed(123)
    ours = treespec.generate(
        model, [prompt], max_new_tokens=16, temperature=0.8, top_k=20, top_p=0.9
    ).sequences[0]
    assert ours == hf


def test_seeded_generator_reproduces_and_top_k_1_is_greedy(oracles):
    model, expected = oracles("qwen3")

    def run(seed, **kw):
        gen = torch.Generator().manual_seed(seed)
        return treespec.generate(
            model, PROMPTS, max_new_tokens=12, temperature=1.0, generator=gen, **kw
        ).sequences

    assert run(7) == run(7)
    assert run(7) != run(8)
    assert run(7, top_k=1) == [e[:12] for e in expected]


def test_bad_inputs(oracles):
    model, _ = oracles("llama")
    target = Target(model)
    with pytest.raises(ValueError, match="empty prompt"):
        treespec.generate(target, [[1, 2], []], max_new_tokens=4)
    with pytest.raises(ValueError, match=f"token id {VOCAB} is outside the vocabulary"):
        treespec.generate(target, [[1, VOCAB]], max_new_tokens=4)
    with pytest.raises(ValueError, match="exceeds the model's context of 256"):
        treespec.generate(target, [[1] * 250], max_new_tokens=10)
    engine = Engine(target, max_batch_size=1, max_len=16)
    with pytest.raises(ValueError, match="exceeds the cache length 16"):
        engine.add_request([1] * 10, max_new_tokens=8)
    with pytest.raises(ValueError, match="attention_mask shape"):
        treespec.generate(
            target, torch.ones(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 4), max_new_tokens=4
        )
    with pytest.raises(ValueError, match="has a hole"):
        treespec.generate(
            target,
            torch.ones(1, 3, dtype=torch.long),
            attention_mask=torch.tensor([[1, 0, 1]]),
            max_new_tokens=4,
        )
    for chunk in (0, -3):
        with pytest.raises(ValueError, match="prefill_chunk_size must be an int >= 1"):
            treespec.generate(target, [[1, 2]], max_new_tokens=4, prefill_chunk_size=chunk)
    with pytest.raises(ValueError, match="max_new_tokens"):
        treespec.generate(target, [[1, 2]], max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        treespec.generate(target, [[1, 2]], max_new_tokens=4, temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=1.0, top_p=1.5)
    for text in ("hello", ["hello", "world"]):  # text: the message says how to tokenize it
        with pytest.raises(TypeError, match=r"got text: tokenize first.*encode_prompts\(tokenizer"):
            treespec.generate(target, text, max_new_tokens=4)
    with pytest.raises(TypeError, match=r"must be ints, got \['str'\]: tokenize first"):
        engine.add_request(["hello"], max_new_tokens=4)
    with pytest.raises(TypeError, match=r"must be ints, got \['float'\]$"):
        engine.add_request([1.0], max_new_tokens=4)
    with pytest.raises(TypeError, match="proposer"):
        treespec.generate(target, [[1, 2]], max_new_tokens=4, proposer=object())


def test_a_shadowing_checkout_hands_the_import_on(tmp_path):
    """Python started in the folder that holds the clone (named treespec) finds the clone before
    the installed package; the clone's root __init__.py hands the import on, or says what to do."""
    import subprocess
    import sys
    from pathlib import Path

    clone = tmp_path / "treespec"
    clone.mkdir()
    (clone / "__init__.py").write_text((Path(__file__).parents[1] / "__init__.py").read_text())
    code = "import treespec; print(treespec.generate.__module__, treespec.__file__)"
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    module, path = run.stdout.split()
    assert module == "treespec.api" and Path(path).resolve() == Path(treespec.__file__).resolve()
    run = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 1  # -S: no site-packages, so no installed treespec
    assert f"found the source checkout {clone}" in run.stderr and "pip install -e" in run.stderr


def test_the_checkouts_kernel_folder_hands_the_import_on(tmp_path):
    """Python started in a checkout's root finds its kernels/ folder as a top-level ``kernels``,
    the name of Hugging Face's package that transformers imports when installed; the folder's
    __init__.py hands the import on to that package, or says where treespec's kernels are."""
    import subprocess
    import sys
    from importlib import metadata
    from pathlib import Path

    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text(
        (Path(__file__).parents[1] / "kernels" / "__init__.py").read_text()
    )
    code = "import kernels; print(kernels.__file__)"
    try:
        metadata.version("kernels")
    except metadata.PackageNotFoundError:
        pass
    else:
        run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        assert Path(run.stdout.strip()).resolve().parent != (tmp_path / "kernels").resolve()
    run = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 1  # -S: no site-packages, so no installed kernels package: a stand-in
    assert "has no attribute '__file__'" in run.stderr
    assert "treespec's kernels import as `treespec.kernels`" in run.stderr


TRANSFORMERS_PROBE = (  # what transformers runs at import (5.19 and newer), exactly
    "from transformers.utils.import_utils import _is_package_available\n"
    "print(*_is_package_available('kernels', return_version=True))"
)


def test_transformers_started_in_the_checkout_probes_for_kernels_without_an_exception(tmp_path):
    """A Python process started in the checkout's root (here: a folder holding the checkout's
    kernels/__init__.py) runs transformers' availability probe for Hugging Face's ``kernels``
    package exactly as transformers runs it. Without that package (this environment's
    site-packages seen through a copy that leaves it out, where it is installed) the probe
    imports the folder and answers "absent" (the stand-in has no ``__file__``, which transformers
    counts as a namespace shadow) instead of raising; with one installed it finds that one."""
    import subprocess
    import sys
    import sysconfig
    from pathlib import Path

    pytest.importorskip("transformers")
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text(
        (Path(__file__).parents[1] / "kernels" / "__init__.py").read_text()
    )
    packages = Path(sysconfig.get_paths()["purelib"])
    without = tmp_path / "site-without-kernels"  # site-packages minus HF's kernels and its metadata
    without.mkdir()
    for entry in packages.iterdir():
        if entry.name != "kernels" and not (
            entry.name.startswith("kernels-") and entry.suffix == ".dist-info"
        ):
            (without / entry.name).symlink_to(entry)
    isolated = f"import site; site.addsitedir({str(without)!r})\n" + TRANSFORMERS_PROBE
    run = subprocess.run([sys.executable, "-S", "-c", isolated], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["False", "N/A"]
    run = subprocess.run(
        [sys.executable, "-c", TRANSFORMERS_PROBE], cwd=tmp_path, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr  # whatever this environment has installed
    fake = tmp_path / "fake"  # an installed kernels package of version 0.99, without metadata
    (fake / "kernels").mkdir(parents=True)
    (fake / "kernels" / "__init__.py").write_text("__version__ = '0.99'\n")
    code = (
        f"import sys; sys.path.insert(1, {str(fake)!r})\n"
        + isolated
        + "\nimport kernels; print(kernels.__file__)"
    )
    run = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[:2] == ["True", "0.99"]
    assert Path(run.stdout.split()[2]).resolve() == (fake / "kernels" / "__init__.py").resolve()
