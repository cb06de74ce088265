"""A synthetic chat data set for the embedded tiny target, generated offline from a seed.

Acceptance only means something if the target's replies are predictable: each reply's content is a
fixed function of its prompt (copy, reverse, sort, count, add, recall a fact), written out in a
worked template, so a small model can learn it on a CPU in minutes and a drafter has long
guessable runs to learn, while the numbers and word choices still need the prompt to be read.

Its wording is not: at each phrase of a template the writer picks one of three phrasings
(`_pick`), uniformly and independently of the prompt, as people writing a data set do. A target
trained on it has genuine next-token entropy there (about ln 3 nats), not the near one-hot
distributions of a fully determined corpus, and its greedy replies settle on its own preferred
phrasing, so they differ from the corpus's: a drafter trained on the target's regenerated replies
then learns what the target says, one trained on the corpus's replies only what writers say
(`dflash-ring run` compares the two), and objectives that read the target's distribution (KL, the
tree's second choices) have something to read.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Row = dict[str, Any]

NAMES = ("Tom", "Ann", "Sam", "Mia", "Ben", "Lily", "Max", "Zoe", "Leo", "Eva")
THINGS = ("apples", "books", "pens", "cups", "balls", "cards", "eggs", "hats", "coins", "shells")
WORDS = (
    "red", "blue", "green", "yellow", "black", "white", "pink", "brown",
    "cat", "dog", "fox", "bird", "fish", "cow", "pig", "duck", "frog", "bear",
    "tree", "house", "river", "hill", "road", "moon", "sun", "star",
    "run", "jump", "swim", "sing", "sleep", "read",
)  # fmt: skip
COLORS = WORDS[:8]
# Facts per animal: (size, what it likes to do, where it lives); the reply must recall them.
ANIMALS = {
    "cat": ("small", "sleep", "house"),
    "dog": ("big", "run", "park"),
    "fox": ("small", "hunt", "forest"),
    "bird": ("small", "sing", "tree"),
    "fish": ("small", "swim", "river"),
    "cow": ("big", "eat", "field"),
    "pig": ("big", "eat", "farm"),
    "duck": ("small", "swim", "pond"),
    "frog": ("small", "jump", "pond"),
    "bear": ("big", "sleep", "forest"),
}
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


@dataclass(frozen=True)
class CorpusSpec:
    """Everything the rows depend on: equal specs give byte-identical files."""

    seed: int = 0
    num_train: int = 4000
    num_heldout: int = 200


@dataclass(frozen=True)
class TinyCorpus:
    train: list[Row]
    heldout: list[Row]  # prompts never seen in train


def _chat(prompt: str, reply: str) -> Row:
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]}


def _pick(rng: random.Random, *phrasings: str) -> str:
    """One of a phrase's equally likely phrasings (the module docstring says why there are several)."""
    return rng.choice(phrasings)


def _numbers(values: Iterable[int]) -> str:
    return " ".join(str(v) for v in values)


def _addition(rng: random.Random) -> Row:
    name, things = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    prompt = rng.choice(
        (
            f"{name} has {a} {things} and gets {b} more. How many {things} does {name} have now?",
            f"{name} had {a} {things}. A friend gave {name} {b} more {things}. How many {things} does {name} have?",
            f"What is {a} plus {b}?",
        )
    )
    add = _pick(rng, f"We add {a} and {b}.", f"Let us add {a} and {b}.", f"We need {a} plus {b}.")
    answer = _pick(rng, f"The answer is {a + b}.", f"So the answer is {a + b}.", f"That gives {a + b}.")
    if prompt.startswith("What"):
        reply = f"{add} {a} plus {b} is {a + b}. {answer}"
    else:
        start = _pick(
            rng,
            f"{name} starts with {a} {things}.",
            f"At first {name} has {a} {things}.",
            f"{name} begins with {a} {things}.",
        )
        then = _pick(
            rng, f"Then {name} gets {b} more.", f"After that {name} gets {b} more.", f"Later {name} is given {b} more."
        )
        reply = f"{start} {then} {add} {a} plus {b} is {a + b}. {name} has {a + b} {things}. {answer}"
    return _chat(prompt, reply)


def _subtraction(rng: random.Random) -> Row:
    name, things = rng.choice(NAMES), rng.choice(THINGS)
    b, left = rng.randint(1, 9), rng.randint(0, 9)
    a = b + left
    prompt = rng.choice(
        (
            f"{name} has {a} {things} and gives away {b}. How many {things} are left?",
            f"What is {a} minus {b}?",
        )
    )
    take = _pick(rng, f"We take {b} from {a}.", f"Let us take {b} away from {a}.", f"We need {a} minus {b}.")
    answer = _pick(rng, f"The answer is {left}.", f"So the answer is {left}.", f"That gives {left}.")
    if prompt.startswith("What"):
        reply = f"{take} {a} minus {b} is {left}. {answer}"
    else:
        start = _pick(
            rng,
            f"{name} starts with {a} {things} and gives away {b}.",
            f"At first {name} has {a} {things}, then gives {b} away.",
            f"{name} has {a} {things} and gives {b} of them away.",
        )
        reply = f"{start} {take} {a} minus {b} is {left}. {name} has {left} {things} left. {answer}"
    return _chat(prompt, reply)


def _count(rng: random.Random) -> Row:
    name, things = rng.choice(NAMES), rng.choice(THINGS)
    length = rng.randint(3, 9)
    start = rng.randint(1, 10 - length)
    values = list(range(start, start + length))
    if rng.random() < 0.5:
        prompt, counted = f"Help {name} count the {things} from {values[0]} to {values[-1]}.", values
    else:
        prompt, counted = f"Help {name} count the {things} down from {values[-1]} to {values[0]}.", values[::-1]
    opener = _pick(rng, "Sure.", "Okay, let us count.", "Of course! Here we go.")
    total = _pick(
        rng,
        f"That is {NUMBER_WORDS[length]} {things}.",
        f"That makes {NUMBER_WORDS[length]} {things}.",
        f"So there are {NUMBER_WORDS[length]} {things}.",
    )
    reply = f"{opener} {', '.join(map(str, counted))}. {total}"
    return _chat(prompt, reply)


def _repeat(rng: random.Random) -> Row:
    words = rng.sample(WORDS, rng.randint(3, 6))
    opener = _pick(rng, "Here are the words again:", "Sure, the words are:", "Okay. Once more:")
    total = _pick(
        rng,
        f"That is {NUMBER_WORDS[len(words)]} words.",
        f"There are {NUMBER_WORDS[len(words)]} words.",
        f"That makes {NUMBER_WORDS[len(words)]} words in all.",
    )
    return _chat(f"Repeat these words: {' '.join(words)}.", f"{opener} {' '.join(words)}. {total}")


def _reverse(rng: random.Random) -> Row:
    words = rng.sample(WORDS, rng.randint(3, 5))
    opener = _pick(rng, "Here are the words in reverse order:", "Sure, in reverse order:", "Okay, the reverse order:")
    first = _pick(
        rng, f"The first word is now {words[-1]}.", f"Now {words[-1]} comes first.", f"So {words[-1]} is first now."
    )
    return _chat(f"Reverse these words: {' '.join(words)}.", f"{opener} {' '.join(reversed(words))}. {first}")


def _sort(rng: random.Random) -> Row:
    values = rng.sample(range(10), rng.randint(3, 6))
    ordered = sorted(values)
    opener = _pick(rng, "In order from small to big:", "Sorted from small to big:", "Okay, from small to big:")
    ends = _pick(
        rng,
        f"The smallest is {ordered[0]} and the biggest is {ordered[-1]}.",
        f"So {ordered[0]} is the smallest and {ordered[-1]} is the biggest.",
        f"The biggest is {ordered[-1]} and the smallest is {ordered[0]}.",
    )
    return _chat(f"Sort these numbers: {_numbers(values)}.", f"{opener} {_numbers(ordered)}. {ends}")


def _describe(rng: random.Random) -> Row:
    name, color, animal = rng.choice(NAMES), rng.choice(COLORS), rng.choice(sorted(ANIMALS))
    size, likes, home = ANIMALS[animal]
    prompt = rng.choice(
        (f"{name} has a {color} {animal}. Tell me about it.", f"Describe the {color} {animal} of {name}.")
    )
    facts = _pick(
        rng,
        f"The {animal} is a {size} animal and lives in the {home}.",
        f"It is a {size} animal that lives in the {home}.",
        f"This {size} animal lives in the {home}.",
    )
    hobby = _pick(
        rng, f"It likes to {likes}.", f"Its favourite thing is to {likes}.", f"Most of all it likes to {likes}."
    )
    ending = _pick(rng, f"{name} loves the {color} {animal}.", f"{name} is very fond of it.", "They are good friends.")
    reply = f"{name} has a {color} {animal}. {facts} {hobby} {ending}"
    return _chat(prompt, reply)


# Share of each task in every cycle of rows: copying by position (repeat, reverse, the operands of a sum,
# where to stop counting) is what a small model learns last, so those tasks get more rows.
TASK_SHARES: tuple[tuple[Callable[[random.Random], Row], int], ...] = (
    (_addition, 2),
    (_subtraction, 2),
    (_count, 3),
    (_repeat, 3),
    (_reverse, 3),
    (_sort, 2),
    (_describe, 1),
)
_TASK_CYCLE = [task for task, share in TASK_SHARES for _ in range(share)]


def prompt_of(row: Row) -> str:
    return row["messages"][0]["content"]


def generate_corpus(spec: CorpusSpec = CorpusSpec()) -> TinyCorpus:
    """Distinct prompts, tasks in TASK_SHARES; held-out rows are drawn first so train never repeats them."""
    rng = random.Random(spec.seed)
    total = spec.num_train + spec.num_heldout
    rows: list[Row] = []
    seen: set[str] = set()
    attempts = 0
    while len(rows) < total:
        attempts += 1
        if attempts > 50 * total:
            raise ValueError(f"cannot draw {total} distinct prompts from the task templates")
        row = _TASK_CYCLE[len(rows) % len(_TASK_CYCLE)](rng)
        if prompt_of(row) not in seen:
            seen.add(prompt_of(row))
            rows.append(row)
    heldout, train = rows[: spec.num_heldout], rows[spec.num_heldout :]
    rng.shuffle(train)
    return TinyCorpus(train=train, heldout=heldout)


def write_jsonl(rows: Sequence[Row], path: str | Path) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n" for row in rows))
    return path


def corpus_texts(corpus: TinyCorpus) -> list[str]:
    """Every message of the train split and its role (the chat template writes it), to fit a tokenizer's
    vocabulary to the corpus."""
    return [text for row in corpus.train for m in row["messages"] for text in (m["role"], m["content"])]
