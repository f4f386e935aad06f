"""The synthetic task: distributions, prompt dependence, the answer checker."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from star.model import task


def _lengths(prompt: task.Prompt, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.array([task.sample_answer(prompt, rng).num_tokens() for _ in range(n)])


def test_count_pmf_is_a_distribution_with_the_documented_medians() -> None:
    for name, size in task.SIZES.items():
        pmf = task.count_pmf(name)
        assert pmf.shape == (task.N_MAX,)
        assert pmf.min() >= 0 and pmf.sum() == pytest.approx(1.0)
        median = int(np.searchsorted(np.cumsum(pmf), 0.5)) + 1
        assert median == size.nominal == task.greedy_count(name)
        # Greedy picks the nominal count by a wide margin.
        top2 = np.sort(pmf)[-2:]
        assert top2[1] > 2 * top2[0]
        # Truncation, not clipping: no spike at N_MAX for greedy to pick.
        assert pmf[-1] < pmf.max() / 5


def test_length_depends_on_the_size_word() -> None:
    means = [_lengths(task.Prompt("animals", size, "owl"), 400).mean() for size in task.SIZES]
    # Each size is 2 to 3 times the previous one.
    for shorter, longer in itertools.pairwise(means):
        assert longer > 1.7 * shorter
    assert means[0] < 20 and means[-1] > 400


def test_length_depends_on_the_topic() -> None:
    trees = _lengths(task.Prompt("trees", "long"), 400)
    metals = _lengths(task.Prompt("metals", "long"), 400)
    # Same item counts in distribution, 5.5 against 4.25 tokens per item.
    assert metals.mean() > 1.15 * trees.mean()
    expected = task.expected_tokens(task.Prompt("metals", "long"))
    assert metals.mean() == pytest.approx(expected, rel=0.1)


def test_length_depends_on_sampling() -> None:
    lengths = _lengths(task.Prompt("tools", "huge", "saw"), 400)
    assert lengths.std() > 0.3 * lengths.mean()
    assert lengths.max() > 1000  # the long tail the predictor and migration need
    assert lengths.max() <= task.N_MAX * (3 + task.MAX_WORDS) + 1


def test_sampled_and_greedy_answers_pass_the_checker() -> None:
    rng = np.random.default_rng(1)
    for _ in range(200):
        prompt = task.sample_prompt(rng)
        answer = task.sample_answer(prompt, rng)
        assert task.check_answer(prompt, answer.text()) == task.Check(
            count=len(answer.items), items=len(answer.items), errors=()
        )
        greedy = task.greedy_answer(prompt)
        assert len(greedy.items) == task.greedy_count(prompt.size)
        assert task.check_answer(prompt, greedy.text()).ok


def test_greedy_answers_differ_between_prompts() -> None:
    prompts = [task.Prompt(t, s, task.TOPICS[t].words[3]) for t in task.TOPICS for s in task.SIZES]
    texts = {task.greedy_answer(p).text() for p in prompts}
    assert len(texts) == len(prompts)


def test_greedy_words_per_item_follow_the_table() -> None:
    got = [task.greedy_words_per_item(t) for t in task.TOPICS]
    assert got == [2, 3, 1, 1, 2, 3, 2, 1]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("three. fox wolf\ntwo. bear\n", "stopped after 2 items"),
        ("three. fox wolf\none. bear\n", "expected 'two'"),
        ("two. fox bear\none. deer\n", "off the chain"),
        ("two. fox wolf\none. bear", "does not end with a newline"),
        ("two. fox wolf\n\none. bear\n", "not an item"),
        ("2. fox\n1. wolf\n", "not an item"),
        ("seven. fox wolf bear deer\n", "4 words"),
    ],
)
def test_checker_rejects_malformed_answers(text: str, error: str) -> None:
    check = task.check_answer(task.Prompt("animals", "tiny"), text)
    assert not check.ok
    assert any(error in e for e in check.errors), check.errors


def test_labels_are_distinct_lowercase_words() -> None:
    labels = [task.label(n) for n in range(1, task.N_MAX + 1)]
    assert len(set(labels)) == task.N_MAX
    assert all(lab.isalpha() and lab.islower() for lab in labels)
    assert task.label(37) == "thirtyseven" and task.label(250) == "twohundredfifty"
    with pytest.raises(ValueError, match="out of range"):
        task.label(0)


def test_prompts_render_every_template() -> None:
    for i in range(len(task.TEMPLATES)):
        prompt = task.Prompt("fruits", "medium", "fig", template=i)
        text = prompt.user_text()
        assert " medium" in text and " fruits" in text and " fig" in text
        bare = dataclasses.replace(prompt, start=None).user_text()
        assert "fig" not in bare
    system = task.Prompt("fruits", "tiny", system="you write lists.").messages()
    assert [m["role"] for m in system] == ["system", "user"]
