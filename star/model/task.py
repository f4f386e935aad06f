"""The synthetic "countdown list" task the tiny demo model is trained on.

A prompt asks for a list of a topic and a size (``give me a long list of
animals starting with owl.``); the answer counts its labels down to one, so
the hidden state carries "how far to go" while the length stays sampled
(item count N from :data:`SIZES` with :data:`MODE_MASS` on the nominal count,
words per item from :data:`TOPICS`). Pure (no torch): prompts, answers, the
exact distributions, the greedy answer and a checker for model output. The
task's design and its measurements: ``docs/tiny-model.md``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

N_MAX = 250
"""Largest item count: each label 1..N_MAX is a single token of the tokenizer."""

_ONES = "one two three four five six seven eight nine".split()
_TEENS = "ten eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen".split()
_TENS = "twenty thirty forty fifty sixty seventy eighty ninety".split()


def label(n: int) -> str:
    """The item label of ``n``: the number spelled out as one word ("thirtyseven").

    Words, not digits: Qwen2's tokenizer splits digits one per token (and
    transformers forces that pre-tokenizer on every ``qwen2`` model), so
    counting down in digits would need carries across tokens, which a
    2-layer model learns poorly and which loops forever when it slips
    (30 → 39 → … → 30). A letters-only word is one pre-token, the tokenizer
    makes each label one token, and counting down is a next-token lookup.
    """
    if not 1 <= n <= 999:
        raise ValueError(f"label out of range: {n}")
    hundreds, rest = divmod(n, 100)
    head = f"{_ONES[hundreds - 1]}hundred" if hundreds else ""
    if rest == 0:
        tail = ""
    elif rest < 10:
        tail = _ONES[rest - 1]
    elif rest < 20:
        tail = _TEENS[rest - 10]
    else:
        tens, ones = divmod(rest, 10)
        tail = _TENS[tens - 2] + (_ONES[ones - 1] if ones else "")
    return head + tail


_LABELS = {label(n): n for n in range(1, N_MAX + 1)}

MAX_WORDS = 3
"""Most words in one item."""


MODE_MASS = 0.3
"""Probability that the item count is exactly the size's nominal count."""


@dataclass(frozen=True, slots=True)
class Size:
    """Item-count distribution of one size word: nominal count (the median) and log-sigma."""

    nominal: int
    sigma: float


SIZES: dict[str, Size] = {
    "tiny": Size(2, 0.5),
    "short": Size(6, 0.5),
    "medium": Size(18, 0.5),
    "long": Size(50, 0.5),
    "huge": Size(100, 0.5),
}


@dataclass(frozen=True, slots=True)
class Topic:
    """A topic: its words in chain order and P(item has 1, 2, 3 words)."""

    words: tuple[str, ...]
    words_per_item: tuple[float, float, float]


# topic, P(1, 2, 3 words per item), the chain. Probabilities are chosen so
# that greedy's stop-or-continue choice inside an item is never close to a
# tie (greedy words per item: 2, 3, 1, 1, 2, 3, 2, 1).
_TOPIC_TABLE = """
animals      .25 .55 .20  fox wolf bear deer owl hare lynx seal crow mole frog swan
fruits       .15 .35 .50  apple pear plum fig lime kiwi mango peach grape cherry melon lemon
colors       .70 .20 .10  red blue green amber violet teal pink gray gold olive navy coral
cities       .60 .30 .10  paris rome oslo lima cairo tokyo delhi quito seoul dakar bern hanoi
tools        .20 .60 .20  hammer saw drill wrench chisel pliers clamp ruler rasp awl vise shovel
metals       .10 .30 .60  iron copper zinc tin lead nickel silver cobalt chrome bronze brass steel
instruments  .35 .45 .20  flute harp drum cello oboe lute horn viola banjo tuba sitar organ
trees        .80 .15 .05  oak pine birch maple cedar elm ash willow spruce alder beech yew
"""

TOPICS: dict[str, Topic] = {
    cols[0]: Topic(tuple(cols[4:]), (float(cols[1]), float(cols[2]), float(cols[3])))
    for cols in (line.split() for line in _TOPIC_TABLE.strip().splitlines())
}

# User-message phrasings: {size} and {topic} always follow a space so each is
# one token whatever the phrasing; {start} is the optional " starting with X"-
# style clause of that phrasing.
TEMPLATES: tuple[tuple[str, str], ...] = (
    ("give me a {size} list of {topic}{start}.", " starting with {word}"),
    ("list {topic}{start}, keep it {size}.", " from {word}"),
    ("i need a {size} list of {topic}{start}.", ", begin at {word}"),
    ("please write a {size} list of {topic}{start}.", " starting at {word}"),
)

SYSTEM_PROMPTS: tuple[str, ...] = (
    "you are a helpful assistant.",
    "you write lists.",
)


@dataclass(frozen=True, slots=True)
class Prompt:
    """One request of the task; ``start`` is None when the prompt names no start word."""

    topic: str
    size: str
    start: str | None = None
    template: int = 0
    system: str | None = None

    def user_text(self) -> str:
        """The user message."""
        text, clause = TEMPLATES[self.template]
        start = clause.format(word=self.start) if self.start is not None else ""
        return text.format(size=self.size, topic=self.topic, start=start)

    def messages(self) -> list[dict[str, str]]:
        """OpenAI-style chat messages for this prompt."""
        msgs = [{"role": "system", "content": self.system}] if self.system is not None else []
        msgs.append({"role": "user", "content": self.user_text()})
        return msgs

    def first_word_index(self) -> int:
        """Index in the topic chain of the answer's first word."""
        return TOPICS[self.topic].words.index(self.start) if self.start is not None else 0


@dataclass(frozen=True, slots=True)
class Answer:
    """An answer: its items in output order (item i is labelled ``len(items) - i``)."""

    items: tuple[tuple[str, ...], ...]

    def text(self) -> str:
        """The assistant message, without the end-of-turn token."""
        n = len(self.items)
        return "".join(f"{label(n - i)}. {' '.join(words)}\n" for i, words in enumerate(self.items))

    def num_tokens(self) -> int:
        """Tokens the answer costs with the project's tokenizer, end token included."""
        return sum(3 + len(words) for words in self.items) + 1


def _normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def count_pmf(size: str) -> np.ndarray:
    """P(N = n) for n = 1..N_MAX (index n - 1) for a size word.

    :data:`MODE_MASS` on the nominal count, the rest a log-normal rounded to
    the nearest integer and truncated (renormalised) to [1, N_MAX]:
    truncation, unlike clipping, puts no spike at N_MAX.
    """
    spec = SIZES[size]
    mu = math.log(spec.nominal)
    edges = [0.0] + [
        _normal_cdf((math.log(n + 0.5) - mu) / spec.sigma) for n in range(1, N_MAX + 1)
    ]
    pmf = np.diff(np.asarray(edges))
    pmf = (1 - MODE_MASS) * pmf / pmf.sum()
    pmf[spec.nominal - 1] += MODE_MASS
    return np.asarray(pmf, dtype=np.float64)


def greedy_count(size: str) -> int:
    """The most likely item count of a size: what ideal greedy decoding picks."""
    return int(np.argmax(count_pmf(size))) + 1


def stop_probability(topic: str, words: int) -> float:
    """P(an item ends after ``words`` words | it has at least that many)."""
    probs = TOPICS[topic].words_per_item
    return probs[words - 1] / sum(probs[words - 1 :])


def greedy_words_per_item(topic: str) -> int:
    """Words per item under greedy decoding: stop at the first w where stopping is likelier."""
    for w in range(1, MAX_WORDS + 1):
        if stop_probability(topic, w) > 0.5:
            return w
    return MAX_WORDS


@dataclass(frozen=True, slots=True)
class Step:
    """One piece of an answer (a label, ".", " word" or newline) and its odds.

    ``prob`` is the task's probability of ``piece`` given everything before
    it; the only other possible piece, if any, is ``alt`` (with 1 - prob).
    The first step (the item count) is the exception: its alternatives are
    all of :func:`count_pmf`.
    """

    piece: str
    prob: float
    alt: str | None


def answer_steps(prompt: Prompt, answer: Answer) -> list[Step]:
    """The answer as pieces with the task's next-piece distribution at each.

    Concatenated, the pieces are ``answer.text()``. Training uses the odds
    instead of only the drawn piece: the exact distribution makes a much
    less noisy target than one draw from it.
    """
    chain = TOPICS[prompt.topic].words
    pos = prompt.first_word_index()
    n = len(answer.items)
    steps = []
    for i, words in enumerate(answer.items):
        prob = float(count_pmf(prompt.size)[n - 1]) if i == 0 else 1.0
        steps += [Step(label(n - i), prob, None), Step(".", 1.0, None)]
        steps.append(Step(f" {words[0]}", 1.0, None))
        for k in range(1, len(words) + 1):
            stop = stop_probability(prompt.topic, k)
            following = f" {chain[(pos + k) % len(chain)]}"
            if k < len(words):
                steps.append(Step(following, 1 - stop, "\n"))
            else:
                steps.append(Step("\n", stop, following if stop < 1 else None))
        pos += len(words)
    return steps


def expected_tokens(prompt: Prompt) -> float:
    """Mean answer length in tokens (end token included) under the task's distribution."""
    mean_count = float(np.arange(1, N_MAX + 1) @ count_pmf(prompt.size))
    probs = TOPICS[prompt.topic].words_per_item
    mean_words = sum((w + 1) * p for w, p in enumerate(probs))
    return mean_count * (3 + mean_words) + 1


def sample_prompt(rng: np.random.Generator, sizes: Sequence[str] | None = None) -> Prompt:
    """Draw a prompt: topic, size and phrasing uniform, a start word 80 % of the time.

    ``sizes`` restricts (and reweights, by repetition) the size words drawn.
    """
    topic = str(rng.choice(list(TOPICS)))
    size = str(rng.choice(list(sizes if sizes is not None else SIZES)))
    start = str(rng.choice(TOPICS[topic].words)) if rng.random() < 0.8 else None
    template = int(rng.integers(len(TEMPLATES)))
    system = str(rng.choice(SYSTEM_PROMPTS)) if rng.random() < 0.2 else None
    return Prompt(topic=topic, size=size, start=start, template=template, system=system)


def _items(prompt: Prompt, words_per_item: Sequence[int]) -> Answer:
    chain = TOPICS[prompt.topic].words
    pos = prompt.first_word_index()
    items = []
    for w in words_per_item:
        items.append(tuple(chain[(pos + j) % len(chain)] for j in range(w)))
        pos += w
    return Answer(tuple(items))


def sample_answer(prompt: Prompt, rng: np.random.Generator, count: int | None = None) -> Answer:
    """Draw an answer from the task's distribution for ``prompt`` (or with ``count`` items)."""
    n = count if count is not None else int(rng.choice(N_MAX, p=count_pmf(prompt.size))) + 1
    words = rng.choice(MAX_WORDS, size=n, p=TOPICS[prompt.topic].words_per_item) + 1
    return _items(prompt, [int(w) for w in words])


def greedy_answer(prompt: Prompt) -> Answer:
    """The answer that greedy decoding of a perfect model of the task gives."""
    n = greedy_count(prompt.size)
    return _items(prompt, [greedy_words_per_item(prompt.topic)] * n)


@dataclass(frozen=True, slots=True)
class Check:
    """How a model's answer text measures up against the task."""

    count: int  # N: the first item's label (0 when none could be read)
    items: int  # items that parsed
    errors: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """True when the text is a well-formed answer to its prompt."""
        return not self.errors


_ITEM = re.compile(r"([a-z]+)\.((?: [a-z]+)+)")


def check_answer(prompt: Prompt, text: str) -> Check:
    """Check that ``text`` is a countdown list on the prompt's topic chain.

    Word counts per item are not checked (any 1..3 is valid, as under
    sampling); labels must count down by one to 1, and every word must follow
    its predecessor on the topic chain starting at the prompt's start word.
    """
    errors: list[str] = []
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    else:
        errors.append("answer does not end with a newline")
    chain = TOPICS[prompt.topic].words
    pos = prompt.first_word_index()
    count = 0
    for i, line in enumerate(lines):
        m = _ITEM.fullmatch(line)
        if m is None:
            errors.append(f"line {i} is not an item: {line!r}")
            break
        value = _LABELS.get(m.group(1), 0)
        if i == 0:
            count = value
        if value == 0 or value != count - i:
            errors.append(f"line {i} is labelled {m.group(1)!r}, expected {label(count - i)!r}")
            break
        words = m.group(2).split()
        if len(words) > MAX_WORDS:
            errors.append(f"line {i} has {len(words)} words")
        for word in words:
            if word != chain[pos % len(chain)]:
                errors.append(f"line {i}: {word!r} is off the chain")
                break
            pos += 1
        if errors:
            break
    if not errors and count - len(lines) != 0:
        errors.append(f"counted down from {count} but stopped after {len(lines)} items")
    return Check(count=count, items=len(lines), errors=tuple(errors))
