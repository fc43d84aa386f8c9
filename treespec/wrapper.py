"""``SpeculativeCausalLM``: treespec behind Hugging Face's ``model.generate`` signature.

``SpeculativeCausalLM(model).generate(input_ids, attention_mask, ...)`` returns the tensor HF's
``model.generate(input_ids, attention_mask=..., ...)`` returns for the arguments treespec
supports: ``[B, input_width + new_width]`` holding the input ids exactly as given (padding
included), then the new tokens, rows that stopped early padded with ``pad_token_id``.

Defaults follow HF 5.x: an argument left out takes ``model.generation_config``'s value, then HF's
global default (``do_sample=False``, ``temperature=1.0``, ``top_k=50``, ``top_p=1.0``, 20 new
tokens). An argument passed as None means "unset" and overrides the config, as in HF: for
example ``eos_token_id=None`` never stops early and ``pad_token_id=None`` pads with the first EOS
id, whatever the config holds. HF's logits processors in ``PROCESSORS`` and ``stop_strings`` (with
``tokenizer``) are applied on trees (``treespec.processors``). Any other HF argument raises unless
it holds HF's "off" value (``num_beams=1``, ``typical_p=1.0``, ``use_cache=True``, ...): see
``OFF_VALUES`` and docs/wrapper.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from treespec import api
from treespec.target import Target

# HF's model-agnostic length default: with neither max_new_tokens nor max_length set anywhere,
# HF 5.x generates this many *new* tokens (not a total length of 20), capped by the context.
HF_DEFAULT_NEW_TOKENS = 20
HF_DEFAULT_TOP_K = 50  # HF's global default top_k, applied whenever do_sample=True


class _Unset:
    """The default of arguments backed by the generation config: "not passed", unlike None."""

    def __repr__(self) -> str:
        return "<from generation_config>"


UNSET = _Unset()

# HF generate arguments treespec does not implement, each with the values that mean "off" in HF
# (its global defaults); None, which HF reads as "unset", is accepted for all of them. Any other
# value, and any name missing from both this table and the signature, raises.
OFF_VALUES: dict[str, tuple] = {
    # other decoding strategies: treespec decodes one sequence per prompt
    "num_beams": (1,),
    "num_beam_groups": (1,),
    "num_return_sequences": (1,),
    "diversity_penalty": (0.0,),
    "early_stopping": (False,),
    "length_penalty": (1.0,),
    "penalty_alpha": (0.0,),
    "dola_layers": (),
    "constraints": (),
    "force_words_ids": (),
    "assistant_model": (),
    "prompt_lookup_num_tokens": (),
    "assistant_early_exit": (),
    "use_mtp": (False,),
    "custom_generate": (),
    "generation_config": (),
    # logits processors beyond temperature / top-k / top-p
    "encoder_repetition_penalty": (1.0,),
    "encoder_no_repeat_ngram_size": (0,),
    "forced_bos_token_id": (),
    "forced_eos_token_id": (),
    "min_length": (0,),
    "top_h": (),
    "typical_p": (1.0,),
    "epsilon_cutoff": (0.0,),
    "eta_cutoff": (0.0,),
    "guidance_scale": (1.0,),
    "negative_prompt_ids": (),
    "negative_prompt_attention_mask": (),
    "exponential_decay_length_penalty": (),
    "remove_invalid_values": (False,),
    "renormalize_logits": (False,),
    "watermarking_config": (),
    "token_healing": (False,),
    "logits_processor": (),
    "prefix_allowed_tokens_fn": (),
    # stopping rules beyond EOS and length
    "stopping_criteria": (),
    "max_time": (),
    # outputs: treespec returns the sequences tensor only
    "return_dict_in_generate": (False,),
    "output_scores": (False,),
    "output_logits": (False,),
    "output_attentions": (False,),
    "output_hidden_states": (False,),
    # HF's own cache and model inputs: treespec keeps its own cache and reads input_ids only
    "use_cache": (True,),
    "cache_implementation": (),
    "past_key_values": (),
    "inputs_embeds": (),
    "position_ids": (),
    "token_type_ids": (),
    "bos_token_id": (),
    "synced_gpus": (False,),
    "trust_remote_code": (),
}


class SpeculativeCausalLM:
    """A causal LM whose ``generate`` runs on treespec and returns what HF's ``generate`` returns.

    ``proposer`` drafts token trees for speculative decoding (None: autoregressive decoding).
    ``prefill_chunk_size`` splits long prompts into chunks; ``attention_backend`` ("auto",
    "triton" or "reference") and ``linear_backend`` (one of ``treespec.target.linear.LINEAR_BACKENDS``) are
    handed to :class:`~treespec.target.Target`, which runs a view of the model: the model itself
    is left as it was, so its own ``generate`` and ``forward`` are unchanged.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        proposer=None,
        *,
        prefill_chunk_size: int | None = None,
        attention_backend: str = "auto",
        linear_backend: str = "auto",
    ) -> None:
        self.target = Target(model, attention_backend=attention_backend, linear_backend=linear_backend)
        self.model = model
        self.proposer = proposer
        self.prefill_chunk_size = prefill_chunk_size
        self.last_stats: api.GenerationStats | None = None  # stats of the latest generate call

    @property
    def config(self):
        return self.model.config

    @property
    def generation_config(self):
        return self.model.generation_config

    @property
    def device(self) -> torch.device:
        return self.model.device

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int | None | _Unset = UNSET,
        max_length: int | None | _Unset = UNSET,
        do_sample: bool | None | _Unset = UNSET,
        temperature: float | None | _Unset = UNSET,
        top_k: int | None | _Unset = UNSET,
        top_p: float | None | _Unset = UNSET,
        eos_token_id: int | Sequence[int] | torch.Tensor | None | _Unset = UNSET,
        pad_token_id: int | None | _Unset = UNSET,
        streamer=None,
        generator: torch.Generator | None = None,
        **kwargs,
    ) -> torch.LongTensor:
        """Generate as HF's ``model.generate`` does for these arguments.

        Arguments left out come from ``model.generation_config``; None means "unset", as in HF.
        ``max_length`` counts the prompt width, as in HF; ``max_new_tokens`` wins over it. Without
        either (here or in the generation config) 20 new tokens are generated, as HF does.
        ``generator`` (treespec's addition) replaces the global RNG for sampling. ``streamer``
        needs a batch of one (HF's streamers raise on more).

        Shape:
            input_ids [B, W] long, attention_mask [B, W] -> [B, W + new_width] long
        """
        config = self.model.generation_config
        processors = {
            name: _from_config(kwargs.pop(name, UNSET), getattr(config, name, None)) for name in PROCESSORS
        }
        stop_strings, tokenizer = kwargs.pop("stop_strings", None), kwargs.pop("tokenizer", None)
        if stop_strings is None:
            stop_strings = getattr(config, "stop_strings", None)
        _reject_unsupported(kwargs)
        _check_input_ids(input_ids, attention_mask)
        eos = _resolve_eos(config, eos_token_id)
        pad = _resolve_pad(config, pad_token_id, eos)
        if attention_mask is None:
            attention_mask = _infer_attention_mask(input_ids, pad, eos)
        new_tokens = _resolve_new_tokens(
            config, input_ids.shape[1], max_new_tokens, max_length, self.target.max_context
        )
        temperature, top_k, top_p = _resolve_sampling(config, do_sample, temperature, top_k, top_p)
        out = api.generate(
            self.target,
            input_ids,
            attention_mask=attention_mask,
            proposer=self.proposer,
            max_new_tokens=new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            **_processor_arguments(processors, sampling=temperature > 0),
            stop_strings=stop_strings,
            tokenizer=tokenizer,
            eos_token_id=eos,
            prefill_chunk_size=self.prefill_chunk_size,
            generator=generator,
            streamer=streamer,
        )
        self.last_stats = out.stats
        return _assemble(input_ids, out.sequences, pad)

    def __repr__(self) -> str:
        return f"SpeculativeCausalLM({type(self.model).__name__}, proposer={self.proposer!r})"


# HF's logits processors that treespec applies on trees (treespec.processors), by HF's name.
PROCESSORS = ("repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "sequence_bias", "min_new_tokens",
              "suppress_tokens", "begin_suppress_tokens", "min_p")  # fmt: skip


def _processor_arguments(values: dict, *, sampling: bool) -> dict:
    """HF's processor arguments (None: unset) as treespec.generate's: ``sequence_bias`` of single
    tokens becomes ``logit_bias``; ``min_p``, a warper, counts only when sampling, as in HF."""
    out = {name: value for name, value in values.items() if value is not None and name != "sequence_bias"}
    bias = values.get("sequence_bias")
    if bias:
        if isinstance(bias, list):  # HF also takes [[tokens, bias], ...]
            bias = {tuple(tokens): value for tokens, value in bias}
        longer = [k for k in bias if not (isinstance(k, tuple) and len(k) == 1)]
        if longer:
            raise ValueError(
                f"sequence_bias supports single tokens only, as {{(token,): bias}}; got the key(s) {longer[:3]}"
            )
        out["logit_bias"] = {k[0]: v for k, v in bias.items()}
    if not sampling:
        out.pop("min_p", None)
    if out.get("suppress_tokens") is not None:
        out["suppress_tokens"] = list(out["suppress_tokens"])
    return out


def _is_off(value, off_values: tuple) -> bool:
    if value is None:
        return True
    for off in off_values:
        if isinstance(off, bool):
            if value is off:
                return True
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and value == off:
            return True
    return False


def _describe(value) -> str:
    if isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)}>"
    return f"<{type(value).__name__}>"


def _reject_unsupported(kwargs: dict) -> None:
    """Raise, naming every argument treespec does not implement (off values pass)."""
    bad = [
        f"{name}={_describe(value)}"
        for name, value in kwargs.items()
        if name not in OFF_VALUES or not _is_off(value, OFF_VALUES[name])
    ]
    if bad:
        raise ValueError(
            f"SpeculativeCausalLM.generate does not support {', '.join(bad)}: treespec decodes one "
            "sequence per prompt (temperature, top-k, top-p and the processors in docs/wrapper.md) and "
            "returns the sequences tensor. Other HF arguments are accepted only at their 'off' value "
            "(e.g. num_beams=1, typical_p=1.0, return_dict_in_generate=False); see docs/wrapper.md"
        )


def _check_input_ids(input_ids, attention_mask) -> None:
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(
            f"input_ids must be a 2-D LongTensor [batch, seq] (e.g. tokenizer(..., return_tensors='pt')), "
            f"got {type(input_ids).__name__}"
        )
    if input_ids.dtype != torch.long:
        raise TypeError(f"input_ids must be a LongTensor (torch.long), got dtype {input_ids.dtype}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be 2-D [batch, seq], got shape {tuple(input_ids.shape)}")
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a tensor or None, got {type(attention_mask).__name__}")


def _from_config(value, config_value, hf_default=None):
    """HF's precedence: the call's value (an explicit None included), then the config's, then HF's default."""
    if value is not UNSET:
        return value
    return config_value if config_value is not None else hf_default


def _resolve_eos(config, eos_token_id) -> list[int]:
    """The EOS ids as a list; [] never stops early."""
    eos = _from_config(eos_token_id, config.eos_token_id)
    if eos is None:
        return []
    if isinstance(eos, torch.Tensor):
        eos = eos.tolist()
    return [eos] if isinstance(eos, int) else list(eos)


def _resolve_pad(config, pad_token_id, eos: list[int]) -> int | None:
    """HF's rule: the call's pad id, else the config's; if that is None, the first EOS id."""
    pad = _from_config(pad_token_id, config.pad_token_id)
    if pad is None and eos:
        pad = eos[0]
    return pad


def _infer_attention_mask(input_ids: torch.Tensor, pad: int | None, eos: list[int]) -> torch.Tensor | None:
    """HF's inference without a mask: pad tokens are masked when pad is set, present, and not an EOS id."""
    if pad is None or pad in eos or not bool((input_ids == pad).any()):  # host sync, once per call
        return None
    return input_ids.ne(pad).long()


def _resolve_new_tokens(config, width: int, max_new_tokens, max_length, max_context: int | None) -> int:
    """How many tokens to generate, by HF 5.x's precedence.

    max_new_tokens (call, then config) wins over max_length (call, then config), which counts
    the prompt. With neither set, HF generates 20 new tokens, capped by the context length.
    """
    new_tokens = _from_config(max_new_tokens, config.max_new_tokens)
    if new_tokens is not None:
        return new_tokens
    total = _from_config(max_length, config.max_length)
    if total is None:  # HF crashes on an explicit max_length=None; treespec takes the default
        total = width + HF_DEFAULT_NEW_TOKENS
        if max_context is not None:
            total = min(total, max_context)
    if width >= total:
        raise ValueError(
            f"input_ids are {width} tokens wide but max_length is {total}: nothing left to generate; "
            "set max_new_tokens instead"
        )
    return total - width


def _resolve_sampling(config, do_sample, temperature, top_k, top_p) -> tuple[float, int | None, float | None]:
    """(temperature, top_k, top_p) for treespec; temperature 0 is greedy, as do_sample=False is in HF.

    An explicit None switches a filter off (HF then skips its warper): temperature None is 1.0.
    """
    if not _from_config(do_sample, config.do_sample, False):
        return 0.0, None, None  # HF ignores temperature, top_k and top_p when not sampling
    temperature = _from_config(temperature, config.temperature, 1.0)
    temperature = 1.0 if temperature is None else temperature
    if isinstance(temperature, (int, float)) and temperature <= 0:
        raise ValueError(
            f"do_sample=True needs temperature > 0, got {temperature!r}; use do_sample=False for greedy decoding"
        )
    top_k = _from_config(top_k, config.top_k, HF_DEFAULT_TOP_K)
    return temperature, top_k, _from_config(top_p, config.top_p, 1.0)


def _assemble(input_ids: torch.Tensor, sequences: list[list[int]], pad: int | None) -> torch.Tensor:
    """HF's layout: the input as given, then each row's new tokens, padded to the longest row.

    Shape:
        input_ids [B, W], sequences B lists -> [B, W + max_len(sequences)]
    """
    new_width = max(len(s) for s in sequences)
    # Rows differ in length only when some stopped on EOS, and then pad falls back to an EOS id.
    fill = pad if pad is not None else 0
    new = torch.full((len(sequences), new_width), fill, dtype=torch.long)
    for row, tokens in enumerate(sequences):
        new[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    return torch.cat([input_ids, new.to(input_ids.device)], dim=1)
