"""Training data and loss plumbing (the full run is `star model train-tiny`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from star.model import task
from star.model.config import TrainConfig
from star.model.tokenizer import IM_END, conversation_text, train_tokenizer
from star.model.train import IGNORE, batches, encode_example, model_config, plan_targets, train


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_tokenizer(seed=0)


def test_batches_align_labels_and_the_item_count_decision(tok: Tokenizer) -> None:
    cfg = TrainConfig()
    data = batches(tok, cfg, np.random.default_rng(0), pad_id=0)
    label_ids = {tok.token_to_id(task.label(n)) for n in range(1, task.N_MAX + 1)}
    for _ in range(5):
        b = next(data)
        assert b.ids.numel() <= cfg.batch_tokens or b.ids.shape[0] == 1
        assert b.ids.shape[1] % 64 == 0
        for row in range(b.ids.shape[0]):
            pos = int(b.plan_pos[row])
            # The decision is made on the "\n" closing "<|im_start|>assistant".
            assert tok.decode(
                b.ids[row, pos - 1 : pos + 1].tolist(), skip_special_tokens=False
            ) == ("assistant\n")
            assert int(b.ids[row, pos + 1]) in label_ids
            # No hard label on the prompt or on the decision itself.
            assert (b.labels[row, : pos + 2] == IGNORE).all()
            assert (b.labels[row, pos + 2 :] != IGNORE).any()
            assert int(b.ids[row, pos + 2]) == tok.token_to_id(".")


def test_plan_targets_are_the_task_distributions(tok: Tokenizer) -> None:
    targets = plan_targets(tok, 1024)
    assert torch.allclose(targets.sum(dim=1), torch.ones(len(task.SIZES)))
    huge = list(task.SIZES).index("huge")
    assert int(targets[huge].argmax()) == tok.token_to_id(task.label(task.greedy_count("huge")))
    assert targets[:, tok.token_to_id(IM_END)].sum() == 0


def test_training_is_seeded(tok: Tokenizer) -> None:
    cfg = dataclasses.replace(TrainConfig(), steps=2, batch_tokens=1024, pool=16, warmup_steps=1)
    a, b = (train(cfg, tok, progress=False) for _ in range(2))
    other = train(dataclasses.replace(cfg, seed=1), tok, progress=False)
    assert a.config.vocab_size == model_config(cfg, tok).vocab_size >= tok.get_vocab_size()
    for (name, pa), pb, po in zip(
        a.named_parameters(), b.parameters(), other.parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if pa.ndim == 2:
            assert not torch.equal(pa, po), name


def test_examples_tokenize_like_the_whole_conversation(tok: Tokenizer) -> None:
    rng = np.random.default_rng(3)
    for _ in range(100):
        prompt = task.sample_prompt(rng)
        answer = task.sample_answer(prompt, rng)
        ex = encode_example(tok, prompt, answer)
        assert ex.ids == tok.encode(conversation_text(prompt, answer)).ids
        assert len(ex.probs) == len(ex.alts) == len(ex.ids) - ex.prompt_len
        # A two-way target only where the task has a choice; odds in (0, 1].
        assert all(0 < p <= 1 for p in ex.probs)
        assert all(
            (a == IGNORE) == (p == 1) for a, p in zip(ex.alts[1:], ex.probs[1:], strict=True)
        )
