"""Train the tiny Qwen2-architecture model on the countdown task, on CPU, seeded.

Plain torch around ``transformers``' own ``Qwen2ForCausalLM``, so the module
trained here is the one exported and the one vLLM's Qwen2 implementation
loads. Batches are sampled on the fly from the task generator (no data set on
disk), grouped by length so padding stays small, and right-padded: with
causal attention no real token ever attends to a pad, so no attention mask is
needed and ``sdpa`` takes its fused causal path.

The loss covers the answer and its closing ``<|im_end|>`` only; the prompt is
context. Targets are the task's exact next-token distributions, known in
closed form (:func:`star.model.task.answer_steps`), not only the drawn
tokens: a draw is a noisy target. For the first answer token, the sampled
item count that fixes most of the length, this is what makes the model
condition on the size word at all (trained on the drawn token, even weighted
up, it learned roughly the marginal over sizes and greedy gave two items for
every size); at the stop-or-continue choices inside items it cuts threefold the
probability the model leaks onto wrong words, which sampling turns into
off-task answers. The first token also weighs ``plan_weight`` times a normal
one, and half the examples are cut after their first ``head_items`` items, a
few tokens each, to double the examples of it and to teach counting down from
counts the task rarely draws.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from tokenizers import Tokenizer
from tqdm import tqdm
from transformers import Qwen2Config, Qwen2ForCausalLM

from star.model import task
from star.model.config import TrainConfig
from star.model.tokenizer import ENDOFTEXT, IM_END, render_chat, token_id

IGNORE = -100  # label of positions without loss (torch's cross-entropy ignore_index)
SHAPE_QUANTUM = 64  # sequence widths and output-layer rows are padded to multiples of this


def model_config(cfg: TrainConfig, tok: Tokenizer) -> Qwen2Config:
    """The Qwen2 config of the tiny model (vocabulary rounded up to a multiple of 64)."""
    vocab = tok.get_vocab_size()
    return Qwen2Config(
        vocab_size=64 * math.ceil(vocab / 64),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        # Untied: the output layer has to map "the item labelled k" to the
        # label k - 1, easier with its own matrix than through the embedding.
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=token_id(tok, IM_END),
        pad_token_id=token_id(tok, ENDOFTEXT),
        use_sliding_window=False,
        dtype="float32",
    )


@dataclass(frozen=True, slots=True)
class Example:
    """One training sequence; the answer starts at ``prompt_len``.

    ``probs[j]`` and ``alts[j]`` give the target of answer token j as a
    two-way distribution: ``ids[prompt_len + j]`` with ``probs[j]``, token
    ``alts[j]`` (or nothing: IGNORE) with the rest.
    """

    ids: list[int]
    prompt_len: int
    size: int  # index of the prompt's size word in task.SIZES
    probs: list[float]
    alts: list[int]


@dataclass(frozen=True, slots=True)
class Batch:
    """Right-padded [B, T] inputs and targets, and each row's item-count decision."""

    ids: torch.Tensor
    labels: torch.Tensor  # IGNORE on prompt, padding and the first answer token
    probs: torch.Tensor  # probability of labels; the rest goes to alts
    alts: torch.Tensor  # the other possible token, or IGNORE
    plan_pos: torch.Tensor  # [B] position whose output is the first answer token
    plan_size: torch.Tensor  # [B] size index: row of the soft target


def encode_example(
    tok: Tokenizer, prompt: task.Prompt, answer: task.Answer, head_items: int | None = None
) -> Example:
    """Encode prompt and answer the way an engine sees them.

    The prompt is the chat template's text encoded on its own (as vLLM does
    for a chat request), the answer is appended as ids; ``head_items`` keeps
    only that many items and drops the end token.
    """
    prompt_ids = tok.encode(render_chat(prompt.messages())).ids
    if head_items is not None:
        answer = task.Answer(answer.items[:head_items])
    steps = task.answer_steps(prompt, answer)
    answer_ids = [_piece_id(tok, st.piece) for st in steps]
    probs = [st.prob for st in steps]
    alts = [IGNORE if st.alt is None else _piece_id(tok, st.alt) for st in steps]
    if head_items is None:
        answer_ids.append(token_id(tok, IM_END))
        probs.append(1.0)
        alts.append(IGNORE)
    size = list(task.SIZES).index(prompt.size)
    return Example(prompt_ids + answer_ids, len(prompt_ids), size, probs, alts)


def _piece_id(tok: Tokenizer, piece: str) -> int:
    # Every answer piece is one token (tokenizer.single_token_strings checks
    # the labels and words; ".", "\n" are byte tokens).
    ids = tok.encode(piece).ids
    if len(ids) != 1:
        raise ValueError(f"answer piece {piece!r} is {len(ids)} tokens")
    return int(ids[0])


def plan_targets(tok: Tokenizer, vocab_size: int) -> torch.Tensor:
    """[sizes, vocab]: each size's item-count distribution over the label tokens."""
    targets = torch.zeros(len(task.SIZES), vocab_size)
    labels = [token_id(tok, task.label(n)) for n in range(1, task.N_MAX + 1)]
    for row, size in enumerate(task.SIZES):
        targets[row, labels] = torch.from_numpy(task.count_pmf(size)).float()
    return targets


def _examples(tok: Tokenizer, cfg: TrainConfig, rng: np.random.Generator) -> Iterator[Example]:
    while True:
        prompt = task.sample_prompt(rng)
        if rng.random() < cfg.head_only_fraction:
            # Item counts drawn uniformly: large counts are rare under the task
            # (N > 200 in under 1 % of answers), so without these the model
            # counts down unreliably from there. The count token is trained
            # against the task's distribution whatever was drawn, so this
            # biases nothing.
            count = int(rng.integers(1, task.N_MAX + 1)) if rng.random() < 0.5 else None
            answer = task.sample_answer(prompt, rng, count)
            yield encode_example(tok, prompt, answer, cfg.head_items)
        else:
            yield encode_example(tok, prompt, task.sample_answer(prompt, rng))


def batches(
    tok: Tokenizer, cfg: TrainConfig, rng: np.random.Generator, pad_id: int
) -> Iterator[Batch]:
    """Yield batches of about ``batch_tokens`` tokens (padding included), similar lengths."""
    source = _examples(tok, cfg, rng)
    while True:
        pool = sorted((next(source) for _ in range(cfg.pool)), key=lambda e: len(e.ids))
        groups: list[list[Example]] = []
        group: list[Example] = []
        for ex in pool:
            # Sorted ascending, so the newest example sets the padded width.
            if group and (len(group) + 1) * _width(len(ex.ids)) > cfg.batch_tokens:
                groups.append(group)
                group = []
            group.append(ex)
        groups.append(group)
        for i in rng.permutation(len(groups)):
            yield _collate(groups[int(i)], pad_id)


def _width(n: int) -> int:
    # Few distinct matmul shapes: oneDNN keeps kernels per shape; with a new
    # shape every step a run ended at 3.9 GB resident, padded at 2.0 GB.
    return -(-n // SHAPE_QUANTUM) * SHAPE_QUANTUM


def _collate(group: list[Example], pad_id: int) -> Batch:
    width = _width(max(len(e.ids) for e in group))
    ids = torch.full((len(group), width), pad_id, dtype=torch.long)
    labels = torch.full((len(group), width), IGNORE, dtype=torch.long)
    alts = torch.full((len(group), width), IGNORE, dtype=torch.long)
    probs = torch.ones((len(group), width))
    for row, ex in enumerate(group):
        seq = torch.tensor(ex.ids, dtype=torch.long)
        ids[row, : len(seq)] = seq
        # The first answer token is learned from its soft target instead.
        start, end = ex.prompt_len + 1, len(seq)
        labels[row, start:end] = seq[start:]
        alts[row, start:end] = torch.tensor(ex.alts[1:], dtype=torch.long)
        probs[row, start:end] = torch.tensor(ex.probs[1:])
    return Batch(
        ids=ids,
        labels=labels,
        probs=probs,
        alts=alts,
        plan_pos=torch.tensor([e.prompt_len - 1 for e in group]),
        plan_size=torch.tensor([e.size for e in group]),
    )


def _lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio``."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _loss(
    model: Qwen2ForCausalLM, batch: Batch, targets: torch.Tensor, cfg: TrainConfig
) -> torch.Tensor:
    """Cross-entropy against the task's next-token distributions over the answers.

    The output layer runs only where there is a target (about 70 % of the
    batch: prompts and padding have none), a quarter of the step's work saved.
    """
    shifted = batch.labels[:, 1:]
    keep = shifted != IGNORE
    probs = batch.probs[:, 1:][keep]
    alts = batch.alts[:, 1:][keep]
    rows = torch.arange(batch.ids.shape[0])
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
        hidden = model.model(input_ids=batch.ids).last_hidden_state
        picked = torch.cat([hidden[:, :-1][keep], hidden[rows, batch.plan_pos]])
        n = picked.shape[0]
        picked = torch.nn.functional.pad(picked, (0, 0, 0, _width(n) - n))
        logits = model.lm_head(picked)[:n].float()
    logp = torch.log_softmax(logits, dim=-1)
    tokens, plans = logp[: -len(rows)], logp[-len(rows) :]
    main = tokens.gather(1, shifted[keep][:, None])[:, 0]
    has_alt = alts != IGNORE
    alt = tokens.gather(1, alts.clamp(min=0)[:, None])[:, 0]
    per_token = -(probs * main + torch.where(has_alt, (1 - probs) * alt, 0.0))
    plan = -(targets[batch.plan_size] * plans).sum()
    return (per_token.sum() + cfg.plan_weight * plan) / (
        len(per_token) + cfg.plan_weight * len(rows)
    )


def train(cfg: TrainConfig, tok: Tokenizer, progress: bool = True) -> Qwen2ForCausalLM:
    """Train a fresh model; the same config, tokenizer, torch and CPU give the same weights."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    config = model_config(cfg, tok)
    config._attn_implementation = "sdpa"
    model = Qwen2ForCausalLM(config)  # type: ignore[no-untyped-call]
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, cfg))
    data = batches(tok, cfg, rng, pad_id=token_id(tok, ENDOFTEXT))
    targets = plan_targets(tok, config.vocab_size)
    bar = tqdm(range(cfg.steps), desc="train-tiny", unit="step", disable=not progress)
    ema: float | None = None
    for _ in bar:
        batch = next(data)
        loss = _loss(model, batch, targets, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}", tokens=batch.ids.numel())
    model.eval()  # type: ignore[no-untyped-call]
    return model
