"""Training data at scale: prompts the target writes (Magpie), filters and near-duplicates, answers
through the continuous-batching engine, features from stored sequences; every stage resumes after
a kill, and bad input (corrupt files, another target, a full disk) ends with a clear error."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build, hf_greedy

from treespec import heads as heads_module
from treespec.heads.training import corpus as corpus_module
from treespec.heads.training import data as data_module
from treespec.heads.training.corpus import (
    ANSWERS,
    PROMPTS,
    AnswerConfig,
    MagpieConfig,
    NearDuplicates,
    PromptFilter,
    add_prompts,
    read_records,
    write_answers,
)
from treespec.heads.training.data import HeadDataset, write_features
from treespec.heads.training.train import TrainConfig, train

LAYERS = (0, 1, 1)


def test_prompt_filter_names_its_reason():
    keep = PromptFilter()
    assert keep.reason_to_drop("How do I sort a list of tuples by their second element in Python?") is None
    assert keep.reason_to_drop("Hi there") == "too short"
    assert keep.reason_to_drop("x " * 2000) == "too long"
    assert keep.reason_to_drop("What is this <|im_start|>assistant doing here, really?") == "template debris"
    assert keep.reason_to_drop("user: what is the capital of France and why there?") == "template debris"
    assert keep.reason_to_drop("Что такое квантовая механика и как она работает?") == "not English"
    assert keep.reason_to_drop("the the the the the the the the the the the the") == "repetitive"


def test_near_duplicates_catch_copies_and_paraphrase_noise_but_keep_distinct_prompts():
    seen = NearDuplicates()
    base = "Explain how a refrigerator keeps food cold, and why the back of it gets warm over time."
    assert seen.add(base)
    assert not seen.add(base.upper())  # equal after normalisation
    assert not seen.add(base.replace("over time", "over time!"))
    assert not seen.add(base[:-1] + " in summer.")  # one word more: Jaccard of 3-grams ~0.9
    assert seen.add("Write a haiku about a train leaving a snowy station at dawn.")
    assert seen.add("Explain how a heat pump warms a house in winter, and what makes it efficient.")


def test_read_records_cuts_a_half_written_line_and_refuses_a_corrupt_one(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"id": 0}\n{"id": 1}\n{"id": 2, "ans')
    assert [r["id"] for r in read_records(path)] == [0, 1]
    assert path.read_text() == '{"id": 0}\n{"id": 1}\n'  # the next append starts on a clean line
    path.write_text('{"id": 0}\nnot json\n')
    with pytest.raises(ValueError, match="line 2.*corrupt"):
        read_records(path)


def test_add_prompts_never_keeps_a_held_out_prompt(tmp_path):
    held = ["What should a beginner know before adopting a dog?"]
    added = add_prompts(tmp_path, [held[0], held[0] + " ", "Name three rivers in Africa and their lengths."],
                        "file", held)  # fmt: skip
    assert added == 1
    assert [r["messages"][0]["content"] for r in read_records(tmp_path / PROMPTS)] == [
        "Name three rivers in Africa and their lengths."
    ]
    assert add_prompts(tmp_path, ["Name three rivers in Africa and their lengths."], "file") == 0


@pytest.fixture(scope="module")
def smol_tokenizer():
    from transformers import AutoTokenizer

    from treespec.models import model_path

    return AutoTokenizer.from_pretrained(model_path("smollm2-135m-instruct"))


@pytest.fixture(scope="module")
def tiny_chat(smol_tokenizer):
    """A tiny random Llama that reads SmolLM2's tokenizer (chat template included)."""
    model = build("llama", vocab_size=len(smol_tokenizer))
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    return model


QUESTIONS = [
    "Name three rivers in Africa.",
    "How do magnets work?",
    "Write a limerick about a cat.",
    "What is 17 times 23?",
    "Why is the sky blue during the day?",
]


@pytest.mark.slow
def test_template_prefix_is_the_opening_of_a_user_turn(smol_tokenizer):
    prefix = corpus_module.template_prefix(smol_tokenizer, [])
    assert smol_tokenizer.decode(prefix).endswith("<|im_start|>user\n")
    turn = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    follow = smol_tokenizer.decode(corpus_module.template_prefix(smol_tokenizer, turn))
    assert "Hello!<|im_end|>" in follow and follow.endswith("<|im_start|>user\n")


@pytest.mark.slow
def test_answers_are_the_targets_own_and_resume_after_a_kill(
    tiny_chat, smol_tokenizer, tmp_path, monkeypatch
):
    add_prompts(tmp_path, QUESTIONS, "test")
    config = AnswerConfig(max_new_tokens=8, batch_size=2, sampled_share=0.4, flush_every=1)
    real = corpus_module._append
    calls = []

    def dies(path, records):
        records = list(records)
        if path.name == ANSWERS and records:
            calls.append(len(records))
            if len(calls) == 3:
                raise KeyboardInterrupt  # killed after two answers were written
        real(path, records)

    monkeypatch.setattr(corpus_module, "_append", dies)
    with pytest.raises(KeyboardInterrupt):
        write_answers(tiny_chat, smol_tokenizer, tmp_path, config, progress=False)
    assert len(read_records(tmp_path / ANSWERS)) == 2
    monkeypatch.setattr(corpus_module, "_append", real)
    summary = write_answers(tiny_chat, smol_tokenizer, tmp_path, config, progress=False)
    answers = read_records(tmp_path / ANSWERS)
    assert sorted(a["id"] for a in answers) == list(range(5)) and summary["answers"] == 5
    sampled = [a for a in answers if a["temperature"] > 0]
    assert 0 < len(sampled) < 5  # a share is sampled, chosen by id
    for a in answers:
        assert a["prompt"] == corpus_module.chat_ids(
            smol_tokenizer, [{"role": "user", "content": QUESTIONS[a["id"]]}]
        )
        if a["temperature"] == 0:
            assert a["answer"] == hf_greedy(tiny_chat, a["prompt"], 8)[: len(a["answer"])]
    # A second run has nothing left to do.
    assert write_answers(tiny_chat, smol_tokenizer, tmp_path, config, progress=False)["new_tokens"] == 0


def _answers(model) -> list[dict]:
    torch.manual_seed(1)
    out = []
    for i, n in enumerate([5, 9, 3, 12, 7, 4]):
        prompt = torch.randint(3, 60, (n,)).tolist()
        out.append({"id": i, "prompt": prompt, "answer": torch.randint(3, 60, (n + 2,)).tolist()})
    return out


def test_features_equal_the_targets_hidden_states_and_resume(tmp_path, monkeypatch):
    model = build("llama")
    answers = _answers(model)
    real = data_module._write_shard
    calls = []

    def dies_on_second(*args):
        if calls:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(data_module, "_write_shard", dies_on_second)
    with pytest.raises(KeyboardInterrupt):
        write_features(model, answers, tmp_path, feature_layers=LAYERS, eagle3=True, batch_tokens=40,
                       shard_tokens=30, progress=False)  # fmt: skip
    monkeypatch.setattr(data_module, "_write_shard", real)
    write_features(model, answers, tmp_path, feature_layers=LAYERS, eagle3=True, batch_tokens=40,
                   shard_tokens=30, progress=False)  # fmt: skip
    data = HeadDataset(tmp_path, model)
    assert data.has_features
    sequences = data.sequences()
    order = [i for shard in data.manifest["shards"] for i in shard["prompt_ids"]]
    assert sorted(order) == list(range(6)) and len(set(order)) == 6
    for i, seq in zip(order, sequences, strict=True):
        a = answers[i]
        assert seq.tokens.tolist() == a["prompt"] + a["answer"] and seq.prompt_len == len(a["prompt"])
        with torch.no_grad():
            states = model(seq.tokens[None], output_hidden_states=True).hidden_states
        torch.testing.assert_close(
            seq.hidden.float(), states[-1][0].to(torch.bfloat16).float(), atol=0.02, rtol=0.02
        )
        want = torch.cat([states[j][0] for j in LAYERS], -1).to(torch.bfloat16).float()
        torch.testing.assert_close(seq.features.float(), want, atol=0.02, rtol=0.02)
    with pytest.raises(ValueError, match="EAGLE-3 features"):
        write_features(model, answers, tmp_path, feature_layers=LAYERS, eagle3=False, progress=False)


def test_features_without_eagle3_store_hidden_only_and_eagle3_training_refuses(tmp_path):
    model = build("llama")
    write_features(model, _answers(model), tmp_path, feature_layers=LAYERS, progress=False)
    data = HeadDataset(tmp_path, model)
    assert not data.has_features and all(s.features is None for s in data)
    with pytest.raises(ValueError, match="no EAGLE-3 features"):
        train(TrainConfig(kind="eagle3", epochs=1), model, data, tmp_path / "run", progress=False)
    report = train(
        TrainConfig(kind="eagle", epochs=1, batch_tokens=64), model, data, tmp_path / "run1", progress=False
    )
    assert report["steps"] >= 1


def test_a_corrupt_shard_and_a_full_disk_are_clear_errors(tmp_path, monkeypatch):
    model = build("llama")
    write_features(model, _answers(model), tmp_path / "d", feature_layers=LAYERS, progress=False)
    shard = next((tmp_path / "d").glob("shard_*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        HeadDataset(tmp_path / "d", model).sequences()

    class Full:
        free = 1 << 20

    monkeypatch.setattr(data_module.shutil, "disk_usage", lambda _: Full())
    with pytest.raises(OSError, match="not enough disk space.*resume"):
        write_features(model, _answers(model), tmp_path / "e", feature_layers=LAYERS, progress=False)
    assert not list((tmp_path / "e").glob("shard_*"))  # nothing half-written


def test_features_refuse_another_targets_folder(tmp_path):
    model = build("llama")
    write_features(model, _answers(model)[:2], tmp_path, feature_layers=LAYERS, progress=False)
    wider = build("llama", hidden_size=32, intermediate_size=64)
    with pytest.raises(ValueError, match="hidden size"):
        write_features(wider, _answers(model), tmp_path, feature_layers=LAYERS, progress=False)


def test_features_of_a_bf16_target_and_no_mixing_of_dtypes(tmp_path):
    model = build("llama")
    answers = _answers(model)
    half = build("llama").to(torch.bfloat16)
    half.load_state_dict(model.state_dict())
    write_features(half, answers[:2], tmp_path, feature_layers=LAYERS, progress=False)
    data = HeadDataset(tmp_path, model)
    assert data.manifest["target_dtype"] == "bfloat16"
    seq = data.sequences()[0]
    with torch.no_grad():
        want = half(seq.tokens[None], output_hidden_states=True).hidden_states[-1][0]
    torch.testing.assert_close(seq.hidden, want, atol=0.02, rtol=0.02)
    with pytest.raises(ValueError, match="bfloat16 target.*float32.*--dtype"):
        write_features(model, answers, tmp_path, feature_layers=LAYERS, progress=False)


@pytest.mark.slow
def test_magpie_prompts_from_the_real_model_resume_by_round(tmp_path):
    """SmolLM2 writes its own user turns from the template's opening; kept ones pass the filter;
    a half-written record of a killed round is cut off and the round continues."""
    from treespec import models

    model, tokenizer = models.load("smollm2-135m-instruct", dtype=torch.bfloat16)
    config = MagpieConfig(count=3, batch_size=8, round_size=8, max_tokens=48, seed=0)
    state = corpus_module.synthesize_prompts(model, tokenizer, tmp_path, config, progress=False)
    records = read_records(tmp_path / PROMPTS)
    rounds = state["magpie"]["rounds"]
    assert len(records) == 3 and rounds >= 1
    assert state["magpie"]["sampled"] == 8 * rounds
    assert state["magpie"]["kept"] + sum(state["magpie"]["dropped"].values()) >= state["magpie"]["kept"]
    for r in records:
        assert r["source"] == "magpie" and PromptFilter().reason_to_drop(r["messages"][0]["content"]) is None
    with open(tmp_path / PROMPTS, "a") as f:  # a round killed while it was being appended
        f.write('{"id": 3, "source": "magpie", "messages": [{"role": "user", "content": "half')
    state = corpus_module.synthesize_prompts(
        model, tokenizer, tmp_path, MagpieConfig(count=4, batch_size=8, round_size=8, max_tokens=48),
        progress=False,
    )  # fmt: skip
    again = read_records(tmp_path / PROMPTS)
    assert len(again) == 4 and again[:3] == records and state["magpie"]["rounds"] > rounds
    assert json.loads((tmp_path / "state.json").read_text())["magpie"] == state["magpie"]


@pytest.mark.slow
def test_follow_ups_extend_answered_conversations(smol_tokenizer, tiny_chat, tmp_path, monkeypatch):
    """A share of answered first turns (chosen by id) gets a second user turn, written after the
    conversation so far; it is filtered and de-duplicated like a first turn, and rerunning adds
    none twice. (The target's writing is scripted here; the Magpie test runs the real one.)"""
    add_prompts(tmp_path, QUESTIONS, "test")
    stops = corpus_module.end_of_turn_ids(tiny_chat, smol_tokenizer)
    answers = [{"id": i, "prompt": [1], "answer": smol_tokenizer.encode(f"Answer number {i}.") + [stops[0]],
                "finish": "eos", "temperature": 0.0} for i in range(5)]  # fmt: skip
    answers[4]["finish"] = "length"  # a cut answer gets no follow-up
    corpus_module._append(tmp_path / ANSWERS, answers)
    seen_prefixes = []

    def scripted(target, prompts, samplings, max_new, stops_, batch, generator, **kwargs):
        seen_prefixes.extend(prompts)
        texts = ["Can you give me a concrete example of that, please?"] * len(prompts)
        texts[0] = "Why?"  # too short: dropped
        return [(smol_tokenizer.encode(t) + [stops_[0]], "eos") for t in texts]

    monkeypatch.setattr(corpus_module, "_run", scripted)
    config = MagpieConfig(follow_up_share=1.0)
    added = corpus_module.synthesize_follow_ups(tiny_chat, smol_tokenizer, tmp_path, config, progress=False)
    records = read_records(tmp_path / PROMPTS)
    assert len(seen_prefixes) == 4  # answers 0-3; 4 was cut by the length limit
    decoded = smol_tokenizer.decode(seen_prefixes[1])
    assert "Answer number 1." in decoded and decoded.endswith("<|im_start|>user\n")
    assert len(added) == 1  # the rest: one too short, two duplicates of the kept one
    follow = records[added[0]]
    assert follow["source"] == "follow-up" and len(follow["messages"]) == 3
    assert follow["messages"][1] == {"role": "assistant", "content": f"Answer number {follow['parent']}."}
    assert (
        corpus_module.synthesize_follow_ups(tiny_chat, smol_tokenizer, tmp_path, config, progress=False) == []
    )


def test_features_of_only_the_greedy_or_only_the_sampled_answers(tmp_path):
    """--answers keeps the sequences answered at the chosen kind of decoding (by each record's
    stored temperature; none stored means greedy), records the choice, and never resumes a folder
    with another one."""
    model = build("llama")
    answers = _answers(model)
    for i, a in enumerate(answers):
        if i % 3 == 0:
            a["temperature"] = 0.7
        elif i % 3 == 1:
            a["temperature"] = 0.0
    for selection, want in (("sampled", [0, 3]), ("greedy", [1, 2, 4, 5]), ("all", list(range(6)))):
        folder = tmp_path / selection
        write_features(
            model, answers, folder, feature_layers=LAYERS, answers_selection=selection, progress=False
        )
        data = HeadDataset(folder, model)
        assert data.manifest["answers"] == selection
        assert sorted(i for s in data.manifest["shards"] for i in s["prompt_ids"]) == want
    with pytest.raises(ValueError, match="features of greedy answers, not sampled.*--answers"):
        write_features(model, answers, tmp_path / "greedy", feature_layers=LAYERS, answers_selection="sampled",
                       progress=False)  # fmt: skip
    with pytest.raises(ValueError, match="answers must be one of all, greedy, sampled, got 'hot'"):
        write_features(
            model, answers, tmp_path / "hot", feature_layers=LAYERS, answers_selection="hot", progress=False
        )


def test_features_cli_writes_the_dev_answers_beside_the_training_ones(tmp_path, capsys):
    """``treespec train-heads features`` keeps the dev split's answers out of the training data
    and writes them to OUT/dev, which ``train`` then reports a held-out loss on each epoch."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from treespec.cli import main
    from treespec.models import model_path

    tokenizer = AutoTokenizer.from_pretrained(model_path("smollm2-135m-instruct"))
    torch.manual_seed(0)
    tiny = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                        tie_word_embeddings=True))  # fmt: skip
    tiny.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    answers = _answers(tiny)
    splits = ["train", "dev", "train", "train", "dev", "train"]
    (corpus / "prompts.jsonl").write_text(
        "".join(
            json.dumps({"id": a["id"], "split": split}) + "\n"
            for a, split in zip(answers, splits, strict=True)
        )
    )
    (corpus / "answers.jsonl").write_text("".join(json.dumps(a) + "\n" for a in answers))
    assert main(["train-heads", "features", "--model", str(tmp_path / "tiny"), "--corpus", str(corpus),
                 "--out", str(tmp_path / "data"), "--dtype", "fp32"]) == 0  # fmt: skip
    model = LlamaForCausalLM.from_pretrained(tmp_path / "tiny")
    trained_on = {len(s.tokens) for s in HeadDataset(tmp_path / "data", model)}
    held_out = {len(s.tokens) for s in HeadDataset(tmp_path / "data" / "dev", model)}
    lengths = [len(a["prompt"]) + len(a["answer"]) for a in answers]
    assert held_out == {lengths[1], lengths[4]}
    assert trained_on == {lengths[i] for i in (0, 2, 3, 5)}
    assert main(["train-heads", "train", "--kind", "eagle", "--model", str(tmp_path / "tiny"),
                 "--data", str(tmp_path / "data"), "--out", str(tmp_path / "run"), "--epochs", "2",
                 "--eval-prompts", "0", "--batch-tokens", "64", "--loss-on", "answers", "--token-weight",
                 "0.5", "--feature-noise", "0.2", "--warmup-ratio", "0.05"]) == 0  # fmt: skip
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    history = report["history"]
    assert [r["epoch"] for r in history] == [1, 2] and all(r["dev_loss"] > 0 for r in history)
    assert all(len(r["dev_top1"]) == 1 for r in history)  # EAGLE: the first draft's agreement
    recipe = {k: report["config"][k] for k in ("loss_on", "token_weight", "feature_noise", "warmup_ratio")}
    assert recipe == {"loss_on": "answers", "token_weight": 0.5, "feature_noise": 0.2, "warmup_ratio": 0.05}
    # the trained head measured again on the dev answers: the top-1 agreement the run recorded
    # (it does not depend on the loss's settings)
    capsys.readouterr()
    assert main(["train-heads", "eval", "--kind", "eagle", "--model", str(tmp_path / "tiny"), "--head",
                 str(tmp_path / "run" / "head"), "--data", str(tmp_path / "data" / "dev"),
                 "--batch-tokens", "64"]) == 0  # fmt: skip
    measured = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert measured["dev_top1"] == history[-1]["dev_top1"] and measured["dev_loss"] > 0
    # deeper levels: the head on its own outputs, one agreement per step; the first step unchanged
    assert main(["train-heads", "eval", "--kind", "eagle", "--model", str(tmp_path / "tiny"), "--head",
                 str(tmp_path / "run" / "head"), "--data", str(tmp_path / "data" / "dev"),
                 "--batch-tokens", "64", "--ttt-steps", "3"]) == 0  # fmt: skip
    deeper = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["dev_top1"]
    assert len(deeper) == 3 and deeper[0] == measured["dev_top1"][0] and all(0 <= t <= 1 for t in deeper)
    assert main(["train-heads", "eval", "--kind", "eagle", "--model", str(tmp_path / "tiny"), "--head",
                 str(tmp_path / "run" / "head"), "--data", str(tmp_path / "data" / "dev"),
                 "--ttt-steps", "0"]) != 0  # fmt: skip
    assert "ttt_steps must be an int >= 1, got 0" in capsys.readouterr().err
    assert main(["train-heads", "eval", "--kind", "medusa", "--model", str(tmp_path / "tiny"), "--head",
                 str(tmp_path / "run" / "head"), "--data", str(tmp_path / "data" / "dev")]) != 0  # fmt: skip
    assert "holds a 'eagle' head, not the --kind 'medusa'" in capsys.readouterr().err
    # a head that never reads its own outputs has no deeper levels to measure
    assert main(["train-heads", "eval", "--kind", "medusa", "--model", str(tmp_path / "tiny"), "--head",
                 str(tmp_path / "run" / "head"), "--data", str(tmp_path / "data" / "dev"),
                 "--ttt-steps", "3"]) != 0  # fmt: skip
    assert "a 'medusa' head has none, got --ttt-steps 3" in capsys.readouterr().err
    # the head cut to the 40 read-out rows the training data holds most often
    assert main(["train-heads", "readout", "--head", str(tmp_path / "run" / "head"), "--data",
                 str(tmp_path / "data"), "--rows", "40", "--out", str(tmp_path / "cut")]) == 0  # fmt: skip
    said = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    full, cut = (heads_module.load(tmp_path / name) for name in ("run/head", "cut"))
    counts = torch.zeros(len(tokenizer), dtype=torch.long)
    for seq in HeadDataset(tmp_path / "data", model):
        counts += torch.bincount(seq.tokens, minlength=len(tokenizer))
    kept, own = cut.target_ids(), full.target_ids()
    dropped = own[~torch.isin(own, kept)]
    assert len(kept) == 40 and bool(torch.isin(kept, own).all())
    assert counts[kept].min() >= counts[dropped].max()  # the most frequent rows, ties aside
    assert said["token_share"] == round(float(counts[kept].sum() / counts[own].sum()), 4)
    assert said["from_rows"] == len(own) and said["rows"] == 40
    for bad, message in (("41000", "rows must be in"), ("0", "rows must be in")):
        assert main(["train-heads", "readout", "--head", str(tmp_path / "run" / "head"), "--data",
                     str(tmp_path / "data"), "--rows", bad, "--out", str(tmp_path / "bad")]) != 0  # fmt: skip
        assert message in capsys.readouterr().err
