"""SpeculativeCausalLM.generate against HF's model.generate, the oracle, tensor for tensor (fp32)."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import VOCAB, build
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, TextIteratorStreamer, TextStreamer

from treespec.wrapper import OFF_VALUES, PROCESSORS, SpeculativeCausalLM

PROMPTS = [list(range(5, 12)), [20, 21, 22], list(range(30, 60))]  # lengths 7, 3, 30
PAD = 0  # no prompt contains it
NEW = 12

# HF warns when its default length applies; those defaults are what some tests compare against.
pytestmark = pytest.mark.filterwarnings("ignore:Using the model-agnostic default `max_length`")


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), PAD)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One character per id over the tiny models' 128 ids: printable ASCII as itself, the rest as letters."""
    chars = [chr(i) if 32 <= i < 127 else chr(0x100 + i) for i in range(VOCAB)]
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=chars[0]))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def wrapped():
    """A wrapped tiny model per family, built once. HF's generate still runs on the wrapped model."""
    cache = {}

    def get(family: str) -> SpeculativeCausalLM:
        if family not in cache:
            cache[family] = SpeculativeCausalLM(build(family))
        return cache[family]

    return get


def hf(model, ids, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, **kwargs)


@pytest.mark.parametrize("pad_token_id", [PAD, 7, None, "omitted"])
def test_greedy_padded_batch_equals_hf(family, wrapped, pad_token_id):
    lm = wrapped(family)
    ids, mask = left_padded(PROMPTS)
    free = hf(lm.model, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)[0, ids.shape[1] :]
    stop = next(
        k for k in range(2, NEW - 1) if free[k] not in free[:k]
    )  # row 0's first new token from 3rd on
    eos = free[stop].item()  # row 0 stops there
    # HF pads rows that finished with pad_token_id; left out, it comes from the generation config
    # (gemma3's is 0, the others have none); when that is None, the EOS id pads.
    # HF's padded fp32 batch could in principle drift from unpadded runs; here it matches them and
    # treespec exactly, so the padded batch itself is the oracle.
    args = dict(max_new_tokens=NEW, eos_token_id=eos)
    if pad_token_id != "omitted":
        args["pad_token_id"] = pad_token_id
    want = hf(lm.model, ids, attention_mask=mask, do_sample=False, **args)
    got = lm.generate(ids, mask, **args)
    assert got.dtype == torch.long and torch.equal(got, want)
    config_pad = lm.generation_config.pad_token_id
    finished_fill = {None: eos, "omitted": eos if config_pad is None else config_pad}.get(
        pad_token_id, pad_token_id
    )
    assert got[0, ids.shape[1] + stop] == eos and (got[0, ids.shape[1] + stop + 1 :] == finished_fill).all()
    assert lm.last_stats.num_requests == 3


def test_all_rows_stop_early_so_the_output_is_narrower(wrapped):
    lm = wrapped("llama")
    ids, mask = left_padded(PROMPTS)
    free = hf(lm.model, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)[:, ids.shape[1] :]
    eos = [free[0, 2].item(), free[1, 3].item(), free[2, 1].item()]  # one stop token per row
    want = hf(lm.model, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos)
    got = lm.generate(ids, mask, max_new_tokens=NEW, eos_token_id=eos)
    assert torch.equal(got, want)
    assert got.shape[1] < ids.shape[1] + NEW


def test_explicit_none_overrides_the_config_as_in_hf(wrapped):
    # HF 5.x copies every passed argument over the generation config, None included: None is
    # "unset" (no EOS, pad with the EOS id, no top-k filter, greedy), not "use the config's value".
    lm = wrapped("llama")
    config = lm.generation_config
    ids, mask = left_padded(PROMPTS)
    free = lm.generate(ids, mask, max_new_tokens=NEW)[:, ids.shape[1] :]
    config.eos_token_id, config.pad_token_id, config.max_new_tokens = free[1, 1].item(), 99, 6
    try:
        for args in (dict(), dict(eos_token_id=None), dict(pad_token_id=None), dict(max_new_tokens=None)):
            want = hf(lm.model, ids, attention_mask=mask, do_sample=False, **args)
            assert torch.equal(lm.generate(ids, mask, **args), want), args
        config.do_sample, config.top_k = True, 3
        for args in (dict(top_k=None), dict(do_sample=None), dict(temperature=None, top_p=None)):
            torch.manual_seed(5)
            want = hf(lm.model, ids[2:], **args)  # unpadded
            torch.manual_seed(5)
            assert torch.equal(lm.generate(ids[2:], **args), want), args
    finally:
        config.eos_token_id = config.pad_token_id = config.max_new_tokens = None
        config.do_sample = config.top_k = None


def test_mask_is_inferred_from_pad_as_hf_does(wrapped):
    lm = wrapped("qwen2")
    ids, mask = left_padded(PROMPTS)
    want = hf(lm.model, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD)
    assert torch.equal(lm.generate(ids, max_new_tokens=NEW, pad_token_id=PAD), want)
    assert torch.equal(hf(lm.model, ids, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD), want)


def test_defaults_come_from_generation_config(wrapped):
    lm = wrapped("llama")
    config = lm.generation_config
    ids = torch.tensor([PROMPTS[0]])
    try:
        # HF 5.x: with no length set anywhere, 20 *new* tokens (not a total of 20) ...
        assert lm.generate(ids).shape == hf(lm.model, ids).shape == (1, 7 + 20)
        assert torch.equal(lm.generate(ids), hf(lm.model, ids))
        # ... capped by the context (256): a 250-token prompt gets 6.
        long_ids = torch.full((1, 250), 9)
        assert torch.equal(lm.generate(long_ids), hf(lm.model, long_ids))
        assert lm.generate(long_ids).shape == (1, 256)
        # max_length counts the prompt; a config max_new_tokens beats a max_length argument.
        assert torch.equal(lm.generate(ids, max_length=10), hf(lm.model, ids, max_length=10))
        config.max_length = 15
        assert torch.equal(lm.generate(ids), hf(lm.model, ids))
        assert lm.generate(ids).shape == (1, 15)
        config.max_new_tokens = 3
        assert torch.equal(lm.generate(ids, max_length=12), hf(lm.model, ids, max_length=12))
        assert lm.generate(ids, max_length=12).shape == (1, 10)
        config.max_length, config.max_new_tokens = None, None
        # EOS and do_sample defaults.
        free = lm.generate(ids, max_new_tokens=NEW)[0, 7:].tolist()
        config.eos_token_id = free[3]
        assert torch.equal(lm.generate(ids, max_new_tokens=NEW), hf(lm.model, ids, max_new_tokens=NEW))
        assert lm.generate(ids, max_new_tokens=NEW)[0, 7:].tolist() == free[:4]
        config.eos_token_id = None
        config.do_sample, config.top_k = True, 5
        torch.manual_seed(3)
        want = hf(lm.model, ids, max_new_tokens=NEW)
        torch.manual_seed(3)
        assert torch.equal(lm.generate(ids, max_new_tokens=NEW), want)
    finally:
        config.max_length = config.max_new_tokens = config.eos_token_id = config.top_k = None
        config.do_sample = None
    with pytest.raises(ValueError, match="max_length is 7: nothing left to generate"):
        lm.generate(ids, max_length=7)


@pytest.mark.parametrize(
    "sampling", [dict(temperature=0.8, top_k=20, top_p=0.9), dict(), dict(top_k=0, temperature=1.3)]
)
def test_sampling_equals_hf_with_the_same_seed(wrapped, sampling):
    # Batch 1, no proposer: treespec draws one torch.multinomial per token from the global RNG,
    # as HF's sampling loop does; dict() checks HF's default top_k=50 is applied.
    lm = wrapped("llama")
    ids = torch.tensor([PROMPTS[0]])
    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        want = hf(lm.model, ids, max_new_tokens=16, do_sample=True, **sampling)
        torch.manual_seed(seed)
        assert torch.equal(lm.generate(ids, max_new_tokens=16, do_sample=True, **sampling), want)


def test_greedy_ignores_sampling_arguments_and_generator_reproduces(wrapped):
    lm = wrapped("qwen3")
    ids, mask = left_padded(PROMPTS)
    greedy = lm.generate(ids, mask, max_new_tokens=NEW)
    assert torch.equal(lm.generate(ids, mask, max_new_tokens=NEW, temperature=0.5, top_k=3), greedy)

    def sampled(seed):
        gen = torch.Generator().manual_seed(seed)
        return lm.generate(ids, mask, max_new_tokens=NEW, do_sample=True, generator=gen)

    assert torch.equal(sampled(4), sampled(4))
    assert not torch.equal(sampled(4), sampled(5))


@pytest.mark.parametrize("skip_prompt", [True, False])
def test_text_streamer_prints_what_hf_prints(wrapped, capsys, skip_prompt):
    lm, tokenizer = wrapped("llama"), char_tokenizer()
    ids = torch.tensor([tokenizer("Hi there")["input_ids"]])
    hf(lm.model, ids, max_new_tokens=NEW, do_sample=False, streamer=TextStreamer(tokenizer, skip_prompt))
    want = capsys.readouterr().out
    out = lm.generate(ids, max_new_tokens=NEW, streamer=TextStreamer(tokenizer, skip_prompt))
    printed = capsys.readouterr().out
    assert printed == want
    new_text = tokenizer.decode(out[0, ids.shape[1] :])
    assert printed == (new_text if skip_prompt else "Hi there" + new_text) + "\n"


def test_text_iterator_streamer_from_another_thread(wrapped):
    lm, tokenizer = wrapped("gemma3"), char_tokenizer()
    ids = torch.tensor([tokenizer("abc de")["input_ids"]])
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=60)
    result = {}
    thread = threading.Thread(
        target=lambda: result.setdefault("ids", lm.generate(ids, max_new_tokens=NEW, streamer=streamer))
    )
    thread.start()
    text = "".join(streamer)  # blocks until generate calls streamer.end()
    thread.join()
    assert text == tokenizer.decode(result["ids"][0, ids.shape[1] :])
    with pytest.raises(ValueError, match="streamer needs exactly one prompt"):
        lm.generate(*left_padded(PROMPTS[:2]), max_new_tokens=2, streamer=streamer)


def test_off_values_are_accepted(wrapped):
    lm = wrapped("llama")
    ids = torch.tensor([PROMPTS[1]])
    plain = lm.generate(ids, max_new_tokens=4)
    off = dict(
        num_beams=1,
        num_return_sequences=1,
        use_cache=True,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        return_dict_in_generate=False,
        output_scores=False,
        min_new_tokens=0,
        logits_processor=None,
        stopping_criteria=None,
    )
    assert torch.equal(lm.generate(ids, max_new_tokens=4, **off), plain)
    assert all(name in OFF_VALUES or name in PROCESSORS for name in off)


def test_unsupported_arguments_raise_naming_them(wrapped):
    lm = wrapped("llama")
    ids = torch.tensor([PROMPTS[1]])
    with pytest.raises(ValueError, match=r"num_beams=4, typical_p=0\.5, num_return_sequences=2"):
        lm.generate(ids, num_beams=4, typical_p=0.5, num_return_sequences=2)
    with pytest.raises(ValueError, match="sequence_bias supports single tokens only"):
        lm.generate(ids, sequence_bias={(4, 5): 1.0})
    with pytest.raises(ValueError, match="stop_strings needs the tokenizer"):
        lm.generate(ids, stop_strings=["ab"])
    for name, value in [
        ("return_dict_in_generate", True),
        ("output_scores", True),
        ("logits_processor", []),
        ("stopping_criteria", []),
        ("use_cache", False),
        ("num_beams", True),  # a bool is not the int 1
        ("max_new_token", 3),  # a typo is not silently dropped
    ]:
        with pytest.raises(ValueError, match=f"does not support {name}="):
            lm.generate(ids, max_new_tokens=2, **{name: value})


def test_bad_inputs_raise(wrapped):
    lm = wrapped("llama")
    ids = torch.tensor([PROMPTS[1]])
    with pytest.raises(ValueError, match="do_sample=True needs temperature > 0"):
        lm.generate(ids, do_sample=True, temperature=0.0)
    with pytest.raises(TypeError, match="input_ids must be a 2-D LongTensor"):
        lm.generate(PROMPTS[1], max_new_tokens=2)
    with pytest.raises(TypeError, match="torch.long"):
        lm.generate(ids.int(), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"input_ids must be 2-D \[batch, seq\], got shape \(3,\)"):
        lm.generate(ids[0], max_new_tokens=2)
    with pytest.raises(ValueError, match="attention_mask shape"):
        lm.generate(ids, torch.ones(1, 2, dtype=torch.long), max_new_tokens=2)
    with pytest.raises(TypeError, match="attention_mask must be a tensor"):
        lm.generate(ids, [[1, 1, 1]], max_new_tokens=2)


def test_wrapper_exposes_the_model_and_its_options(wrapped):
    lm = wrapped("qwen2")
    assert lm.config is lm.model.config and lm.generation_config is lm.model.generation_config
    assert lm.device == lm.model.device and lm.proposer is None
    ids, mask = left_padded(PROMPTS)
    want = lm.generate(ids, mask, max_new_tokens=5)
    assert lm.last_stats.new_tokens == 15 and lm.last_stats.prompt_tokens == sum(map(len, PROMPTS))
    chunked = SpeculativeCausalLM(lm.model, prefill_chunk_size=4, attention_backend="reference")
    assert torch.equal(chunked.generate(ids, mask, max_new_tokens=5), want)
    assert chunked.last_stats.steps > lm.last_stats.steps  # the 30-token prompt took 8 prefill steps


def test_proposer_and_generator_are_handed_to_treespec_generate(wrapped, monkeypatch):
    lm = wrapped("llama")
    proposer, gen, seen = object(), torch.Generator(), {}

    def fake_generate(target, input_ids, **kwargs):
        seen.update(kwargs, target=target)
        raise RuntimeError("stop here")

    monkeypatch.setattr("treespec.api.generate", fake_generate)
    with pytest.raises(RuntimeError, match="stop here"):
        SpeculativeCausalLM(lm.model, proposer).generate(torch.tensor([PROMPTS[0]]), generator=gen)
    assert seen["proposer"] is proposer and seen["generator"] is gen
    assert seen["max_new_tokens"] == 20 and seen["temperature"] == 0.0 and seen["eos_token_id"] == []


def test_with_a_proposer_the_output_is_still_hfs(wrapped, capsys):
    # Speculative decoding changes the speed, never the greedy output; the streamer then receives
    # several tokens per put, which HF's streamers accept as a 1-D tensor.
    from treespec.proposers import NgramProposer

    base = wrapped("gemma3")
    lm = SpeculativeCausalLM(base.model, NgramProposer())
    ids, mask = left_padded(PROMPTS)
    free = hf(lm.model, ids, attention_mask=mask, max_new_tokens=24, do_sample=False)[:, ids.shape[1] :]
    eos = free[1, 6].item()
    want = hf(lm.model, ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=eos)
    assert torch.equal(lm.generate(ids, mask, max_new_tokens=24, eos_token_id=eos), want)
    speculative_steps = lm.last_stats.steps
    assert torch.equal(base.generate(ids, mask, max_new_tokens=24, eos_token_id=eos), want)
    assert speculative_steps < base.last_stats.steps  # drafts were accepted: the proposer really ran
    tokenizer, one = char_tokenizer(), ids[2:]
    hf(lm.model, one, max_new_tokens=24, do_sample=False, streamer=TextStreamer(tokenizer))
    expected = capsys.readouterr().out
    lm.generate(one, max_new_tokens=24, streamer=TextStreamer(tokenizer))
    assert capsys.readouterr().out == expected


PROCESSOR_ARGS = [
    dict(repetition_penalty=1.6),
    dict(no_repeat_ngram_size=2),
    dict(bad_words_ids=[[41], [22, 72]], suppress_tokens=[58]),
    dict(sequence_bias={(41,): 2.0, (80,): -1.5}, begin_suppress_tokens=[22]),
    dict(min_new_tokens=5, repetition_penalty=1.2, no_repeat_ngram_size=3),
]


@pytest.mark.parametrize("args", PROCESSOR_ARGS, ids=lambda a: ",".join(a))
def test_processors_equal_hf(wrapped, args):
    """HF's processor arguments, greedy, with and without a proposer: HF's output, prompt by prompt
    (HF's processors would also see the left padding of a batch: its pad tokens are penalised)."""
    from treespec.proposers import NgramProposer

    base = wrapped("llama")
    for lm in (base, SpeculativeCausalLM(base.model, NgramProposer(max_depth=4))):
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            plain = hf(lm.model, ids, max_new_tokens=NEW, do_sample=False)
            free = plain[0, ids.shape[1] :]
            eos = free[4].item() if "min_new_tokens" in args else None  # an EOS the processor must hold back
            want = hf(lm.model, ids, max_new_tokens=NEW, do_sample=False, eos_token_id=eos, **args)
            assert torch.equal(lm.generate(ids, max_new_tokens=NEW, eos_token_id=eos, **args), want), prompt
    changed = [not torch.equal(hf(base.model, torch.tensor([p]), max_new_tokens=NEW, do_sample=False, **args),
                               hf(base.model, torch.tensor([p]), max_new_tokens=NEW, do_sample=False))
               for p in PROMPTS]  # fmt: skip
    assert any(changed) or "min_new_tokens" in args


def test_sampling_with_processors_equals_hf_with_the_same_seed(wrapped):
    lm = wrapped("llama")
    ids = torch.tensor([PROMPTS[0]])
    for args in (
        dict(min_p=0.05, temperature=0.9),
        dict(repetition_penalty=1.3, no_repeat_ngram_size=2, top_k=0),
    ):
        for seed in (0, 1):
            torch.manual_seed(seed)
            want = hf(lm.model, ids, max_new_tokens=16, do_sample=True, **args)
            torch.manual_seed(seed)
            assert torch.equal(lm.generate(ids, max_new_tokens=16, do_sample=True, **args), want), args


def test_stop_strings_equal_hf(wrapped):
    """HF's StopStringCriteria decides, after every token, in treespec too: with speculation, a
    step's accepted tokens are cut where a stop string completes (the completing token kept)."""
    from treespec.proposers import NgramProposer

    tokenizer, base = char_tokenizer(), wrapped("llama")
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        text = tokenizer.decode(hf(base.model, ids, max_new_tokens=NEW, do_sample=False)[0, ids.shape[1] :])
        stops = [text[5:7], "never there"]  # completes at the 7th new token
        want = hf(
            base.model, ids, max_new_tokens=NEW, do_sample=False, stop_strings=stops, tokenizer=tokenizer
        )
        assert want.shape[1] < ids.shape[1] + NEW
        for lm in (base, SpeculativeCausalLM(base.model, NgramProposer(max_depth=4))):
            got = lm.generate(ids, max_new_tokens=NEW, stop_strings=stops, tokenizer=tokenizer)
            assert torch.equal(got, want), prompt
