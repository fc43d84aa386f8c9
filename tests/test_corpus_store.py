"""The corpus kept in the repository (heads/training/store.py): shards sealed as the stages write,
a working folder rebuilt from them on another machine, bad shards refused by name with the run
resuming from the last good one, nothing committed rewritten, and commits of the shards alone."""

from __future__ import annotations

import json
import lzma
import subprocess

import pytest
import torch
from safetensors.torch import load

from treespec.heads.training import corpus as corpus_module
from treespec.heads.training.corpus import ANSWERS, PROMPTS, STATE, AnswerConfig, add_prompts, read_records
from treespec.heads.training.store import MANIFEST, CorpusStore, commit_to_git, tokenizer_fingerprint


class Vocab:
    """What a store reads of a tokenizer: its vocabulary and chat template."""

    def __init__(self, size: int = 50_000, template: str = "{{ messages }}") -> None:
        self.size, self.chat_template = size, template

    def get_vocab(self) -> dict[str, int]:
        return {f"tok{i}": i for i in range(self.size)}

    def __len__(self) -> int:
        return self.size


def _prompts(first: int, count: int) -> list[dict]:
    return [{"id": i, "source": "magpie", "split": "train",
             "messages": [{"role": "user", "content": f"Question number {i}: why is the sky blue?"}]}
            for i in range(first, first + count)]  # fmt: skip


def _answers(ids: list[int], vocab: int = 50_000) -> list[dict]:
    gen = torch.Generator().manual_seed(sum(ids))
    return [{"id": i, "prompt": torch.randint(0, vocab, (5 + i % 3,), generator=gen).tolist(),
             "answer": torch.randint(0, vocab, (7 + i % 5,), generator=gen).tolist(),
             "finish": "eos" if i % 2 else "length", "temperature": 0.7 if i % 3 == 0 else 0.0}
            for i in ids]  # fmt: skip


def _write(work, kind: str, records: list[dict], store: CorpusStore | None = None) -> None:
    corpus_module._append(work / (PROMPTS if kind == "prompts" else ANSWERS), records)
    if store is not None:
        store.add(kind, records)


def _filled(tmp_path, shard_answers: int = 4) -> tuple[CorpusStore, list[dict], list[dict]]:
    """A store of two prompt rounds and ten answers (two full shards, two pending until flush)."""
    work, folder = tmp_path / "work", tmp_path / "store"
    store = CorpusStore(folder, Vocab(), shard_answers=shard_answers)
    store.sync(work)
    prompts = _prompts(0, 6) + _prompts(6, 6)
    (work / STATE).write_text(json.dumps({"magpie": {"rounds": 1}}))
    _write(work, "prompts", prompts[:6], store)
    (work / STATE).write_text(json.dumps({"magpie": {"rounds": 2}}))
    _write(work, "prompts", prompts[6:], store)
    answers = _answers(list(range(10)))
    for part in (answers[:3], answers[3:7], answers[7:]):
        _write(work, "answers", part, store)
    return store, prompts, answers


def test_a_corpus_survives_its_machine(tmp_path):
    store, prompts, answers = _filled(tmp_path)
    manifest = json.loads((tmp_path / "store" / MANIFEST).read_text())
    kinds = [e["kind"] for e in manifest["shards"]]
    assert kinds == ["prompts", "prompts", "answers", "answers"]  # 2 answers still pending
    assert manifest["totals"]["answers"] == 8
    store.flush()
    manifest = json.loads((tmp_path / "store" / MANIFEST).read_text())
    assert manifest["totals"] == {"shards": 5, "prompts": 12, "answers": 10, "bytes": manifest["totals"]["bytes"],
                                  "answer_tokens": sum(len(a["answer"]) for a in answers)}  # fmt: skip
    assert manifest["shards"][1]["magpie"] == {"rounds": 2}
    # Another machine: an empty working folder is rebuilt from the shards alone.
    fresh = tmp_path / "elsewhere"
    summary = CorpusStore(tmp_path / "store", Vocab()).sync(fresh)
    assert summary["rebuilt"] and summary["prompts"] == 12 and summary["answers"] == 10
    assert read_records(fresh / PROMPTS) == prompts
    assert read_records(fresh / ANSWERS) == answers
    assert json.loads((fresh / STATE).read_text()) == {"magpie": {"rounds": 2}}


def test_answers_shards_are_uint16_token_ids_and_a_large_vocabulary_int32(tmp_path):
    store, _, _ = _filled(tmp_path)
    shard = next((tmp_path / "store").glob("*-answers.safetensors.xz"))
    assert load(lzma.decompress(shard.read_bytes()))["tokens"].dtype == torch.uint16
    big = CorpusStore(tmp_path / "big", Vocab(70_000), shard_answers=2)
    big.sync(tmp_path / "bigwork")
    _write(tmp_path / "bigwork", "prompts", _prompts(0, 2), big)
    _write(tmp_path / "bigwork", "answers", _answers([0, 1], 70_000), big)
    shard = next((tmp_path / "big").glob("*-answers.safetensors.xz"))
    tensors = load(lzma.decompress(shard.read_bytes()))
    assert tensors["tokens"].dtype == torch.int32 and int(tensors["tokens"].max()) >= 2**16 - 5_000


def test_a_cut_run_resumes_its_unsealed_records_from_the_working_folder(tmp_path):
    store, prompts, answers = _filled(tmp_path)  # killed here: answers 8 and 9 never sealed
    again = CorpusStore(tmp_path / "store", Vocab(), shard_answers=4)
    summary = again.sync(tmp_path / "work")
    assert not summary["rebuilt"] and summary["pending_answers"] == 2
    more = _answers([10, 11])
    _write(tmp_path / "work", "answers", more, again)
    assert [e["first_id"] for e in again.live_shards() if e["kind"] == "answers"] == [0, 4, 8]
    assert CorpusStore(tmp_path / "store", Vocab()).load()[1] == answers + more


@pytest.mark.parametrize("damage", ["truncated", "checksum", "tokenizer", "missing"])
def test_a_bad_shard_is_refused_by_name_and_the_run_resumes_from_the_last_good_one(tmp_path, damage):
    store, prompts, answers = _filled(tmp_path)
    store.flush()
    folder = tmp_path / "store"
    entries = json.loads((folder / MANIFEST).read_text())["shards"]
    bad = folder / entries[3]["file"]  # the second answer shard (ids 4-7)
    if damage == "truncated":
        bad.write_bytes(bad.read_bytes()[:-10])
    elif damage == "checksum":
        raw = bytearray(bad.read_bytes())
        raw[len(raw) // 2] ^= 1
        bad.write_bytes(bytes(raw))
    elif damage == "tokenizer":  # a shard another tokenizer's store sealed, under the same name
        other = CorpusStore(tmp_path / "other", Vocab(template="another"), shard_answers=4)
        other.sync(tmp_path / "otherwork")
        _write(tmp_path / "otherwork", "prompts", _prompts(0, 8), other)
        _write(tmp_path / "otherwork", "answers", answers[4:8], other)
        forged = tmp_path / "other" / other.live_shards()[-1]["file"]
        bad.write_bytes(forged.read_bytes())
        manifest = json.loads((folder / MANIFEST).read_text())
        manifest["shards"][3].update(bytes=forged.stat().st_size,
                                     sha256=other.live_shards()[-1]["sha256"])  # fmt: skip
        (folder / MANIFEST).write_text(json.dumps(manifest))
    else:
        bad.unlink()
    kept = bad.read_bytes() if bad.exists() else None
    fresh = tmp_path / "elsewhere"
    with pytest.warns(UserWarning, match=rf"{bad.name} .*(truncated|checksum|another tokenizer|missing)"):
        summary = CorpusStore(folder, Vocab(), shard_answers=4).sync(fresh)
    assert summary["answers"] == 4 and summary["shards"] == 3  # prompts, prompts, answers 0-3
    assert read_records(fresh / ANSWERS) == answers[:4] and read_records(fresh / PROMPTS) == prompts
    manifest = json.loads((folder / MANIFEST).read_text())
    assert [("superseded" in e) for e in manifest["shards"]] == [False, False, False, True, True]
    # The run goes on: new shards take new numbers, the refused file stays as it was.
    store = CorpusStore(folder, Vocab(), shard_answers=4)
    store.sync(fresh)
    _write(fresh, "answers", answers[4:8], store)
    assert store.live_shards()[-1]["file"].startswith("00005-")
    assert (bad.read_bytes() if bad.exists() else None) == kept
    assert CorpusStore(folder, Vocab()).load()[1] == answers[:8]


def test_a_store_of_another_tokenizer_is_refused(tmp_path):
    store, _, _ = _filled(tmp_path)
    with pytest.raises(ValueError, match="another tokenizer"):
        CorpusStore(tmp_path / "store", Vocab(template="{{ other }}"))
    assert tokenizer_fingerprint(Vocab()) != tokenizer_fingerprint(Vocab(50_001))


def test_a_working_folder_that_disagrees_is_rebuilt_from_the_store(tmp_path):
    store, prompts, answers = _filled(tmp_path)
    store.flush()
    work = tmp_path / "stale"
    work.mkdir()
    corpus_module._append(work / PROMPTS, prompts[:3] + [{**prompts[3], "messages": [{"role": "user",
                                                                                      "content": "x"}]}])  # fmt: skip
    corpus_module._append(work / ANSWERS, answers[:2] + [{**answers[2], "answer": [1, 2]}])
    summary = CorpusStore(tmp_path / "store", Vocab()).sync(work)
    assert summary["rebuilt"]
    assert read_records(work / PROMPTS) == prompts and read_records(work / ANSWERS) == answers


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="shard_answers"):
        CorpusStore(tmp_path, Vocab(), shard_answers=0)
    store = CorpusStore(tmp_path / "s", Vocab())
    with pytest.raises(RuntimeError, match="sync"):
        store.add("answers", [])
    store.sync(tmp_path / "w")
    with pytest.raises(ValueError, match="kind"):
        store.add("features", [])
    with pytest.raises(ValueError, match="prompt ids must continue"):
        store.add("prompts", _prompts(3, 1))
    from treespec import cli

    assert cli.main(["train-heads", "answers", "--corpus", str(tmp_path), "--commit"]) != 0


def test_shards_are_committed_alone(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    for key, value in {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                       "GIT_COMMITTER_EMAIL": "t@t"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    git = ["git", "-C", str(repo)]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "other.txt").write_text("staged, not part of the corpus\n")
    subprocess.run([*git, "add", "other.txt"], check=True)
    store = CorpusStore(repo / "corpus", Vocab(), shard_answers=2, on_seal=commit_to_git)
    store.sync(tmp_path / "work")
    _write(tmp_path / "work", "prompts", _prompts(0, 2), store)
    _write(tmp_path / "work", "answers", _answers([0, 1]), store)
    log = subprocess.run([*git, "log", "--format=%s", "--name-only"], capture_output=True, text=True).stdout
    assert log.count("corpus: shard") == 2 and "2 answers (ids 0-1)" in log
    assert "other.txt" not in log
    staged = subprocess.run([*git, "diff", "--cached", "--name-only"], capture_output=True, text=True).stdout
    assert staged.split() == ["other.txt"]


@pytest.mark.slow
def test_the_stages_seal_what_they_write(tmp_path):
    """Prompts and answers written by the stages themselves (a tiny model reading SmolLM2's
    tokenizer) land in shards, and a fresh folder rebuilt from them is what the stages wrote."""
    from conftest import build
    from transformers import AutoTokenizer

    from treespec.heads.training.corpus import write_answers
    from treespec.models import model_path

    tokenizer = AutoTokenizer.from_pretrained(model_path("smollm2-135m-instruct"))
    model = build("llama", vocab_size=len(tokenizer))
    work = tmp_path / "work"
    store = CorpusStore(tmp_path / "store", tokenizer, shard_answers=2)
    store.sync(work)
    add_prompts(
        work, ["Name three rivers.", "Why do cats purr?", "What is rain?"], "test", on_written=store.add
    )
    config = AnswerConfig(max_new_tokens=6, batch_size=2, flush_every=1)
    write_answers(model, tokenizer, work, config, progress=False, on_written=store.add)
    store.flush()
    fresh = tmp_path / "fresh"
    CorpusStore(tmp_path / "store", tokenizer).sync(fresh)
    assert read_records(fresh / PROMPTS) == read_records(work / PROMPTS)
    key = lambda a: a["id"]  # noqa: E731
    assert sorted(read_records(fresh / ANSWERS), key=key) == sorted(read_records(work / ANSWERS), key=key)
