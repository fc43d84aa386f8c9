"""The corpus kept in the repository: compact shards that outlive the machine that wrote them.

The stages of :mod:`corpus` append to a working folder (``prompts.jsonl``, ``answers.jsonl``,
``state.json``) that lives as long as its machine. A :class:`CorpusStore` seals what they wrote,
as they write it, into numbered shards in a folder kept under version control:

- ``NNNNN-prompts.jsonl.xz``: prompt records (their text, as the working file holds them);
- ``NNNNN-answers.safetensors.xz``: answer records as token ids (uint16 when the vocabulary
  fits), with their ids, prompt lengths, finish reasons and temperatures;
- ``manifest.json``: per shard its kind, record count, ids, answer tokens, size and SHA-256, and
  for a prompt shard the Magpie stage's state when it was sealed (so its rounds resume there).

Shards form one sequence in the order they were sealed. :meth:`CorpusStore.sync` reads them in
that order and refuses, by name, the first one that is missing, truncated, fails its checksum or
was written for another tokenizer; that shard and every later one are marked superseded in the
manifest, and the corpus resumes as it stood after the last good shard. No shard file is ever
rewritten: new shards take the next free number. Features are recomputed from the records
(``treespec train-heads features``) and never stored here.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import re
import subprocess
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from treespec.heads.training.corpus import ANSWERS, PROMPTS, STATE, _append, _write_json, read_records

FORMAT = "treespec-corpus/1"
MANIFEST = "manifest.json"
SHARD_ANSWERS = 500  # answers per shard: ~100 k answer tokens, a few minutes of the answer stage
_NAME = re.compile(r"^(\d{5})-(prompts|answers)\.")
_SUFFIX = {"prompts": "prompts.jsonl.xz", "answers": "answers.safetensors.xz"}


class ShardError(ValueError):
    """A shard that cannot be used; the message names its file and why."""


def tokenizer_fingerprint(tokenizer) -> dict:
    """What a shard's token ids mean: the vocabulary (every token and its id) and the chat
    template, hashed, with the vocabulary's size."""
    digest = hashlib.sha256()
    for token, index in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
        digest.update(f"{index}\t{token}\n".encode())
    digest.update((getattr(tokenizer, "chat_template", None) or "").encode())
    return {"vocab_size": len(tokenizer), "sha256": digest.hexdigest()[:16]}


class CorpusStore:
    """The shards of one corpus in ``folder``, for one tokenizer.

    Call :meth:`sync` with the working folder first; then :meth:`add` after each durable append
    of the stages (their ``on_written`` hook) and :meth:`flush` at the end of a stage.
    ``on_seal(paths, message)`` runs after each shard is sealed (``commit_to_git`` commits it).
    """

    def __init__(self, folder: str | Path, tokenizer, *, shard_answers: int = SHARD_ANSWERS,
                 on_seal: Callable[[list[Path], str], None] | None = None) -> None:  # fmt: skip
        if shard_answers < 1:
            raise ValueError(f"shard_answers must be >= 1, got {shard_answers}")
        self.folder = Path(folder)
        self.fingerprint = tokenizer_fingerprint(tokenizer)
        self.token_dtype = torch.uint16 if self.fingerprint["vocab_size"] <= 2**16 else torch.int32
        self.shard_answers, self.on_seal = shard_answers, on_seal
        self.manifest = self._read_manifest()
        self.work: Path | None = None
        self.pending: dict[str, list[dict]] = {"prompts": [], "answers": []}
        self.stored_prompts = 0

    # ----------------------------------------------------------------------------------------
    # Reading
    # ----------------------------------------------------------------------------------------

    def _read_manifest(self) -> dict:
        path = self.folder / MANIFEST
        if not path.is_file():
            return {"format": FORMAT, "tokenizer": self.fingerprint, "shards": []}
        manifest = json.loads(path.read_text())
        if manifest.get("format") != FORMAT:
            raise ValueError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
        if manifest["tokenizer"] != self.fingerprint:
            raise ValueError(
                f"{path}: the corpus was written for another tokenizer ({manifest['tokenizer']}); this "
                f"model's is {self.fingerprint}. Point the store at this model's corpus"
            )
        return manifest

    def live_shards(self) -> list[dict]:
        return [entry for entry in self.manifest["shards"] if "superseded" not in entry]

    def load(self) -> tuple[list[dict], list[dict], dict | None]:
        """(prompt records, answer records, the Magpie state) of the shards up to the first bad
        one; a bad shard is refused by name (a warning) and it and every later shard are marked
        superseded in the manifest."""
        prompts, answers, magpie = [], [], None
        live = self.live_shards()
        for position, entry in enumerate(live):
            try:
                records = self.read_shard(entry)
            except ShardError as exc:
                warnings.warn(f"{exc}; the corpus resumes from the shard before it", stacklevel=2)
                for later in live[position:]:
                    later["superseded"] = str(exc) if later is entry else f"after {entry['file']}"
                self._write_manifest()
                break
            if entry["kind"] == "prompts":
                prompts += records
                magpie = entry.get("magpie", magpie)
            else:
                answers += records
        return prompts, answers, magpie

    def read_shard(self, entry: dict) -> list[dict]:
        """The records of one shard, checked against its manifest entry; ShardError names it."""
        path = self.folder / entry["file"]
        if not path.is_file():
            raise ShardError(f"corpus shard {path} is missing")
        raw = path.read_bytes()
        if len(raw) != entry["bytes"]:
            raise ShardError(f"corpus shard {path} is truncated: {len(raw)} of {entry['bytes']} bytes")
        if hashlib.sha256(raw).hexdigest() != entry["sha256"]:
            raise ShardError(f"corpus shard {path} fails its checksum (SHA-256 differs from the manifest's)")
        try:
            body = lzma.decompress(raw)
        except lzma.LZMAError as exc:
            raise ShardError(f"corpus shard {path} is not a complete xz stream ({exc})") from None
        header, records = (_unpack_prompts if entry["kind"] == "prompts" else _unpack_answers)(body, path)
        if header.get("tokenizer") != self.fingerprint:
            raise ShardError(
                f"corpus shard {path} belongs to another tokenizer ({header.get('tokenizer')}; "
                f"this corpus: {self.fingerprint})"
            )
        if len(records) != entry["records"]:
            raise ShardError(
                f"corpus shard {path} holds {len(records)} records, the manifest {entry['records']}"
            )
        return records

    # ----------------------------------------------------------------------------------------
    # The working folder
    # ----------------------------------------------------------------------------------------

    def sync(self, work: str | Path) -> dict:
        """Make the working folder hold the store's records, and remember what it holds beyond
        them (sealed by the next :meth:`add` or :meth:`flush`). A working folder that agrees with
        the store and is ahead of it is kept; one that is behind or disagrees is rewritten from
        the store (its answers to prompts both agree on are kept). Returns a summary."""
        self.work = Path(work)
        self.work.mkdir(parents=True, exist_ok=True)
        prompts, answers, magpie = self.load()
        work_prompts = read_records(self.work / PROMPTS)
        agreed = _common_prefix(work_prompts, prompts)
        rebuilt = agreed < len(prompts)
        if rebuilt:
            _rewrite(self.work / PROMPTS, prompts)
            state = {"magpie": magpie} if magpie is not None else {}
            _write_json(self.work / STATE, state)
            work_prompts = prompts
        stored = {a["id"]: a for a in answers}
        work_answers = read_records(self.work / ANSWERS)
        limit = agreed if rebuilt else len(work_prompts)  # answers to prompts both sides agree on
        extra = [a for a in work_answers if a["id"] not in stored and a["id"] < limit]
        clashes = [
            a["id"] for a in work_answers if a["id"] in stored and not _same_answer(a, stored[a["id"]])
        ]
        if clashes or len(extra) + len(stored) != len(work_answers):
            _rewrite(self.work / ANSWERS, answers + extra)
            rebuilt = True
        self.stored_prompts = len(prompts)
        self.pending = {"prompts": work_prompts[len(prompts) :], "answers": extra}
        return {"shards": len(self.live_shards()), "prompts": len(prompts), "answers": len(answers),
                "answer_tokens": sum(len(a["answer"]) for a in answers), "rebuilt": rebuilt,
                "pending_prompts": len(self.pending["prompts"]), "pending_answers": len(extra)}  # fmt: skip

    def add(self, kind: str, records: list[dict]) -> list[Path]:
        """Records the stages just appended to the working folder. Prompts are sealed at once
        (a stage appends them a round at a time); answers once ``shard_answers`` are pending."""
        if self.work is None:
            raise RuntimeError("CorpusStore.sync(work) must run before add()")
        if kind not in self.pending:
            raise ValueError(f"kind must be 'prompts' or 'answers', got {kind!r}")
        self.pending[kind] += records
        if kind == "prompts":
            return self._seal("prompts", len(self.pending["prompts"]))
        sealed = []
        while len(self.pending["answers"]) >= self.shard_answers:
            sealed += self._seal("answers", self.shard_answers)
        return sealed

    def flush(self) -> list[Path]:
        """Seal everything pending (the end of a stage)."""
        return self._seal("prompts", len(self.pending["prompts"])) + self._seal(
            "answers", len(self.pending["answers"])
        )

    # ----------------------------------------------------------------------------------------
    # Writing
    # ----------------------------------------------------------------------------------------

    def _seal(self, kind: str, count: int) -> list[Path]:
        records = self.pending[kind][:count]
        if not records:
            return []
        if kind == "prompts" and records[0]["id"] != self.stored_prompts:
            raise ValueError(
                f"prompt ids must continue the store's: the next is {self.stored_prompts}, got {records[0]['id']}"
            )
        entry = {"file": f"{self._next_index():05d}-{_SUFFIX[kind]}", "kind": kind, "records": len(records),
                 "first_id": records[0]["id"], "last_id": records[-1]["id"]}  # fmt: skip
        if kind == "prompts":
            blob = _pack_prompts(records, self.fingerprint)
            state_path = self.work / STATE
            state = json.loads(state_path.read_text()) if state_path.is_file() else {}
            if "magpie" in state:
                entry["magpie"] = state["magpie"]
            self.stored_prompts += len(records)
        else:
            blob = _pack_answers(records, self.fingerprint, self.token_dtype)
            entry["answer_tokens"] = sum(len(r["answer"]) for r in records)
        raw = lzma.compress(blob, preset=9 | lzma.PRESET_EXTREME)
        entry.update(bytes=len(raw), sha256=hashlib.sha256(raw).hexdigest())
        path = self.folder / entry["file"]
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self.manifest["shards"].append(entry)
        self._write_manifest()
        self.pending[kind] = self.pending[kind][count:]
        if self.on_seal is not None:
            self.on_seal([path, self.folder / MANIFEST], self._message(entry))
        return [path]

    def _next_index(self) -> int:
        taken = [int(m.group(1)) for p in self.folder.glob("*") if (m := _NAME.match(p.name))]
        taken += [int(e["file"][:5]) for e in self.manifest["shards"]]
        return max(taken, default=-1) + 1

    def _write_manifest(self) -> None:
        live = self.live_shards()
        self.manifest["totals"] = {
            "shards": len(live),
            "prompts": sum(e["records"] for e in live if e["kind"] == "prompts"),
            "answers": sum(e["records"] for e in live if e["kind"] == "answers"),
            "answer_tokens": sum(e.get("answer_tokens", 0) for e in live),
            "bytes": sum(e["bytes"] for e in live),
        }
        self.folder.mkdir(parents=True, exist_ok=True)
        _write_json(self.folder / MANIFEST, self.manifest)

    def _message(self, entry: dict) -> str:
        totals = self.manifest["totals"]
        what = f"{entry['records']} {entry['kind']} (ids {entry['first_id']}-{entry['last_id']})"
        return (f"corpus: shard {entry['file']}, {what}; the corpus now holds {totals['prompts']} prompts, "
                f"{totals['answers']} answers, {totals['answer_tokens']} answer tokens")  # fmt: skip


def commit_to_git(paths: list[Path], message: str, *, attempts: int = 5) -> bool:
    """Commit ``paths`` (and only them: other staged changes stay staged) to the repository
    that holds them; retried while another git process holds the index. Returns whether it
    committed; a failure is a warning (the shard is on disk, and the next commit takes it)."""
    cwd = paths[0].parent
    error = ""
    for attempt in range(attempts):
        added = subprocess.run(
            ["git", "add", "--", *map(str, paths)], cwd=cwd, capture_output=True, text=True
        )
        done = added.returncode == 0 and subprocess.run(
            ["git", "commit", "-q", "-m", message, "--", *map(str, paths)],
            cwd=cwd,
            capture_output=True,
            text=True,
        )
        if done and done.returncode == 0:
            return True
        error = (added.stderr if added.returncode else done.stderr + done.stdout).strip()
        time.sleep(1 + attempt)
    warnings.warn(f"could not commit {', '.join(map(str, paths))}: {error}", stacklevel=2)
    return False


# --------------------------------------------------------------------------------------------
# Shard bodies
# --------------------------------------------------------------------------------------------


def _pack_prompts(records: list[dict], fingerprint: dict) -> bytes:
    header = {"format": FORMAT, "kind": "prompts", "tokenizer": fingerprint}
    lines = [json.dumps(header)] + [json.dumps(r, ensure_ascii=False) for r in records]
    return ("\n".join(lines) + "\n").encode()


def _unpack_prompts(body: bytes, path: Path) -> tuple[dict, list[dict]]:
    try:
        lines = body.decode().splitlines()
        return json.loads(lines[0]), [json.loads(line) for line in lines[1:]]
    except (UnicodeDecodeError, json.JSONDecodeError, IndexError) as exc:
        raise ShardError(f"corpus shard {path} does not hold prompt records ({exc})") from None


def _pack_answers(records: list[dict], fingerprint: dict, dtype: torch.dtype) -> bytes:
    flat = torch.tensor([t for r in records for t in (*r["prompt"], *r["answer"])], dtype=torch.int64)
    if flat.numel() and (flat.min() < 0 or flat.max() >= fingerprint["vocab_size"]):
        raise ValueError(f"token ids outside the vocabulary of {fingerprint['vocab_size']}")
    tensors = {
        "ids": torch.tensor([r["id"] for r in records], dtype=torch.int64),
        "prompt_lens": torch.tensor([len(r["prompt"]) for r in records], dtype=torch.int32),
        "answer_lens": torch.tensor([len(r["answer"]) for r in records], dtype=torch.int32),
        "temperature": torch.tensor([float(r["temperature"]) for r in records], dtype=torch.float64),
        "tokens": flat.to(dtype),
    }
    finish = sorted({r["finish"] for r in records})
    tensors["finish"] = torch.tensor([finish.index(r["finish"]) for r in records], dtype=torch.uint8)
    metadata = {"format": FORMAT, "kind": "answers", "tokenizer": json.dumps(fingerprint),
                "finish": json.dumps(finish)}  # fmt: skip
    return save_tensors(tensors, metadata=metadata)


def _unpack_answers(body: bytes, path: Path) -> tuple[dict, list[dict]]:
    try:
        tensors = load_tensors(body)
        with_meta = _safetensors_metadata(body)
        header = {"tokenizer": json.loads(with_meta["tokenizer"])}
        finish = json.loads(with_meta["finish"])
    except (SafetensorError, KeyError, json.JSONDecodeError, ValueError) as exc:
        raise ShardError(f"corpus shard {path} does not hold answer records ({exc})") from None
    tokens = tensors["tokens"].to(torch.int64).tolist()
    records, start = [], 0
    for i, (prompt_len, answer_len) in enumerate(
        zip(tensors["prompt_lens"].tolist(), tensors["answer_lens"].tolist(), strict=True)
    ):
        middle, end = start + prompt_len, start + prompt_len + answer_len
        records.append({"id": int(tensors["ids"][i]), "prompt": tokens[start:middle], "answer": tokens[middle:end],
                        "finish": finish[int(tensors["finish"][i])],
                        "temperature": float(tensors["temperature"][i])})  # fmt: skip
        start = end
    if start != len(tokens):
        raise ShardError(f"corpus shard {path}: its lengths cover {start} of {len(tokens)} tokens")
    return header, records


def _safetensors_metadata(body: bytes) -> dict:
    size = int.from_bytes(body[:8], "little")
    return json.loads(body[8 : 8 + size]).get("__metadata__", {})


def _common_prefix(work: list[dict], stored: list[dict]) -> int:
    """How many leading records the working folder and the store share (same id, same messages)."""
    count = 0
    for a, b in zip(work, stored, strict=False):
        if a["id"] != b["id"] or a["messages"] != b["messages"]:
            break
        count += 1
    return count


def _same_answer(a: dict, b: dict) -> bool:
    return a["prompt"] == b["prompt"] and a["answer"] == b["answer"] and a["finish"] == b["finish"]


def _rewrite(path: Path, records: list[dict]) -> None:
    tmp = path.with_name(path.name + ".rewrite")
    tmp.unlink(missing_ok=True)
    _append(tmp, records)
    os.replace(tmp, path)
