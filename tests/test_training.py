"""Head training: the data writer and reader, losses that fall, exact resume, trained heads that
load and propose, bad input."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import build, hf_greedy

import treespec
from treespec import heads as heads_module
from treespec.heads.training import data as data_module
from treespec.heads.training.data import HeadDataset, write_dataset
from treespec.heads.training.prompts import DEV_PROMPTS, read_prompt_file, train_prompts
from treespec.heads.training.train import (
    LOSSES,
    ReadoutRows,
    TrainConfig,
    build_module,
    dev_loss,
    dev_metrics,
    lr_lambda,
    make_batches,
    token_subset,
    train,
    trainable,
)

PROMPTS = [list(range(5, 12)), [20, 21, 22], list(range(30, 45)), [7, 8], [50, 51, 52, 53], [90, 3]]
LAYERS = (0, 1, 1)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    model = build("llama")
    with torch.no_grad():  # a confident target (a random one is near uniform: nothing to learn)
        model.lm_head.weight.mul_(8)
    folder = tmp_path_factory.mktemp("data")
    write_dataset(model, PROMPTS, folder, feature_layers=LAYERS, max_new_tokens=12, batch_size=4,
                  shard_size=4, progress=False)  # fmt: skip
    return model, folder


def test_data_round_trip_is_exact(tiny_data):
    model, folder = tiny_data
    manifest = json.loads((folder / "manifest.json").read_text())
    assert [s["prompt_ids"] for s in manifest["shards"]] == [[0, 1, 2, 3], [4, 5]]
    sequences = HeadDataset(folder, model).sequences()
    for prompt, seq in zip(PROMPTS, sequences, strict=True):
        answer = hf_greedy(model, prompt, 12)
        assert seq.tokens.tolist() == prompt + answer and seq.prompt_len == len(prompt)
        with torch.no_grad():
            states = model(seq.tokens[None], output_hidden_states=True).hidden_states
        assert torch.equal(seq.hidden, states[-1][0].to(torch.bfloat16))
        want = torch.cat([states[i][0] for i in LAYERS], -1).to(torch.bfloat16)
        assert torch.equal(seq.features, want)


def test_data_resumes_after_a_kill(tiny_data, tmp_path, monkeypatch):
    model, reference = tiny_data
    real = data_module._write_shard
    calls = []

    def dies_on_second(folder, index, ids, records):
        if calls:
            raise KeyboardInterrupt  # killed while the second shard was being written
        calls.append(index)
        return real(folder, index, ids, records)

    monkeypatch.setattr(data_module, "_write_shard", dies_on_second)
    with pytest.raises(KeyboardInterrupt):
        write_dataset(model, PROMPTS, tmp_path, feature_layers=LAYERS, max_new_tokens=12, batch_size=4,
                      shard_size=4, progress=False)  # fmt: skip
    assert len(json.loads((tmp_path / "manifest.json").read_text())["shards"]) == 1
    monkeypatch.setattr(data_module, "_write_shard", real)
    write_dataset(model, PROMPTS, tmp_path, feature_layers=LAYERS, max_new_tokens=12, batch_size=4,
                  shard_size=4, progress=False)  # fmt: skip
    got, want = HeadDataset(tmp_path).sequences(), HeadDataset(reference).sequences()
    assert [s.tokens.tolist() for s in got] == [s.tokens.tolist() for s in want]
    assert all(torch.equal(a.hidden, b.hidden) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize(
    "kind", ["eagle", "eagle3", "medusa", "draft", "eagle-ttt", "eagle3-ttt", "medusa-conditioned"]
)
def test_a_few_steps_reduce_the_loss_on_a_fixed_batch(tiny_data, kind):
    model, folder = tiny_data
    data = HeadDataset(folder, model)
    ttt = 3 if kind.endswith("-ttt") else 1
    conditioned = kind.endswith("-conditioned")
    kind = kind.removesuffix("-ttt").removesuffix("-conditioned")
    config = TrainConfig(kind=kind, draft_layers=1, draft_vocab_size=64, medusa_heads=2, feature_noise=0.0,
                         ttt_steps=ttt, medusa_conditioned=conditioned)  # fmt: skip
    model.float().requires_grad_(False)
    module = build_module(config, model, data)
    batch = data.sequences()[:4]
    optimizer = torch.optim.AdamW(trainable(module), lr=3e-3)
    losses = []
    for _ in range(20):
        loss = LOSSES[kind](module, model, batch, config)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    # Soft targets have a floor (the teacher's entropy): ask for a steady, clear fall.
    assert losses[-1] < 0.95 * losses[0] and losses == sorted(losses, reverse=True), losses


def test_medusa_heads_learn_the_targets_distribution_of_the_token_they_draft(tiny_data):
    """Head i at position t: the target's softmax at h_{t+i+1} (it predicts x_{t+i+2}), over
    the read-out rows, for every t from the prompt's end - 2 while that position exists."""
    from types import SimpleNamespace

    model, folder = tiny_data
    seq = HeadDataset(folder, model).sequences()[2]
    n, p = len(seq.tokens), seq.prompt_len
    logits = torch.randn(n - 1 - (p - 2), 2, 40, generator=torch.Generator().manual_seed(0))

    class Fixed:  # stands in for MedusaHeads: fixed logits for the rows the loss hands over
        config = SimpleNamespace(num_heads=2, conditioned=False)

        def __call__(self, rows, readout, embeds=None):
            assert embeds is None
            assert torch.equal(rows, seq.hidden[p - 2 : n - 1].float())
            return logits

    config = TrainConfig(kind="medusa", draft_vocab_size=40)
    got = LOSSES["medusa"](Fixed(), model, [seq], config)
    teacher = torch.softmax(seq.hidden.float() @ model.lm_head.weight[:40].T, -1)
    want = 0.0
    for i in range(2):
        t = torch.arange(p - 2, n - 1 - i)  # head i needs position t + i + 1 <= n - 1
        ce = -(teacher[t + i + 1] * torch.log_softmax(logits[t - (p - 2), i], -1)).sum(-1).mean()
        want += 0.8**i * ce
    torch.testing.assert_close(got, want / 1.8)


def test_conditioned_medusa_heads_read_the_tokens_before_their_guess(tiny_data):
    """Teacher forcing: at position t head i reads the embeddings of x_{t+1} .. x_{t+i+1} (the
    loss hands every head x_{t+1} .. x_{t+K}; head i reads its first i + 1)."""
    from types import SimpleNamespace

    model, folder = tiny_data
    seq = HeadDataset(folder, model).sequences()[2]
    n, p = len(seq.tokens), seq.prompt_len
    seen = {}

    class Fixed:
        config = SimpleNamespace(num_heads=2, conditioned=True)

        def __call__(self, rows, readout, embeds=None):
            seen["embeds"] = embeds
            return torch.zeros(len(rows), 2, 40, requires_grad=True)

    LOSSES["medusa"](Fixed(), model, [seq], TrainConfig(kind="medusa", draft_vocab_size=40))
    t = torch.arange(p - 2, n - 1)
    at = (t[:, None] + 1 + torch.arange(2)).clamp(max=n - 1)
    torch.testing.assert_close(seen["embeds"], model.get_input_embeddings()(seq.tokens[at]).float())


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_resume_continues_exactly(tiny_data, tmp_path, kind):
    model, folder = tiny_data
    data = HeadDataset(folder, model)
    config = TrainConfig(kind=kind, epochs=2, batch_tokens=40, warmup_steps=2, medusa_heads=2)
    whole = train(config, model, data, tmp_path / "whole", progress=False)
    train(config, model, data, tmp_path / "cut", max_steps=3, progress=False)
    cut_s = torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=True)["state"]["train_s"]
    resumed = train(config, model, data, tmp_path / "cut", resume=True, progress=False)
    planned = sum(len(make_batches(data.sequences(), config, epoch)) for epoch in range(config.epochs))
    assert resumed["steps"] == whole["steps"] == planned > 3  # every batch of every epoch, once
    assert [r["epoch"] for r in whole["history"]] == [1, 2] == [r["epoch"] for r in resumed["history"]]
    a = torch.load(tmp_path / "whole" / "checkpoint.pt", weights_only=True)
    b = torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=True)
    for name, tensor in a["module"].items():
        assert torch.equal(tensor, b["module"][name]), name
    assert a["scheduler"]["last_epoch"] == b["scheduler"]["last_epoch"]
    # the report's wall time covers both runs: the cut one's time is in its checkpoint
    assert cut_s > 1e-3 and resumed["wall_s"] == pytest.approx(cut_s + resumed["wall_s_this_run"], abs=1e-3)
    with pytest.raises(ValueError, match="checkpoint of a 'medusa' run; this run trains 'draft'|"
                       "checkpoint of a 'eagle' run; this run trains 'draft'"):  # fmt: skip
        train(
            TrainConfig(kind="draft", draft_layers=1),
            model,
            data,
            tmp_path / "cut",
            resume=True,
            progress=False,
        )


@pytest.mark.parametrize("kind", ["eagle", "medusa", "draft"])
def test_each_epoch_reports_the_loss_on_held_out_sequences(tiny_data, tmp_path, kind):
    """With dev data, every epoch's record holds dev_loss: the training loss without the feature
    noise on sequences never trained on, the same number however often it is asked for, and (here
    the dev sequences are two of the training ones, which the head learns) lower after training."""
    model, folder = tiny_data
    data = HeadDataset(folder, model)
    config = TrainConfig(kind=kind, epochs=3, lr=3e-3, batch_tokens=40, warmup_steps=1, medusa_heads=2,
                         draft_layers=1, feature_noise=0.2)  # fmt: skip
    held_out = data.sequences()[:2]
    untrained = build_module(config, model, data, data.sequences())
    mode = untrained.training
    before = dev_loss(config, untrained, model, held_out)
    assert before == dev_loss(config, untrained, model, held_out)  # no noise: repeatable
    assert untrained.training == mode  # left as it was found
    report = train(config, model, data, tmp_path, dev=data, progress=False)
    losses = [record["dev_loss"] for record in report["history"]]
    assert len(losses) == 3 and all(loss == loss and loss > 0 for loss in losses)
    assert losses[-1] < losses[0]
    with pytest.raises(ValueError, match="at least one held-out sequence"):
        dev_loss(config, untrained, model, [])


def _only_prompt(seq):
    """The sequence with its answer moved past its end: no position predicts an answer token (the
    last one predicts the token after the sequence, which the target would generate)."""
    return dataclasses.replace(seq, prompt_len=len(seq.tokens) + 2)


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "draft"])
def test_the_loss_on_answers_reads_only_positions_whose_token_the_target_generated(tiny_data, kind):
    model, folder = tiny_data
    data = HeadDataset(folder, model)
    model.float().requires_grad_(False)
    config = TrainConfig(kind=kind, draft_layers=1, draft_vocab_size=64, feature_noise=0.0, loss_on="answers")
    module = build_module(config, model, data)
    seq = data.sequences()[2]
    # a prompt of one token: every position predicts an answer token, so both settings agree
    short = dataclasses.replace(seq, prompt_len=1)
    every = dataclasses.replace(config, loss_on="all")
    torch.testing.assert_close(
        LOSSES[kind](module, model, [short], config), LOSSES[kind](module, model, [short], every)
    )
    # all prompt: nothing to learn under "answers" (a zero that still back-propagates), not so under "all"
    none = LOSSES[kind](module, model, [_only_prompt(seq)], config)
    assert none.item() == 0.0 and none.requires_grad
    assert LOSSES[kind](module, model, [_only_prompt(seq)], every).item() > 0
    # the real split: the answers' loss differs from the loss over every position
    assert (
        LOSSES[kind](module, model, [seq], config).item() != LOSSES[kind](module, model, [seq], every).item()
    )


def test_the_token_weight_scales_the_eagle_token_loss(tiny_data):
    model, folder = tiny_data
    data = HeadDataset(folder, model)
    model.float().requires_grad_(False)
    config = TrainConfig(kind="eagle", draft_vocab_size=64, feature_noise=0.0)
    head = build_module(config, model, data)
    batch = data.sequences()[:3]
    loss = {w: LOSSES["eagle"](head, model, batch, dataclasses.replace(config, token_weight=w)).item()
            for w in (0.0, 0.1, 1.0)}  # fmt: skip
    assert loss[0.0] < loss[0.1] < loss[1.0]
    assert loss[1.0] - loss[0.0] == pytest.approx(10 * (loss[0.1] - loss[0.0]), rel=1e-4)


def test_warmup_ratio_sets_the_warmup_from_the_runs_length():
    factor = lr_lambda(TrainConfig(kind="eagle", warmup_steps=3, warmup_ratio=0.1), 100)
    assert [factor(s) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert factor(99) == pytest.approx(0.1, abs=1e-3)  # cosine to 10 % at the end
    steps = lr_lambda(TrainConfig(kind="eagle", warmup_steps=4), 100)
    assert [steps(s) for s in (0, 3)] == pytest.approx([0.25, 1.0])


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("loss_on", "prompts", "loss_on must be one of"),
        ("warmup_ratio", 1.5, "warmup_ratio must be in"),
        ("feature_noise", -0.1, "feature_noise must be >= 0"),
        ("token_weight", -1.0, "token_weight must be >= 0"),
    ],
)
def test_bad_recipe_settings_are_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(kind="eagle", **{field: value})


def test_dev_top1_counts_the_answer_positions_per_step(tiny_data):
    """EAGLE kinds report, per step of the training-time test, the share of held-out answer
    positions whose top draft is the target's top token: one number per step, whatever the loss
    reads (here all positions or only the answers give the same share); Medusa one per head, a
    draft model one."""
    model, folder = tiny_data
    data = HeadDataset(folder, model)
    model.float().requires_grad_(False)
    config = TrainConfig(kind="eagle", draft_vocab_size=64, ttt_steps=2, batch_tokens=40)
    head = build_module(config, model, data)
    held_out = data.sequences()[:3]
    metrics = dev_metrics(config, head, model, held_out)
    assert len(metrics["dev_top1"]) == 2 and all(0.0 <= a <= 1.0 for a in metrics["dev_top1"])
    answers = dev_metrics(dataclasses.replace(config, loss_on="answers"), head, model, held_out)
    assert answers["dev_top1"] == metrics["dev_top1"]
    medusa = TrainConfig(kind="medusa", medusa_heads=2, batch_tokens=40)
    per_head = dev_metrics(medusa, build_module(medusa, model, data), model, held_out)["dev_top1"]
    assert len(per_head) == 2 and all(0.0 <= a <= 1.0 for a in per_head)  # Medusa: one per head
    # a draft model: one number, its answer positions' top-1 against the target's, by hand here
    draft = TrainConfig(kind="draft", draft_layers=1, draft_vocab_size=64, batch_tokens=40)
    module = build_module(draft, model, data)
    drafted = dev_metrics(draft, module, model, held_out)["dev_top1"]
    assert (
        drafted
        == dev_metrics(dataclasses.replace(draft, loss_on="answers"), module, model, held_out)["dev_top1"]
    )
    correct = count = 0
    with torch.no_grad():
        for seq in held_out:
            mine = module(seq.tokens[None]).logits[0, seq.prompt_len - 1 :, :64].argmax(-1)
            theirs = model.lm_head(seq.hidden[seq.prompt_len - 1 :].float())[:, :64].argmax(-1)
            correct, count = correct + int((mine == theirs).sum()), count + len(mine)
    assert drafted == [correct / count]


def test_a_resumed_run_refuses_another_recipe_and_names_what_differs(tiny_data, tmp_path):
    model, folder = tiny_data
    data = HeadDataset(folder, model)
    config = TrainConfig(kind="eagle", epochs=1, batch_tokens=40, warmup_steps=1, eval_prompts=0)
    train(config, model, data, tmp_path, max_steps=1, progress=False)
    with pytest.raises(
        ValueError, match=r"another configuration \(feature_noise: 0.1 -> 0.2, lr: 0.001 -> 0.0003\)"
    ):
        train(dataclasses.replace(config, lr=3e-4, feature_noise=0.2), model, data, tmp_path, resume=True,
              progress=False)  # fmt: skip
    # a setting added after a checkpoint was written is taken as having run at its default
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    del saved["state"]["recipe"]["readout"]
    torch.save(saved, tmp_path / "checkpoint.pt")
    # what does not change what is learnt may change
    report = train(dataclasses.replace(config, checkpoint_every=5), model, data, tmp_path, resume=True,
                   progress=False)  # fmt: skip
    assert report["history"][-1]["epoch"] == 1


def test_token_subsets_nest_and_count_answer_tokens(tiny_data):
    model, folder = tiny_data
    sequences = HeadDataset(folder, model).sequences()
    answers = [len(s.tokens) - s.prompt_len for s in sequences]
    small, large = token_subset(sequences, 20), token_subset(sequences, 40)
    size = [sum(len(s.tokens) - s.prompt_len for s in part) for part in (small, large)]
    assert 20 <= size[0] < 20 + max(answers) and 40 <= size[1] < 40 + max(answers)
    # the order is fixed by each sequence's tokens, not by where shards hold them (here reversed),
    # and the smaller subset opens the larger one
    assert [s.tokens.tolist() for s in token_subset(sequences[::-1], 40)] == [
        s.tokens.tolist() for s in large
    ]
    assert [s.tokens.tolist() for s in large[: len(small)]] == [s.tokens.tolist() for s in small]
    with pytest.raises(
        ValueError, match=f"data_tokens=1000 but the data holds only {sum(answers)} answer tokens"
    ):
        token_subset(sequences, 1000)
    with pytest.raises(ValueError, match="data_tokens must be a positive int"):
        TrainConfig(kind="eagle", data_tokens=0)


def test_resume_on_other_data_is_refused(tiny_data, tmp_path):
    model, folder = tiny_data
    data = HeadDataset(folder, model)
    config = TrainConfig(kind="medusa", epochs=1, batch_tokens=40, medusa_heads=2, eval_prompts=0)
    train(config, model, data, tmp_path, max_steps=1, progress=False)
    fewer = TrainConfig(
        kind="medusa", epochs=1, batch_tokens=40, medusa_heads=2, eval_prompts=0, data_tokens=20
    )
    with pytest.raises(ValueError, match="trained on other data or another plan.*use a new --out folder"):
        train(fewer, model, data, tmp_path, resume=True, progress=False)
    report = train(fewer, model, data, tmp_path / "subset", progress=False)
    assert 20 <= report["answer_tokens"] < sum(len(s.tokens) - s.prompt_len for s in data.sequences())


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_bf16_autocast_trains_fp32_weights_close_to_fp32(tiny_data, tmp_path, kind):
    model, folder = tiny_data
    data = HeadDataset(folder, model)
    runs = {}
    for precision in ("fp32", "bf16"):
        config = TrainConfig(kind=kind, epochs=2, batch_tokens=40, warmup_steps=2, ttt_steps=2,
                             feature_noise=0.0, precision=precision)  # fmt: skip
        report = train(config, model, data, tmp_path / precision, progress=False)
        state = torch.load(tmp_path / precision / "checkpoint.pt", weights_only=True)["module"]
        assert all(t.dtype == torch.float32 for t in state.values() if t.is_floating_point())
        runs[precision] = (report, state)
    (full, a), (half, b) = runs["fp32"], runs["bf16"]
    assert full["steps"] == half["steps"]
    assert half["history"][-1]["mean_loss"] == pytest.approx(full["history"][-1]["mean_loss"], rel=0.05)
    assert half["history"][-1]["mean_loss"] < half["history"][0]["mean_loss"]
    # autocast ran: the bf16 run's weights moved apart from the fp32 run's, but not far
    changed = [name for name in a if a[name].is_floating_point() and not torch.equal(a[name], b[name])]
    assert changed
    for name in changed:
        torch.testing.assert_close(b[name], a[name], atol=0.05, rtol=0.05)
    with pytest.raises(ValueError, match="precision must be one of"):
        TrainConfig(kind=kind, precision="fp16")


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa", "draft"])
def test_trained_head_loads_and_proposes(tiny_data, tmp_path, kind):
    model, folder = tiny_data
    data = HeadDataset(folder, model)
    config = TrainConfig(kind=kind, epochs=1, draft_layers=1, draft_vocab_size=64, medusa_heads=2,
                         eval_new_tokens=8, eval_prompts=1)  # fmt: skip
    report = train(config, model, data, tmp_path, eval_prompts=[PROMPTS[0]], progress=False)
    assert report["history"][0]["tau"] >= 1.0
    assert json.loads((tmp_path / "report.json").read_text())["steps"] == report["steps"]
    if kind == "draft":
        from treespec.heads.draft import load_draft
        from treespec.proposers import DraftModelProposer

        proposer = DraftModelProposer(load_draft(tmp_path / "head", model), target_model=model)
    else:
        from treespec.heads.training.train import proposer_for

        proposer = proposer_for(config, heads_module.load(tmp_path / "head"), model)
    out = treespec.generate(model, PROMPTS[:2], max_new_tokens=10, proposer=proposer)
    assert out.sequences == [hf_greedy(model, p, 10) for p in PROMPTS[:2]]


def test_bad_data_and_prompt_files(tiny_data, tmp_path):
    model, folder = tiny_data
    from transformers import LlamaConfig, LlamaForCausalLM

    wider = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))  # fmt: skip
    with pytest.raises(ValueError, match="hidden size 64; this target has 32"):
        HeadDataset(folder, wider)
    bigger = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))  # fmt: skip
    with pytest.raises(ValueError, match="vocabulary 128; this target has 256"):
        HeadDataset(folder, bigger)
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="holds no prompts"):
        read_prompt_file(tmp_path / "empty.txt")
    (tmp_path / "bad.jsonl").write_text('{"text": "hi"}\n')
    with pytest.raises(ValueError, match="turns\\[0\\], question, prompt"):
        read_prompt_file(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match="prompt list is empty"):
        write_dataset(model, [], tmp_path / "d", feature_layers=LAYERS)
    with pytest.raises(ValueError, match="kind must be one of"):
        TrainConfig(kind="hydra")


def test_train_prompts_are_disjoint_from_dev_and_benchmark_prompts():
    from treespec.prompts import DEFAULT_PROMPTS

    prompts = train_prompts()
    assert len(prompts) >= 300 and len(set(prompts)) == len(prompts)
    assert not set(prompts) & (set(DEV_PROMPTS) | set(DEFAULT_PROMPTS))


DDP_SCRIPT = """
import json, sys, torch
from transformers import AutoModelForCausalLM
from treespec.heads.training.data import HeadDataset
from treespec.heads.training.train import TrainConfig, train
import torch.distributed as dist
model_dir, data_dir, out_dir = sys.argv[1:4]
model = AutoModelForCausalLM.from_pretrained(model_dir)
config = TrainConfig(kind="medusa", epochs=1, batch_tokens=30, warmup_steps=1, medusa_heads=2)
report = train(config, model, HeadDataset(data_dir, model), out_dir, progress=False)
rank = dist.get_rank()
torch.save({"steps": report["steps"], "checksum": report["weights_checksum"]}, f"{out_dir}/rank{rank}.pt")
"""


def test_data_parallel_under_torchrun(tiny_data, tmp_path):
    """Two processes under torchrun: each takes half the batches, gradients are averaged, both
    ranks end with the same weights, and rank 0 saves a loadable head."""
    import subprocess
    import sys

    model, folder = tiny_data
    model.save_pretrained(tmp_path / "model")
    (tmp_path / "ddp.py").write_text(DDP_SCRIPT)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
               str(tmp_path / "ddp.py"), str(tmp_path / "model"), str(folder), str(tmp_path / "out")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    ranks = [torch.load(tmp_path / "out" / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    steps = [r["steps"] for r in ranks]
    assert ranks[0]["checksum"] == ranks[1]["checksum"]  # both ranks hold the same weights
    data = HeadDataset(folder, model)
    single = train(TrainConfig(kind="medusa", epochs=1, batch_tokens=30, warmup_steps=1, medusa_heads=2),
                   model, data, tmp_path / "single", progress=False)  # fmt: skip
    assert steps[0] == steps[1] == single["steps"] // 2
    assert heads_module.load(tmp_path / "out" / "head").config.num_heads == 2


@pytest.mark.slow
def test_train_heads_cli_end_to_end(tmp_path):
    """``treespec train-heads data`` then ``train`` on a tiny model that uses SmolLM2's tokenizer
    (chat template included), from a prompt file."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from treespec.cli import main
    from treespec.models import model_path

    tokenizer = AutoTokenizer.from_pretrained(model_path("smollm2-135m-instruct"))
    torch.manual_seed(0)
    tiny = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                        tie_word_embeddings=True))  # fmt: skip
    tiny.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    (tmp_path / "prompts.jsonl").write_text(
        "\n".join(json.dumps({"prompt": p}) for p in ["Hi there", "Count to 5"])
    )
    assert main(["train-heads", "data", "--model", str(tmp_path / "tiny"), "--out", str(tmp_path / "data"),
                 "--prompts", str(tmp_path / "prompts.jsonl"), "--no-builtin-prompts", "--max-new-tokens", "6",
                 "--dtype", "fp32"]) == 0  # fmt: skip
    assert main(["train-heads", "train", "--kind", "medusa", "--model", str(tmp_path / "tiny"),
                 "--data", str(tmp_path / "data"), "--out", str(tmp_path / "run"), "--epochs", "1",
                 "--eval-prompts", "1", "--eval-new-tokens", "4", "--batch-tokens", "64",
                 "--medusa-conditioned"]) == 0  # fmt: skip
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["history"][0]["tau"] >= 1.0 and report["data_sequences"] == 2  # a conditioned tree drafted
    assert report["config"]["medusa_conditioned"] is True
    assert heads_module.load(tmp_path / "run" / "head").config.conditioned
    assert "dev_loss" not in report["history"][0]  # no DATA/dev: no held-out loss
    # held-out data named on the command line (here the training data itself): each epoch's loss on it
    assert main(["train-heads", "train", "--kind", "medusa", "--model", str(tmp_path / "tiny"),
                 "--data", str(tmp_path / "data"), "--out", str(tmp_path / "run-dev"), "--epochs", "1",
                 "--eval-prompts", "0", "--batch-tokens", "64", "--dev-data", str(tmp_path / "data")]) == 0  # fmt: skip
    report = json.loads((tmp_path / "run-dev" / "report.json").read_text())
    assert report["history"][0]["dev_loss"] > 0
    assert main(["train-heads", "train", "--kind", "medusa", "--model", str(tmp_path / "tiny"),
                 "--data", str(tmp_path / "data"), "--out", str(tmp_path / "run-x"),
                 "--dev-data", str(tmp_path / "nowhere")]) == 2  # fmt: skip
    (tmp_path / "empty.txt").write_text("")
    assert main(["train-heads", "data", "--model", str(tmp_path / "tiny"), "--out", str(tmp_path / "d2"),
                 "--prompts", str(tmp_path / "empty.txt"), "--no-builtin-prompts"]) == 2  # fmt: skip


def test_draft_exports_as_a_standalone_hf_model(tiny_data, tmp_path):
    """The draft saved for treespec reuses the target's tables; exported, it is a plain HF model
    folder (tables included) that AutoModelForCausalLM loads with the same logits."""
    from transformers import AutoModelForCausalLM

    from treespec.heads.draft import export_draft_hf, load_draft, make_draft, save_draft

    model, _ = tiny_data
    draft = make_draft(model, 1)
    save_draft(draft, tmp_path / "draft", dtype=torch.float32)
    loaded = load_draft(tmp_path / "draft", model)
    assert loaded.get_input_embeddings() is model.get_input_embeddings()
    export_draft_hf(loaded, tmp_path / "hf")
    standalone = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(standalone(ids).logits, draft(ids).logits)
    assert standalone.config.num_hidden_layers == 1
    with pytest.raises(ValueError, match="num_layers"):
        make_draft(model, 2)


def test_a_draft_trained_on_the_datas_frequent_tokens_carries_them_and_drafts_through_them(
    tiny_data, tmp_path
):
    """``readout="frequent"``: the draft's loss reads the data's most frequent tokens, the draft
    carries them through a folder round trip, a checkpoint resume and an HF export (which leaves
    them out), and drafts only them while the output stays the target's; Medusa refuses it."""
    from conftest import record_drafted
    from transformers import AutoModelForCausalLM

    from treespec.heads.draft import export_draft_hf, load_draft, readout_ids, set_readout_ids
    from treespec.heads.training.train import frequent_tokens
    from treespec.proposers import DraftModelProposer

    model, folder = tiny_data
    data = HeadDataset(folder, model)
    config = TrainConfig(kind="draft", epochs=1, draft_layers=1, draft_vocab_size=24, readout="frequent",
                         batch_tokens=40, eval_prompts=0)  # fmt: skip
    train(config, model, data, tmp_path, max_steps=1, progress=False)
    train(config, model, data, tmp_path, resume=True, progress=False)  # the buffer rides in the checkpoint
    expected = frequent_tokens(data.sequences(), 24, 128)
    assert not torch.equal(expected, torch.arange(24))  # this data's frequent tokens are not the first ids
    draft = load_draft(tmp_path / "head", model)
    assert torch.equal(readout_ids(draft), expected)
    ids = torch.tensor([seq.tokens[1:].tolist() for seq in data.sequences()[:1]])
    rows = ReadoutRows(model.lm_head, expected)
    with torch.no_grad():  # the loss reads exactly those rows of the shared LM head
        hidden = draft.base_model(input_ids=ids).last_hidden_state
        assert torch.equal(rows(hidden), draft.lm_head(hidden)[..., expected])
    proposer = DraftModelProposer(draft, target_model=model, dynamic=(3, 3, 8))
    drafted = record_drafted(proposer)
    out = treespec.generate(model, PROMPTS[:2], max_new_tokens=12, proposer=proposer)
    assert out.sequences == [hf_greedy(model, p, 12) for p in PROMPTS[:2]]
    assert drafted and drafted <= set(expected.tolist())
    whole = DraftModelProposer(draft, target_model=model, dynamic=(3, 3, 8), readout_ids=range(128))
    assert len(whole.readout_ids) == 128  # named ids win over the carried ones
    export_draft_hf(draft, tmp_path / "hf")
    standalone = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert not hasattr(standalone, "readout_ids") and hasattr(draft, "readout_ids")
    with pytest.raises(ValueError, match="readout 'frequent' is for draft models"):
        TrainConfig(kind="medusa", readout="frequent")
    with pytest.raises(ValueError, match="readout must be one of"):
        TrainConfig(kind="draft", readout="last")
    for bad, error, message in (
        (expected.float(), TypeError, "1-D integer tensor"),
        (torch.tensor([3, 3]), ValueError, "distinct ids"),
        (torch.tensor([5, 128]), ValueError, "distinct ids in \\[0, 128\\)"),
    ):
        with pytest.raises(error, match=message):
            set_readout_ids(draft, bad)


def test_training_time_test_feeds_each_depth_what_inference_feeds_it():
    """Step k of the unrolled head at position t equals a depth-(k+1) draft at inference: the head
    run on the target's features up to t - k, then on its own outputs, with plain causal attention
    over that one sequence."""
    from treespec.heads.eagle import EagleConfig, EagleHead
    from treespec.heads.training.train import UnrolledAttention

    torch.manual_seed(0)
    head = EagleHead(EagleConfig(hidden_size=16, vocab_size=50, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=8, intermediate_size=32)).eval()  # fmt: skip
    lengths = [6, 4]
    rows = sum(lengths)
    embeds, features = torch.randn(rows, 16), torch.randn(rows, 16)
    attention = UnrolledAttention(lengths)
    first = torch.tensor([0, lengths[0]])
    outs, inputs = [], features
    with torch.no_grad():
        for _ in range(3):
            out = head(embeds, inputs, attention.pos, attention)
            outs.append(out)
            inputs = torch.roll(out, 1, 0)
            inputs[first] = 0.0

        def causal(q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                is_causal=True, enable_gqa=True)[0].transpose(0, 1)  # fmt: skip

        for seq, start in ((0, 0), (1, lengths[0])):
            for step in range(3):
                for t in range(step, lengths[seq]):
                    ctx = list(range(start, start + t - step + 1))  # real features at positions <= t - k
                    feats = features[ctx]
                    for _ in range(step):  # each draft's input: the previous row's output
                        n = len(feats)
                        out = head(embeds[start : start + n], feats, torch.arange(n), causal)
                        feats = torch.cat([feats, out[-1:]])
                    n = len(feats)
                    want = head(embeds[start : start + n], feats, torch.arange(n), causal)[-1]
                    torch.testing.assert_close(outs[step][start + t], want, atol=1e-5, rtol=1e-5)


def test_acceptance_by_depth_from_committed_lengths():
    from treespec.heads.training.train import acceptance_by_depth, expand_histogram

    assert acceptance_by_depth([1, 2, 3, 3]) == [0.75, 2 / 3]
    assert acceptance_by_depth([1, 1]) == [0.0]
    # the bench's histogram, as read back from JSON (string keys)
    assert sorted(expand_histogram({"1": 1, "3": 2, "2": 1})) == [1, 2, 3, 3]
