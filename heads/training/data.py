"""Self-distilled training data: the target's own answers and its hidden states, in shards.

:func:`write_dataset` has the target answer prompts through treespec's batched engine (greedy,
chat template applied by the caller), then runs the target once over each prompt + answer to
collect, per position, its final normed hidden state (``hidden`` [n, H]) and the inputs of the
three layers EAGLE-3 fuses (``features`` [n, 3H]). Sequences are written as safetensors shards;
``manifest.json`` lists the finished shards and describes the target, so that:

- a killed run resumes at the first prompt no finished shard holds (at most one shard is redone);
- a reader refuses data written by another target (hidden size or vocabulary, both named).

Shard layout (``shard_00000.safetensors``): ``tokens`` [N] int32 (all sequences back to back),
``offsets`` [S+1] int64, ``prompt_lens`` [S] int64, ``prompt_ids`` [S] int64 (index in the
prompt list), ``hidden`` [N, H] and ``features`` [N, 3H] in bf16.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import PreTrainedModel

from treespec.api import generate
from treespec.presets import ANSWER_SELECTIONS, DEFAULT_MAX_LEN

MANIFEST = "manifest.json"
FORMAT = 1


@dataclass
class Sequence:
    """One prompt and the target's answer, with the target's hidden states at every position."""

    tokens: torch.Tensor  # [n] long: prompt then answer
    prompt_len: int
    hidden: torch.Tensor  # [n, H] final normed hidden state
    features: torch.Tensor | None  # [n, 3H] inputs of the three EAGLE-3 layers (None: not stored)


def target_description(model: PreTrainedModel, feature_layers: tuple[int, ...]) -> dict:
    config = model.config.get_text_config()
    return {
        "model_type": config.model_type,
        "hidden_size": config.hidden_size,
        "vocab_size": model.get_output_embeddings().weight.shape[0],
        "num_layers": config.num_hidden_layers,
        "feature_layers": list(feature_layers),
    }


def write_dataset(
    model: PreTrainedModel,
    prompts: list[list[int]],
    folder: str | Path,
    *,
    feature_layers: tuple[int, int, int],
    max_new_tokens: int = 128,
    batch_size: int = 8,
    shard_size: int = 32,
    eos_token_id: int | list[int] | None = None,
    progress: bool = True,
) -> dict:
    """Generate (or finish generating) the dataset in ``folder``; returns the manifest."""
    if not prompts:
        raise ValueError("no prompts to answer: the prompt list is empty")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("an encoded prompt is empty")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    described = target_description(model, tuple(feature_layers))
    manifest = _read_manifest(folder)
    if manifest is None:
        manifest = {"format": FORMAT, "target": described, "num_prompts": len(prompts),
                    "max_new_tokens": max_new_tokens, "shards": []}  # fmt: skip
    else:
        check_target(manifest, model, folder)
        if manifest["num_prompts"] != len(prompts):
            raise ValueError(
                f"{folder} was started with {manifest['num_prompts']} prompts, now {len(prompts)} are given"
            )
    done = sum(len(s["prompt_ids"]) for s in manifest["shards"])
    bar = tqdm(total=len(prompts), initial=done, desc="distilling", unit="prompt", disable=not progress)
    start, new_tokens = time.perf_counter(), 0
    while done < len(prompts):
        ids = list(range(done, min(done + shard_size, len(prompts))))
        records: list[Sequence] = []
        for first in range(0, len(ids), batch_size):
            chunk = ids[first : first + batch_size]
            out = generate(
                model, [prompts[i] for i in chunk], max_new_tokens=max_new_tokens, eos_token_id=eos_token_id
            )
            for i, answer in zip(chunk, out.sequences, strict=True):
                records.append(_with_hidden_states(model, prompts[i], answer, feature_layers))
                new_tokens += len(answer)
            bar.update(len(chunk))
            bar.set_postfix(tok_per_s=f"{new_tokens / (time.perf_counter() - start):.1f}")
        manifest["shards"].append(_write_shard(folder, len(manifest["shards"]), ids, records))
        _write_manifest(folder, manifest)
        done = ids[-1] + 1
    bar.close()
    return manifest


@torch.inference_mode()
def _with_hidden_states(model, prompt: list[int], answer: list[int], feature_layers) -> Sequence:
    tokens = torch.tensor(prompt + answer)
    out = model(tokens[None].to(model.device), output_hidden_states=True, use_cache=False)
    states = out.hidden_states
    return Sequence(
        tokens=tokens,
        prompt_len=len(prompt),
        hidden=states[-1][0].to(torch.bfloat16).cpu(),
        features=torch.cat([states[i][0] for i in feature_layers], -1).to(torch.bfloat16).cpu(),
    )


def _write_shard(folder: Path, index: int, prompt_ids: list[int], records: list[Sequence]) -> dict:
    name = f"shard_{index:05d}.safetensors"
    lengths = [len(r.tokens) for r in records]
    tensors = {
        "tokens": torch.cat([r.tokens for r in records]).to(torch.int32),
        "offsets": torch.tensor([0, *lengths]).cumsum(0),
        "prompt_lens": torch.tensor([r.prompt_len for r in records]),
        "prompt_ids": torch.tensor(prompt_ids),
        "hidden": torch.cat([r.hidden for r in records]).contiguous(),
    }
    if records[0].features is not None:
        tensors["features"] = torch.cat([r.features for r in records]).contiguous()
    need = sum(t.numel() * t.element_size() for t in tensors.values())
    check_free_space(folder, need)
    tmp = folder / (name + ".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, folder / name)  # a shard exists whole or not at all
    return {"file": name, "prompt_ids": prompt_ids, "tokens": sum(lengths),
            "answer_tokens": sum(lengths) - sum(r.prompt_len for r in records)}  # fmt: skip


def check_free_space(folder: Path, need: int) -> None:
    """Raise OSError before writing ``need`` bytes when the disk cannot hold them (with a margin):
    a shard is never left half-written by a full disk."""
    free = shutil.disk_usage(folder).free
    if free < need * 1.1 + (64 << 20):
        raise OSError(
            f"not enough disk space in {folder}: the next shard needs {need / 2**20:.0f} MB and "
            f"{free / 2**20:.0f} MB are free; free some space and run the same command again to resume"
        )


def _read_manifest(folder: Path) -> dict | None:
    path = folder / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


def _write_manifest(folder: Path, manifest: dict) -> None:
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, folder / MANIFEST)


def check_target(manifest: dict, model: PreTrainedModel, folder: Path | str) -> None:
    """Raise ValueError when the data was written by a target of another size."""
    wrote = manifest["target"]
    here = target_description(model, tuple(wrote["feature_layers"]))
    for key, what in (("hidden_size", "hidden size"), ("vocab_size", "vocabulary")):
        if wrote[key] != here[key]:
            raise ValueError(
                f"{folder} was written by a target with {what} {wrote[key]}; this target has {here[key]}"
            )


class HeadDataset:
    """Reads a folder written by :func:`write_dataset`: one :class:`Sequence` per prompt."""

    def __init__(self, folder: str | Path, model: PreTrainedModel | None = None) -> None:
        self.folder = Path(folder)
        manifest = _read_manifest(self.folder)
        if manifest is None:
            raise ValueError(f"{self.folder} holds no head training data (no {MANIFEST})")
        if not manifest["shards"]:
            raise ValueError(f"{self.folder} holds no finished shard yet")
        if model is not None:
            check_target(manifest, model, self.folder)
        self.manifest = manifest
        self.feature_layers = tuple(manifest["target"]["feature_layers"])

    @property
    def num_tokens(self) -> int:
        return sum(s["tokens"] for s in self.manifest["shards"])

    def __iter__(self) -> Iterator[Sequence]:
        for shard in self.manifest["shards"]:
            yield from self._read(shard["file"])

    def sequences(self) -> list[Sequence]:
        return list(self)

    @property
    def has_features(self) -> bool:
        """Whether the shards hold EAGLE-3's three-layer features (``features`` stage option)."""
        return self.manifest.get("features", True)

    def _read(self, name: str) -> Iterator[Sequence]:
        path = self.folder / name
        try:
            t = mapped_tensors(path)
        except (SafetensorError, OSError, ValueError) as exc:
            raise ValueError(
                f"{path} cannot be read ({exc}); the shard is corrupt or truncated: delete it and "
                "its entry in manifest.json, then run the data stage again to rewrite it"
            ) from None
        offsets = t["offsets"].tolist()
        if "hidden" not in t or offsets[-1] != len(t["tokens"]) or len(t["hidden"]) != len(t["tokens"]):
            raise ValueError(
                f"{path} is inconsistent (offsets, tokens and hidden states disagree): corrupt shard"
            )
        features = t.get("features")
        for s in range(len(offsets) - 1):
            a, b = offsets[s], offsets[s + 1]
            yield Sequence(
                t["tokens"][a:b].long(), int(t["prompt_lens"][s]), t["hidden"][a:b],
                None if features is None else features[a:b],
            )  # fmt: skip


SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I64": torch.int64,
                      "I32": torch.int32, "I16": torch.int16, "U16": torch.uint16, "U8": torch.uint8}  # fmt: skip


def mapped_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors as views of the file mapped into memory (private, read on
    touch): a data folder larger than the machine's memory trains on the sequences it picks
    without reading the others. Falls back to reading the file where a tensor is not aligned to
    its element size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if not 0 < length <= size - 8:
            raise ValueError(f"header of {length} bytes in a file of {size}")
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    start = 8 + length
    if any(start + e["data_offsets"][1] > size for e in header.values()):
        raise ValueError(f"the header describes more data than the file's {size} bytes hold")
    dtypes = {name: SAFETENSORS_DTYPES.get(e["dtype"]) for name, e in header.items()}
    aligned = all(d is not None and (start + e["data_offsets"][0]) % d.itemsize == 0
                  for d, e in zip(dtypes.values(), header.values(), strict=True))  # fmt: skip
    if not aligned:
        return load_file(str(path))
    storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)
    tensors = {}
    for name, entry in header.items():
        dtype = dtypes[name]
        offset = (start + entry["data_offsets"][0]) // dtype.itemsize
        tensors[name] = torch.empty(0, dtype=dtype).set_(storage, offset, tuple(entry["shape"]))
    return tensors


# --------------------------------------------------------------------------------------------
# Features from stored token sequences (the scalable path: corpus.write_answers, then this)
# --------------------------------------------------------------------------------------------


def select_answers(answers: list[dict], selection: str) -> list[dict]:
    """The answer records whose sequences a data folder holds: ``all``, only the ``greedy`` ones
    (answered at temperature 0) or only the ``sampled`` ones, by the temperature each record
    stores (a record without one was answered greedily)."""
    if selection not in ANSWER_SELECTIONS:
        raise ValueError(f"answers must be one of {', '.join(ANSWER_SELECTIONS)}, got {selection!r}")
    if selection == "all":
        return answers
    sampled = selection == "sampled"
    return [a for a in answers if (a.get("temperature", 0.0) > 0) == sampled]


def _features_manifest(
    folder: Path, model: PreTrainedModel, feature_layers, eagle3: bool, selection: str
) -> dict:
    """The folder's manifest, new or resumed; a folder written by another target, with the
    other EAGLE-3 choice, in another dtype or of another answer selection is refused by name."""
    described = target_description(model, tuple(feature_layers))
    manifest = _read_manifest(folder)
    dtype = str(model.dtype).removeprefix("torch.")
    if manifest is None:
        manifest = {
            "format": FORMAT,
            "target": described,
            "target_dtype": dtype,
            "features": eagle3,
            "source": "answers",
            "answers": selection,
            "shards": [],
        }
    else:
        check_target(manifest, model, folder)
        if manifest.get("features", True) != eagle3:
            raise ValueError(f"{folder} was written {'with' if manifest.get('features', True) else 'without'} "
                             f"EAGLE-3 features; pass the same choice to resume, or use another folder")  # fmt: skip
        if manifest.get("target_dtype", "float32") != dtype:
            raise ValueError(f"{folder} holds features of a {manifest.get('target_dtype', 'float32')} target; "
                             f"this target runs in {dtype}: pass the same --dtype to resume, or use another folder")  # fmt: skip
        if manifest.get("answers", "all") != selection:
            raise ValueError(f"{folder} holds the features of {manifest.get('answers', 'all')} answers, not {selection}: "
                             f"pass the same --answers to resume, or use another folder")  # fmt: skip
    return manifest


def write_features(
    model: PreTrainedModel,
    answers: list[dict],
    folder: str | Path,
    *,
    feature_layers: tuple[int, int, int],
    eagle3: bool = False,
    answers_selection: str = "all",
    batch_tokens: int = 4096,
    shard_tokens: int = 65536,
    max_len: int = DEFAULT_MAX_LEN,
    progress: bool = True,
) -> dict:
    """Teacher-forced forwards over stored sequences (``corpus.write_answers`` records: ``id``,
    ``prompt`` and ``answer`` token ids) into shards of ``folder``; returns the manifest.

    Only what the heads need is kept: the final hidden state always (EAGLE-1, Medusa, the draft's
    distillation target), the three EAGLE-3 layers only with ``eagle3``. Records a finished shard
    holds are skipped, so the stage resumes after a kill and grows with the answers file. Sequences
    of similar length run together, padded, ``batch_tokens`` positions per forward.
    ``answers_selection`` (``select_answers``) keeps only the greedy or only the sampled answers,
    and is recorded: a folder is never resumed with another."""
    answers = select_answers(answers, answers_selection)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    manifest = _features_manifest(folder, model, feature_layers, eagle3, answers_selection)
    done = {i for shard in manifest["shards"] for i in shard["prompt_ids"]}
    todo = [a for a in answers if a["id"] not in done and a["answer"]]
    todo = [a for a in todo if len(a["prompt"]) + len(a["answer"]) <= max_len]
    bar = tqdm(total=sum(len(a["prompt"]) + len(a["answer"]) for a in todo), desc="features", unit="tok",
               smoothing=0, disable=not progress)  # fmt: skip
    start, count = time.perf_counter(), 0
    while todo:
        shard, size = [], 0
        while todo and (not shard or size + len(todo[0]["prompt"]) + len(todo[0]["answer"]) <= shard_tokens):
            shard.append(todo.pop(0))
            size += len(shard[-1]["prompt"]) + len(shard[-1]["answer"])
        records = _teacher_forced(model, shard, feature_layers, eagle3, batch_tokens)
        manifest["shards"].append(
            _write_shard(folder, len(manifest["shards"]), [a["id"] for a in shard], records)
        )
        _write_manifest(folder, manifest)
        count += size
        bar.update(size)
        bar.set_postfix(tok_per_s=f"{count / (time.perf_counter() - start):.0f}")
    bar.close()
    return manifest


@torch.inference_mode()
def _teacher_forced(
    model, answers: list[dict], feature_layers, eagle3: bool, batch_tokens: int
) -> list[Sequence]:
    order = sorted(range(len(answers)), key=lambda i: len(answers[i]["prompt"]) + len(answers[i]["answer"]))
    out: list[Sequence | None] = [None] * len(answers)
    first = 0
    while first < len(order):
        width = len(answers[order[first]]["prompt"]) + len(answers[order[first]]["answer"])
        last = first + 1
        while last < len(order):  # sorted by length: the last one sets the padded width
            n = len(answers[order[last]]["prompt"]) + len(answers[order[last]]["answer"])
            if (last - first + 1) * n > batch_tokens:
                break
            width, last = n, last + 1
        group = [answers[i] for i in order[first:last]]
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for row, a in enumerate(group):
            seq = a["prompt"] + a["answer"]
            ids[row, : len(seq)], mask[row, : len(seq)] = torch.tensor(seq), 1
        states = model(ids.to(model.device), attention_mask=mask.to(model.device), output_hidden_states=True,
                       use_cache=False, logits_to_keep=1).hidden_states  # fmt: skip
        for row, (i, a) in enumerate(zip(order[first:last], group, strict=True)):
            n = len(a["prompt"]) + len(a["answer"])
            out[i] = Sequence(
                tokens=torch.tensor(a["prompt"] + a["answer"]),
                prompt_len=len(a["prompt"]),
                hidden=states[-1][row, :n].to(torch.bfloat16).cpu(),
                features=torch.cat([states[j][row, :n] for j in feature_layers], -1).to(torch.bfloat16).cpu()
                if eagle3 else None,
            )  # fmt: skip
        first = last
    return out
