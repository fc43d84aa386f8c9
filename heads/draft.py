"""A distilled draft model: the target's first layers, its embeddings and its LM head.

``make_draft(target, num_layers)`` builds a causal LM of the target's own class and config with
``num_layers`` decoder layers, initialised from the target's first layers, sharing (not copying)
the target's embedding table and LM head. ``save_draft`` stores only what the target does not
have (the layers and the final norm) as ``config.json`` (``"head_type": "draft"``) plus
``model.safetensors``; ``load_draft(folder, target)`` re-attaches the target's tables.
``export_draft_hf`` writes a standalone HF model folder (tables included) that HF assisted
generation, vLLM and SGLang load as a draft model.

A draft may carry its own read-out ids (``set_readout_ids``: the rows of the LM head it was
trained to rank, e.g. the data's most frequent tokens); they are saved and loaded with it, and
the proposer drafts through them unless told otherwise.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

HEAD_TYPE = "draft"
READOUT_IDS = "readout_ids"  # the buffer (and tensor in model.safetensors) of a draft's own read-out ids


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


def readout_ids(draft: PreTrainedModel) -> torch.Tensor | None:
    """The read-out ids the draft carries (sorted, long), or None: it ranks every row."""
    return getattr(draft, READOUT_IDS, None)


def set_readout_ids(draft: PreTrainedModel, ids: torch.Tensor) -> None:
    """Make the draft carry ``ids`` (distinct token ids of its vocabulary) as its read-out rows."""
    vocab = draft.get_output_embeddings().weight.shape[0]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype.is_floating_point or ids.is_complex():
        raise TypeError(f"read-out ids must be a 1-D integer tensor, got {ids!r:.80}")
    ids = ids.long().cpu().sort().values
    if (
        not 1 <= len(ids) < vocab
        or int(ids[0]) < 0
        or int(ids[-1]) >= vocab
        or bool((ids[1:] == ids[:-1]).any())
    ):
        raise ValueError(
            f"read-out ids must be 1 to {vocab - 1} distinct ids in [0, {vocab}); got {len(ids)} ids "
            f"in [{int(ids.min()) if len(ids) else '-'}, {int(ids.max()) if len(ids) else '-'}]"
        )
    if readout_ids(draft) is not None:
        del draft._buffers[READOUT_IDS]
    draft.register_buffer(READOUT_IDS, ids.to(draft.get_output_embeddings().weight.device))


def _share_tables(draft: PreTrainedModel, target: PreTrainedModel) -> None:
    draft.set_input_embeddings(target.get_input_embeddings())
    draft.set_output_embeddings(target.get_output_embeddings())


def save_draft(draft: PreTrainedModel, folder: str | Path, *, dtype: torch.dtype = torch.bfloat16) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous()
             for k, v in draft.state_dict().items() if not _shared(k)}  # fmt: skip
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
    ids = state.pop(READOUT_IDS, None)
    expected = {k for k in draft.state_dict() if not _shared(k)}
    missing = sorted(expected - set(state))
    if missing:
        raise ValueError(f"{folder}/model.safetensors is missing tensors: {', '.join(missing)}")
    draft.load_state_dict({k: v.to(target.dtype) for k, v in state.items()}, strict=False)
    _share_tables(draft, target)
    if ids is not None:
        set_readout_ids(draft, ids)
    return draft.eval()


def export_draft_hf(draft: PreTrainedModel, folder: str | Path, tokenizer=None) -> Path:
    """A standalone HF model folder (``save_pretrained``, tables included) for HF assisted
    generation, vLLM or SGLang."""
    folder = Path(folder)
    standalone = copy.deepcopy(draft)
    standalone._buffers.pop(READOUT_IDS, None)  # HF, vLLM and SGLang read out every row
    standalone.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder
