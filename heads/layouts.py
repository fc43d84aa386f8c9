"""Published checkpoint layouts, both directions.

Medusa (FasterDecoding/Medusa): a folder with ``config.json`` holding ``medusa_num_heads`` and
``medusa_num_layers`` (and ``base_model_name_or_path``), and the heads' weights in
``medusa_lm_head.safetensors`` or ``medusa_lm_head.pt``: the state dict of a ModuleList whose
entry i is ``Sequential(ResBlock x num_layers, Linear(hidden, vocab, bias=False))``, i.e. keys
``{i}.{j}.linear.weight`` / ``{i}.{j}.linear.bias`` for the blocks and ``{i}.{num_layers}.weight``
for the read-out. (The original code repeats one ResBlock object ``num_layers`` times, so its
blocks share weights; the file still holds one entry per block, and treespec loads each into its
own block.) A pickle file is read with ``torch.load(weights_only=True)`` only: loading never runs
code from it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from treespec.heads.medusa import MedusaConfig, MedusaHeads

MEDUSA_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


def is_published_medusa(folder: Path) -> bool:
    config = folder / "config.json"
    return config.is_file() and "medusa_num_heads" in json.loads(config.read_text())


def load_published_medusa(folder: str | Path) -> MedusaHeads:
    """Medusa heads from the published layout (sizes read from the weights)."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    num_heads, num_layers = int(config["medusa_num_heads"]), int(config.get("medusa_num_layers", 1))
    state = _read_weights(folder)
    readout = f"0.{num_layers}.weight"
    if readout not in state:
        raise ValueError(
            f"{folder}: no tensor {readout!r}: not a Medusa head file with {num_layers} layer(s)"
        )
    vocab_size, hidden_size = state[readout].shape
    heads = MedusaHeads(
        MedusaConfig(int(hidden_size), int(vocab_size), num_heads, num_layers, own_lm_head=True)
    )
    ours: dict[str, torch.Tensor] = {}
    missing = []
    for i in range(num_heads):
        for j in range(num_layers):
            for kind in ("weight", "bias"):
                _take(state, f"{i}.{j}.linear.{kind}", f"blocks.{i}.{j}.linear.{kind}", ours, missing)
        _take(state, f"{i}.{num_layers}.weight", f"lm_heads.{i}.weight", ours, missing)
    if missing:
        raise ValueError(f"{folder}: the Medusa checkpoint is missing tensors: {', '.join(missing)}")
    heads.load_state_dict(ours, strict=True)
    return heads.eval()


def export_published_medusa(
    heads: MedusaHeads, folder: str | Path, *, target_lm_head: nn.Module | None = None, base_model: str = ""
) -> Path:
    """Write heads in the published layout (safetensors). Heads that read out through the target's
    LM head need it here: the published layout stores a read-out per head."""
    config = heads.config
    if not config.own_lm_head and target_lm_head is None:
        raise ValueError("these heads use the target's LM head: pass target_lm_head to export them")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {}
    for i in range(config.num_heads):
        for j in range(config.num_layers):
            block = heads.blocks[i][j].linear
            state[f"{i}.{j}.linear.weight"] = block.weight.detach().clone()
            state[f"{i}.{j}.linear.bias"] = block.bias.detach().clone()
        readout = heads.lm_heads[i] if heads.lm_heads is not None else target_lm_head
        state[f"{i}.{config.num_layers}.weight"] = readout.weight.detach().clone()
    save_file(state, str(folder / MEDUSA_WEIGHTS[0]))
    meta = {"medusa_num_heads": config.num_heads, "medusa_num_layers": config.num_layers,
            "base_model_name_or_path": base_model}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(meta, indent=2))
    return folder


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    for name in MEDUSA_WEIGHTS:
        path = folder / name
        if path.is_file():
            if name.endswith(".safetensors"):
                return load_file(str(path))
            state = torch.load(path, map_location="cpu", weights_only=True)  # never unpickles code
            return {re.sub(r"^medusa_head\.", "", k): v for k, v in state.items()}
    raise ValueError(f"{folder}: no Medusa weights ({' or '.join(MEDUSA_WEIGHTS)})")


def _take(state, source: str, target: str, out: dict, missing: list) -> None:
    if source in state:
        out[target] = state[source]
    else:
        missing.append(source)
