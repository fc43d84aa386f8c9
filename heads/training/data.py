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
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import PreTrainedModel

from treespec.api import generate

MANIFEST = "manifest.json"
FORMAT = 1


@dataclass
class Sequence:
    """One prompt and the target's answer, with the target's hidden states at every position."""

    tokens: torch.Tensor  # [n] long: prompt then answer
    prompt_len: int
    hidden: torch.Tensor  # [n, H] final normed hidden state
    features: torch.Tensor  # [n, 3H] inputs of the three EAGLE-3 layers


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
        "features": torch.cat([r.features for r in records]).contiguous(),
    }
    tmp = folder / (name + ".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, folder / name)  # a shard exists whole or not at all
    return {"file": name, "prompt_ids": prompt_ids, "tokens": sum(lengths),
            "answer_tokens": sum(lengths) - sum(r.prompt_len for r in records)}  # fmt: skip


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

    def _read(self, name: str) -> Iterator[Sequence]:
        t = load_file(str(self.folder / name))
        offsets = t["offsets"].tolist()
        for s in range(len(offsets) - 1):
            a, b = offsets[s], offsets[s + 1]
            yield Sequence(
                t["tokens"][a:b].long(), int(t["prompt_lens"][s]), t["hidden"][a:b], t["features"][a:b]
            )
