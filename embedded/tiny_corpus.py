"""A synthetic chat data set for the embedded tiny target, generated offline from a seed.

Acceptance only means something if the target's replies are predictable: each reply here is a
fixed function of its prompt (copy, reverse, sort, count, add, recall a fact), written out in a
worked template, so a small model can learn it on a CPU in minutes and a drafter has long
guessable runs to learn, while the numbers and word choices still need the prompt to be read.
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
    if prompt.startswith("What"):
        reply = f"We add {a} and {b}. {a} plus {b} is {a + b}. The answer is {a + b}."
    else:
        reply = (
            f"{name} starts with {a} {things}. Then {name} gets {b} more. "
            f"So we add {a} and {b}. {a} plus {b} is {a + b}. {name} has {a + b} {things}. The answer is {a + b}."
        )
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
    if prompt.startswith("What"):
        reply = f"We take {b} from {a}. {a} minus {b} is {left}. The answer is {left}."
    else:
        reply = (
            f"{name} starts with {a} {things} and gives away {b}. "
            f"So we take {b} from {a}. {a} minus {b} is {left}. {name} has {left} {things} left. The answer is {left}."
        )
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
    reply = f"Sure. {', '.join(map(str, counted))}. That is {NUMBER_WORDS[length]} {things}."
    return _chat(prompt, reply)


def _repeat(rng: random.Random) -> Row:
    words = rng.sample(WORDS, rng.randint(3, 6))
    return _chat(
        f"Repeat these words: {' '.join(words)}.",
        f"Here are the words again: {' '.join(words)}. That is {NUMBER_WORDS[len(words)]} words.",
    )


def _reverse(rng: random.Random) -> Row:
    words = rng.sample(WORDS, rng.randint(3, 5))
    return _chat(
        f"Reverse these words: {' '.join(words)}.",
        f"Here are the words in reverse order: {' '.join(reversed(words))}. The first word is now {words[-1]}.",
    )


def _sort(rng: random.Random) -> Row:
    values = rng.sample(range(10), rng.randint(3, 6))
    ordered = sorted(values)
    return _chat(
        f"Sort these numbers: {_numbers(values)}.",
        f"In order from small to big: {_numbers(ordered)}. "
        f"The smallest is {ordered[0]} and the biggest is {ordered[-1]}.",
    )


def _describe(rng: random.Random) -> Row:
    name, color, animal = rng.choice(NAMES), rng.choice(COLORS), rng.choice(sorted(ANIMALS))
    size, likes, home = ANIMALS[animal]
    prompt = rng.choice(
        (f"{name} has a {color} {animal}. Tell me about it.", f"Describe the {color} {animal} of {name}.")
    )
    reply = (
        f"{name} has a {color} {animal}. The {animal} is a {size} animal and lives in the {home}. "
        f"It likes to {likes}. {name} loves the {color} {animal}."
    )
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
