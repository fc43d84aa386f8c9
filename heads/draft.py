"""A distilled draft model: the target's first layers, its embeddings and its LM head.

``make_draft(target, num_layers)`` builds a causal LM of the target's own class and config with
``num_layers`` decoder layers, initialised from the target's first layers, sharing (not copying)
the target's embedding table and LM head. ``save_draft`` stores only what the target does not
have (the layers and the final norm) as ``config.json`` (``"head_type": "draft"``) plus
``model.safetensors``; ``load_draft(folder, target)`` re-attaches the target's tables.
``export_draft_hf`` writes a standalone HF model folder (tables included) that HF assisted
generation, vLLM and SGLang load as a draft model.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

HEAD_TYPE = "draft"


def _shared(name: str) -> bool:
    return name.startswith(("model.embed_tokens.", "lm_head."))


def make_draft(target: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """A ``num_layers``-layer copy of the target's first layers, sharing its embeddings and LM head."""
    total = target.config.get_text_config().num_hidden_layers
    if not 1 <= num_layers < total:
        raise ValueError(f"a draft needs 1 <= num_layers < the target's {total} layers, got {num_layers}")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    # on the target's device: its layers run beside the tables it shares (a GPU target's included)
    draft = AutoModelForCausalLM.from_config(config, dtype=target.dtype).to(target.device)
    state = {k: v for k, v in target.state_dict().items() if k in draft.state_dict() and not _shared(k)}
    draft.load_state_dict(state, strict=False)
    _share_tables(draft, target)
    return draft.eval()


def _share_tables(draft: PreTrainedModel, target: PreTrainedModel) -> None:
    draft.set_input_embeddings(target.get_input_embeddings())
    draft.set_output_embeddings(target.get_output_embeddings())


def save_draft(draft: PreTrainedModel, folder: str | Path, *, dtype: torch.dtype = torch.bfloat16) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).contiguous() for k, v in draft.state_dict().items() if not _shared(k)}
    save_file(state, str(folder / "model.safetensors"))
    meta = {"head_type": HEAD_TYPE, "num_layers": draft.config.get_text_config().num_hidden_layers,
            "target_model_type": draft.config.model_type,
            "hidden_size": draft.config.get_text_config().hidden_size,
            "vocab_size": draft.get_output_embeddings().weight.shape[0]}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(meta, indent=2))
    return folder


def load_draft(folder: str | Path, target: PreTrainedModel) -> PreTrainedModel:
    folder = Path(folder)
    meta = json.loads((folder / "config.json").read_text())
    if meta.get("head_type") != HEAD_TYPE:
        raise ValueError(f"{folder} does not hold a treespec draft (head_type {HEAD_TYPE!r})")
    hidden = target.config.get_text_config().hidden_size
    vocab = target.get_output_embeddings().weight.shape[0]
    if (meta["hidden_size"], meta["vocab_size"]) != (hidden, vocab):
        raise ValueError(
            f"{folder} was distilled for hidden size {meta['hidden_size']} and vocabulary {meta['vocab_size']}; "
            f"the target has {hidden} and {vocab}"
        )
    draft = make_draft(target, int(meta["num_layers"]))
    state = load_file(str(folder / "model.safetensors"))
    expected = {k for k in draft.state_dict() if not _shared(k)}
    missing = sorted(expected - set(state))
    if missing:
        raise ValueError(f"{folder}/model.safetensors is missing tensors: {', '.join(missing)}")
    draft.load_state_dict({k: v.to(target.dtype) for k, v in state.items()}, strict=False)
    _share_tables(draft, target)
    return draft.eval()


def export_draft_hf(draft: PreTrainedModel, folder: str | Path, tokenizer=None) -> Path:
    """A standalone HF model folder (``save_pretrained``, tables included) for HF assisted
    generation, vLLM or SGLang."""
    folder = Path(folder)
    standalone = copy.deepcopy(draft)
    standalone.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder
