"""The embedded tiny target: a deterministic corpus, and a cached, checksummed, rebuildable HF checkpoint."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_ring.common.chat_encoding import conversation_of
from dflash_ring.embedded.tiny_corpus import CorpusSpec, generate_corpus, prompt_of, write_jsonl
from dflash_ring.embedded.tiny_target import (
    HELDOUT_FILE,
    MARKER_NAME,
    TRAIN_FILE,
    TinyTargetRecipe,
    ensure_tiny_target,
    read_marker,
)

# The real recipe's code path at a size that builds in seconds.
SMALL = TinyTargetRecipe(
    corpus=CorpusSpec(num_train=64, num_heldout=8),
    tokenizer_vocab_size=400,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=64,
    steps=3,
    batch_size=8,
    warmup_steps=1,
    generation_checks=2,
)


def test_corpus_is_deterministic_and_split():
    spec = CorpusSpec(num_train=700, num_heldout=70)
    first, again = generate_corpus(spec), generate_corpus(spec)
    assert first == again
    assert generate_corpus(replace(spec, seed=1)) != first
    assert len(first.train) == 700 and len(first.heldout) == 70
    train_prompts = {prompt_of(r) for r in first.train}
    assert len(train_prompts) == 700
    assert train_prompts.isdisjoint(prompt_of(r) for r in first.heldout)


def test_corpus_rows_are_chats_with_correct_answers():
    corpus = generate_corpus(CorpusSpec(num_train=700, num_heldout=0))
    checked = 0
    for row in corpus.train:
        user, assistant = conversation_of(row)
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        prompt, reply = user["content"], assistant["content"]
        if m := re.fullmatch(r"What is (\d+) (plus|minus) (\d+)\?", prompt):
            a, op, b = int(m[1]), m[2], int(m[3])
            assert re.search(rf"(answer is|gives) {a + b if op == 'plus' else a - b}\.$", reply), reply
            checked += 1
        elif m := re.fullmatch(r"Sort these numbers: ([\d ]+)\.", prompt):
            assert f"big: {' '.join(sorted(m[1].split()))}." in reply
            checked += 1
        elif m := re.fullmatch(r"Reverse these words: ([a-z ]+)\.", prompt):
            assert f"order: {' '.join(m[1].split()[::-1])}." in reply
            checked += 1
    assert checked > 100


def test_corpus_words_each_phrase_three_ways_independently_of_the_prompt():
    """The target's entropy comes from here: each phrasing about a third of the time, whatever the prompt."""
    rows = generate_corpus(CorpusSpec(num_train=1400, num_heldout=0)).train
    openers = [
        conversation_of(r)[1]["content"].split(":")[0] for r in rows if prompt_of(r).startswith("Repeat these words")
    ]
    counts = {o: openers.count(o) for o in set(openers)}
    assert sorted(counts) == ["Here are the words again", "Okay. Once more", "Sure, the words are"], counts
    assert all(abs(n / len(openers) - 1 / 3) < 0.1 for n in counts.values()), counts
    by_length = {}  # the opener does not depend on the prompt (here: its number of words)
    for r in rows:
        if prompt_of(r).startswith("Repeat these words"):
            by_length.setdefault(len(prompt_of(r).split()), set()).add(conversation_of(r)[1]["content"].split(":")[0])
    assert all(len(o) == 3 for o in by_length.values()), by_length


def test_write_jsonl_round_trips(tmp_path):
    rows = generate_corpus(CorpusSpec(num_train=10, num_heldout=2)).train
    lines = write_jsonl(rows, tmp_path / "t.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == rows


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return cache, ensure_tiny_target(cache, SMALL)


def test_builds_a_loadable_hf_target_with_its_data(built):
    _, path = built
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    marker = read_marker(path)
    config = model.config
    assert (config.model_type, config.num_hidden_layers, config.tie_word_embeddings) == ("qwen3", 2, False)
    # The drafter's mask token needs an embedding row no token uses, as in Qwen3.
    assert marker["mask_token_id"] == len(tokenizer) < config.vocab_size
    assert config.eos_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert 0.0 <= marker["quality"]["heldout_token_accuracy"] <= 1.0
    assert 0.0 < marker["quality"]["heldout_mean_entropy"] <= math.log(config.vocab_size)
    assert len((path / TRAIN_FILE).read_text().splitlines()) == 64
    assert len((path / HELDOUT_FILE).read_text().splitlines()) == 8
    with torch.no_grad():
        out = model.generate(**tokenizer("Count from 3 to 5.", return_tensors="pt"), max_new_tokens=3, do_sample=False)
    assert out.shape[1] > 3


def test_reuses_an_intact_cache(built):
    cache, path = built
    stamp = (path / MARKER_NAME).stat().st_mtime_ns
    assert ensure_tiny_target(cache, SMALL) == path
    assert (path / MARKER_NAME).stat().st_mtime_ns == stamp


def test_recipe_change_gets_its_own_entry(built):
    cache, path = built
    other = replace(SMALL, steps=2)
    assert other.key() != SMALL.key()
    assert not (cache / path.name.replace(SMALL.key(), other.key())).exists()


def test_same_recipe_builds_identical_weights(built, tmp_path):
    _, path = built
    again = ensure_tiny_target(tmp_path, SMALL)
    assert (again / "model.safetensors").read_bytes() == (path / "model.safetensors").read_bytes()
    assert read_marker(again)["files"] == read_marker(path)["files"]


@pytest.mark.parametrize("damage", ["truncate weights", "drop marker", "edit recipe", "drop tokenizer"])
def test_damaged_cache_is_rebuilt(tmp_path, damage):
    path = ensure_tiny_target(tmp_path, SMALL)
    good = read_marker(path)["files"]
    if damage == "truncate weights":
        weights = path / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
    elif damage == "drop marker":
        (path / MARKER_NAME).unlink()
    elif damage == "edit recipe":
        marker = read_marker(path)
        marker["recipe"]["steps"] = 999
        (path / MARKER_NAME).write_text(json.dumps(marker))
    else:
        (path / "tokenizer.json").unlink()
    crashed = tmp_path / f".{path.name}.abc123.tmp"  # what a build killed halfway leaves
    crashed.mkdir()
    assert ensure_tiny_target(tmp_path, SMALL) == path
    assert read_marker(path)["files"] == good
    AutoModelForCausalLM.from_pretrained(path)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
