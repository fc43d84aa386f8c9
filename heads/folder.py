"""treespec's head folder: ``config.json`` (with ``head_type``) and ``model.safetensors``."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

CONFIG, WEIGHTS = "config.json", "model.safetensors"


def write_folder(folder: str | Path, config: dict, state: dict[str, torch.Tensor]) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG).write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / WEIGHTS))
    return folder


def read_folder(folder: str | Path, head_type: str, what: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """The config (``head_type`` removed) and the tensors; refuses a folder of another type."""
    folder = Path(folder)
    config = json.loads((folder / CONFIG).read_text())
    if config.pop("head_type", None) != head_type:
        raise ValueError(f"{folder}/{CONFIG} does not describe {what} (head_type {head_type!r})")
    return config, load_file(str(folder / WEIGHTS))
