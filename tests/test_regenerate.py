"""`dflash-ring regenerate` (issue 15 item 1): the target's own replies to a data set's prompts, as a data set.

The target is a tiny random Qwen3 with the tiny tokenizer, loaded through the real loader; its head is set so
that it writes words (random weights would write byte fragments no data loader accepts) and sometimes its EOS.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_ring.common.chat_encoding import BadRow, prompt_of
from dflash_ring.common.config.schema import Config, ConfigError
from dflash_ring.common.metrics import RegenerateMetrics
from dflash_ring.common.config.target import TargetConfig
from dflash_ring.embedded.tiny_tokenizer import QWEN3_STYLE_CHAT_TEMPLATE, tiny_chat_tokenizer
from dflash_ring.producer.generation import GenerationSettings, Prompt, Reply
from dflash_ring.producer.hf_engine import HfEngine, length_batches
from dflash_ring.producer.pretokenized import load_tokenized
from dflash_ring.producer.regenerate import (
    STATE_DIR,
    ProgressMeter,
    RegenerateError,
    RegenerateSummary,
    regenerate,
)
from support import WORDS, build_target, merged, run_config, wait_exit, write_config

MAX_NEW = 12


def regenerated(cfg: Config, **kwargs: Any) -> RegenerateSummary:
    """`dflash-ring regenerate`'s job for `cfg`, as the command runs it (cli.py): from its three sections."""
    return regenerate(cfg.regenerate, cfg.data, cfg.target, **kwargs)


def _words_and_eos(path: Path):
    """Logits only for whole-word tokens (each row paired with its negation, so one of them always beats the
    zeroed rest), and EOS wherever " jum" would win (this seed writes it in about half the replies): replies
    are words, and some end before MAX_NEW."""

    def init(model: torch.nn.Module) -> None:
        tokenizer = AutoTokenizer.from_pretrained(path)
        head = model.get_output_embeddings().weight
        words = sorted(i for tok, i in tokenizer.get_vocab().items() if tok.startswith("Ġ") and tok[1:].isalpha())
        rows = head[words].clone()
        head.zero_()
        half = len(words) // 2
        shuffled = [words[i] for i in torch.randperm(len(words), generator=torch.Generator().manual_seed(1))]
        head[shuffled[:half]] = rows[:half] * 4
        head[shuffled[half : 2 * half]] = -rows[:half] * 4
        head[tokenizer.eos_token_id] = head[tokenizer.convert_tokens_to_ids("Ġjum")] * 1.1

    return init


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("regen") / "model"
    return build_target(path, "qwen3", layers=2, hidden=64, seed=3, init=_words_and_eos(path))


def chat_rows(n: int, seed: int = 0) -> list[dict]:
    """Distinct prompts (row i says "row i"), some multi-turn, some prompt/response and prompt-only rows."""
    rng = random.Random(seed)

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    rows = []
    for i in range(n):
        if i % 5 == 1:
            rows.append({"prompt": f"row {i}: {text(2, 12)}", "response": text(2, 8)})
        elif i % 5 == 3:
            rows.append(
                {
                    "messages": [
                        {"role": "system", "content": "be brief"},
                        {"role": "user", "content": f"row {i}: {text(2, 20)}"},
                        {"role": "assistant", "content": text(2, 8)},
                        {"role": "user", "content": text(1, 6)},
                        {"role": "assistant", "content": text(2, 8)},
                    ]
                }
            )
        elif i % 5 == 4:
            rows.append({"messages": [{"role": "user", "content": f"row {i}: {text(2, 30)}"}]})  # prompt only
        else:
            rows.append(
                {
                    "messages": [
                        {"role": "user", "content": f"row {i}: {text(2, 30)}"},
                        {"role": "assistant", "content": text(2, 10)},
                    ]
                }
            )
    return rows


BAD_LINES = [
    '{"messages": "not a list"}',
    "[1, 2]",
    "not json at all",
    '{"messages": [{"role": "assistant", "content": "no question"}]}',
]


def write_rows(path: Path, rows: list, bad_at: dict[int, str] | None = None) -> Path:
    """jsonl of `rows`, with raw lines `bad_at` {position: line} put in among them."""
    lines = [json.dumps(r) for r in rows]
    for at, line in sorted((bad_at or {}).items()):
        lines.insert(at, line)
    path.write_text("".join(line + "\n" for line in lines))
    return path


def settings(tmp: Path, target: Path, data: Path, **regen) -> dict:
    return {
        "data": {"path": str(data), "cache_dir": str(tmp / "cache")},
        "target": {"path": str(target), "device": "cpu"},
        "metrics": {"enabled": False},
        "regenerate": {"output": str(tmp / "out"), "max_new_tokens": MAX_NEW, "shard_rows": 4, **regen},
    }


def output_rows(out: Path) -> list[dict]:
    return [json.loads(line) for p in sorted(out.glob("shard-*.jsonl")) for line in p.read_text().splitlines()]


def records(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out / STATE_DIR).glob("shard-*.json"))]


def row_of(row: dict) -> int:
    """The source row a written row answers (each prompt starts with "row i:")."""
    first_user = next(m for m in row["messages"] if m["role"] == "user")
    return int(first_user["content"].split(":")[0].removeprefix("row "))


# --- prompts ---------------------------------------------------------------------------------------


def test_the_prompt_is_the_chat_before_its_last_reply():
    u, a = ({"role": "user", "content": "q"}, {"role": "assistant", "content": "r"})
    assert prompt_of({"messages": [u, a, u, a]}) == [u, a, u]
    assert prompt_of({"messages": [u, a, u]}) == [u, a, u]  # prompt only: the whole chat
    assert prompt_of({"prompt": "q", "response": "r"}) == [u]
    assert prompt_of({"prompt": "q"}) == [u]
    for bad, says in (
        ({"messages": [a]}, "follows nothing"),
        ({"messages": [u, a, a]}, "follows a assistant turn"),
        ({"messages": [{"role": "system", "content": "s"}]}, "follows a system turn"),
        ({"prompt": ""}, "'prompt' is not a non-empty string"),
        ({"response": "r"}, "'prompt'"),
    ):
        with pytest.raises(BadRow, match=says):
            prompt_of(bad)


def test_length_batches_respect_both_limits_and_are_sorted():
    encoded = [(Prompt(i, ()), [0] * n) for i, n in enumerate([5, 30, 7, 7, 12, 3, 40, 9, 9, 9])]
    batches = list(length_batches(encoded, batch_tokens=40, batch_size=3))
    assert sorted(p.index for b in batches for p, _ in b) == list(range(10))
    flat = [(len(ids), p.index) for b in batches for p, ids in b]
    assert flat == sorted(flat)
    for b in batches:
        assert len(b) <= 3 and (len(b) == 1 or len(b) * max(len(ids) for _, ids in b) <= 40), b
    assert [[p.index for p, _ in b] for b in batches] == [[5, 0, 2], [3, 7, 8], [9, 4], [1], [6]]


# --- the hf engine ---------------------------------------------------------------------------------


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(i, tuple(prompt_of(row))) for i, row in enumerate(chat_rows(n))]


def test_hf_engine_greedy_equals_generate_prompt_by_prompt(target):
    engine = HfEngine.load(TargetConfig(path=str(target)), "cpu", batch_tokens=160, batch_size=3)
    prompts = _prompts(10)
    greedy = GenerationSettings(max_new_tokens=MAX_NEW, temperature=0.0, top_p=1.0, seed=0, enable_thinking=False)
    replies = {r.index: r for r in engine.generate(prompts, greedy)}
    assert sorted(replies) == list(range(10))

    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    eos = tokenizer.eos_token_id
    for p in prompts:
        ids = tokenizer.apply_chat_template(
            list(p.messages), add_generation_prompt=True, enable_thinking=False, return_tensors="pt", return_dict=True
        )["input_ids"]
        out = model.generate(
            ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id
        )[0, ids.shape[1] :].tolist()
        stopped = eos in out
        text = tokenizer.decode(out[: out.index(eos)] if stopped else out, skip_special_tokens=True)
        got = replies[p.index]
        assert (got.text, got.finish_reason) == (text, "stop" if stopped else "length"), p.index
        assert got.prompt_tokens == ids.shape[1]
        assert got.completion_tokens == (out.index(eos) + 1 if stopped else MAX_NEW)
    reasons = {r.finish_reason for r in replies.values()}
    assert reasons == {"stop", "length"}, reasons  # the target ends some replies, and the limit cuts others
    assert all(r.text.strip() for r in replies.values())


def test_sampling_is_seeded_per_prompt_whatever_the_batch(target):
    prompts = _prompts(8)
    sample = GenerationSettings(max_new_tokens=MAX_NEW, temperature=1.5, top_p=0.9, seed=7, enable_thinking=False)

    def texts(batch_size: int, prompts=prompts, settings=sample) -> dict[int, str]:
        engine = HfEngine.load(TargetConfig(path=str(target)), "cpu", batch_tokens=4096, batch_size=batch_size)
        return {r.index: r.text for r in engine.generate(prompts, settings)}

    alone, together = texts(1), texts(8)
    assert alone == together
    assert texts(4, prompts[3:5]) == {i: alone[i] for i in (3, 4)}  # a resumed shard's prompts draw the same
    other_seed = texts(8, settings=dataclasses.replace(sample, seed=8))
    greedy = texts(8, settings=dataclasses.replace(sample, temperature=0.0))
    assert sum(other_seed[i] != alone[i] for i in alone) >= 4
    assert sum(greedy[i] != alone[i] for i in alone) >= 4


def test_a_template_that_fails_on_a_prompt_is_that_prompt_s_error(tmp_path, target):
    template = (
        "{%- for m in messages %}{%- if 'FAIL' in m.content %}{{ raise_exception('cannot render FAIL') }}"
        "{%- endif %}{%- endfor %}" + QWEN3_STYLE_CHAT_TEMPLATE
    )
    tiny_chat_tokenizer(tmp_path / "tok", chat_template=template)
    engine = HfEngine.load(
        TargetConfig(path=str(target), tokenizer=str(tmp_path / "tok")), "cpu", batch_tokens=4096, batch_size=8
    )
    prompts = [Prompt(0, ({"role": "user", "content": "hello"},)), Prompt(1, ({"role": "user", "content": "FAIL"},))]
    replies = {r.index: r for r in engine.generate(prompts, GenerationSettings(4, 0.0, 1.0, 0, False))}
    assert replies[1].finish_reason == "error" and "cannot render FAIL" in replies[1].error
    assert replies[0].finish_reason in ("stop", "length") and replies[0].text


def test_a_tokenizer_without_a_chat_template_is_refused(tmp_path, target):
    tiny_chat_tokenizer(tmp_path / "plain", chat_template="")
    with pytest.raises(ValueError, match="has no chat template"):
        HfEngine.load(
            TargetConfig(path=str(target), tokenizer=str(tmp_path / "plain")), "cpu", batch_tokens=4096, batch_size=8
        )


# --- the job ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_the_output_is_a_data_set_with_prompts_unchanged_and_bad_rows_counted(tmp_path, target, fmt):
    rows = chat_rows(14)
    if fmt == "jsonl":
        data = write_rows(tmp_path / "src.jsonl", rows, {2: BAD_LINES[0], 6: BAD_LINES[1], 9: BAD_LINES[2]})
        bad_at = [2, 6, 9]
    else:  # chats only, and bad rows as Arrow can hold them: no user turn before the reply
        rows = [{"messages": r.get("messages") or [{"role": "user", "content": r["prompt"]}]} for r in rows]
        rows[5] = {"messages": [{"role": "assistant", "content": "no question"}]}
        rows[6] = {"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "x"}]}
        data = tmp_path / "src.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(data))
        bad_at = [5, 6]
    metrics = RegenerateMetrics()
    summary = regenerated(run_config(settings(tmp_path, target, data)), metrics=metrics)

    good = [r for r in rows if "row " in json.dumps(r)]
    total = len(good) + len(bad_at)
    assert (summary.rows, summary.bad_rows, summary.shards) == (total, len(bad_at), -(-total // 4))
    assert summary.written == len(good) and summary.errors == summary.unusable == summary.truncated_dropped == 0
    assert summary.complete > 0 and summary.truncated_kept > 0
    assert metrics.prompts.labels("bad_row")._value.get() == len(bad_at)
    assert metrics.prompts.labels("complete")._value.get() == summary.complete
    assert metrics.generated_tokens._value.get() == summary.completion_tokens > 0
    assert metrics.rows_done._value.get() == total

    written = output_rows(tmp_path / "out")
    assert [row_of(w) for w in written] == [row_of({"messages": prompt_of(r)}) for r in good]
    for w, source in zip(written, good, strict=True):  # the prompt side exactly as it was
        assert w["messages"][:-1] == prompt_of(source)
        assert w["messages"][-1]["role"] == "assistant" and w["messages"][-1]["content"].strip()
    assert [i for rec in records(tmp_path / "out") for i, _ in rec["bad_rows"]] == bad_at

    tokenizer = AutoTokenizer.from_pretrained(target)
    loaded = load_tokenized(
        run_config({"data": {"path": str(tmp_path / "out"), "cache_dir": str(tmp_path / "cache")}}).data, tokenizer
    )
    assert (loaded.num_rows, len(loaded), loaded.bad_rows) == (summary.written, summary.written, ())


def test_truncated_replies_are_dropped_and_counted_when_not_kept(tmp_path, target):
    data = write_rows(tmp_path / "src.jsonl", chat_rows(10))
    kept = regenerated(run_config(settings(tmp_path, target, data)))
    dropped = regenerated(
        run_config(settings(tmp_path, target, data, keep_truncated=False, output=str(tmp_path / "d")))
    )
    assert kept.truncated_kept > 0 and dropped.truncated_dropped == kept.truncated_kept
    assert dropped.written == kept.complete == dropped.complete
    assert len(output_rows(tmp_path / "d")) == dropped.written
    assert sorted(i for rec in records(tmp_path / "d") for i in rec["truncated_dropped"]) == sorted(
        row_of(r) for r in output_rows(tmp_path / "out") if r not in output_rows(tmp_path / "d")
    )


def test_a_finished_job_is_left_alone_and_a_resume_with_other_settings_is_refused(tmp_path, target):
    data = write_rows(tmp_path / "src.jsonl", chat_rows(6))
    first = regenerated(run_config(settings(tmp_path, target, data)))
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").glob("shard-*.jsonl")}
    again = regenerated(run_config(settings(tmp_path, target, data, batch_size=2)))  # throughput settings may change
    assert (again.shards_resumed, again.rows_this_start, again.written) == (first.shards, 0, first.written)
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").glob("shard-*.jsonl")} == before

    with pytest.raises(RegenerateError, match=r"regenerate.temperature = 0.0 there, 0.7 here"):
        regenerated(run_config(settings(tmp_path, target, data, temperature=0.7)))
    with open(data, "a") as f:
        f.write(json.dumps(chat_rows(7)[6]) + "\n")
    with pytest.raises(RegenerateError, match=r"data.rows = 6 there, 7 here"):
        regenerated(run_config(settings(tmp_path, target, data)))
    other = write_rows(tmp_path / "other.jsonl", chat_rows(6, seed=1))
    with pytest.raises(RegenerateError, match=rf"data.path = '{data}' there, '{other}' here"):
        regenerated(run_config(settings(tmp_path, target, other)))


def test_max_rows_answers_the_first_rows_and_a_resume_with_another_value_is_refused(tmp_path, target):
    data = write_rows(tmp_path / "src.jsonl", chat_rows(10))
    out = tmp_path / "out"
    summary = regenerated(run_config(settings(tmp_path, target, data, max_rows=6)))
    assert (summary.rows, summary.shards, summary.written, summary.bad_rows) == (6, 2, 6, 0)
    assert [row_of(w) for w in output_rows(out)] == list(range(6))
    assert sum(rec["rows"] for rec in records(out)) == 6
    job = json.loads((out / STATE_DIR / "job.json").read_text())
    assert (job["data.rows"], job["regenerate.max_rows"]) == (10, 6)  # the source's rows, and the limit
    again = regenerated(run_config(settings(tmp_path, target, data, max_rows=6)))
    assert (again.shards_resumed, again.rows_this_start) == (2, 0)

    for other, shown in ((7, "7"), (0, "(unset)")):
        with pytest.raises(RegenerateError) as e:
            regenerated(run_config(settings(tmp_path, target, data, max_rows=other)))
        assert f"regenerate.max_rows = 6 there, {shown} here" in str(e.value), str(e.value)
        assert "\n" not in str(e.value)
    assert [row_of(w) for w in output_rows(out)] == list(range(6))  # nothing written by the refused starts

    more = regenerated(run_config(settings(tmp_path, target, data, max_rows=100, output=str(tmp_path / "all"))))
    assert (more.rows, more.written) == (10, 10)  # more than the source has: all of it
    with pytest.raises(ConfigError, match=r"regenerate.max_rows = -1: must be an integer >= 0"):
        run_config(settings(tmp_path, target, data, max_rows=-1))


def test_max_prompt_tokens_skips_and_records_only_the_longer_prompts(tmp_path, target):
    rng = random.Random(5)
    rows = chat_rows(8)
    for i in (2, 5):
        rows[i] = {"prompt": f"row {i}: " + " ".join(rng.choice(WORDS) for _ in range(120)), "response": "x"}
    tokenizer = AutoTokenizer.from_pretrained(target)
    lengths = [
        len(
            tokenizer.apply_chat_template(
                prompt_of(row), add_generation_prompt=True, enable_thinking=False, return_dict=True
            )["input_ids"]
        )
        for row in rows
    ]
    limit = max(n for i, n in enumerate(lengths) if i not in (2, 5))  # the longest short prompt is at the limit: kept
    assert min(lengths[2], lengths[5]) > limit
    data = write_rows(tmp_path / "src.jsonl", rows)
    summary = regenerated(run_config(settings(tmp_path, target, data, max_prompt_tokens=limit)))
    assert (summary.too_long, summary.written, summary.bad_rows, summary.errors) == (2, 6, 0, 0)
    skipped = [pair for rec in records(tmp_path / "out") for pair in rec["too_long"]]
    assert [i for i, _ in skipped] == [2, 5]
    for i, why in skipped:
        assert why == f"the prompt is {lengths[i]} tokens, over regenerate.max_prompt_tokens = {limit}", why
    written = output_rows(tmp_path / "out")
    assert [row_of(w) for w in written] == [0, 1, 3, 4, 6, 7]
    for w in written:  # the prompts answered are whole
        assert w["messages"][:-1] == prompt_of(rows[row_of(w)])
    with pytest.raises(RegenerateError, match=rf"regenerate.max_prompt_tokens = {limit} there, \(unset\) here"):
        regenerated(run_config(settings(tmp_path, target, data)))


def test_a_progress_line_is_logged_after_each_engine_batch(tmp_path, target, caplog):
    """Two batches in shard 0 (4 prompts, 2 a batch) and one in shard 1: three lines, each after its batch, with the
    rows done of the job's, the new tokens/s and an ETA; the Progress callback goes on as before."""
    data = write_rows(tmp_path / "src.jsonl", chat_rows(6))
    calls: list[tuple[int, int]] = []
    caplog.set_level(logging.INFO, logger="dflash_ring.producer.regenerate")
    summary = regenerated(
        run_config(settings(tmp_path, target, data, batch_size=2)), progress=lambda d, t: calls.append((d, t))
    )
    line = re.compile(
        r"(\d+)/6 rows done \((\d+) replies this start\), ([\d.]+) new tokens/s, [\d.]+ rows/s, ETA \d+ s"
    )
    found = [m for rec in caplog.records if rec.levelno == logging.INFO and (m := line.fullmatch(rec.getMessage()))]
    assert [(int(m[1]), int(m[2])) for m in found] == [(2, 2), (4, 4), (6, 6)], caplog.text
    assert all(float(m[3]) > 0 for m in found)
    assert summary.completion_tokens > 0
    assert calls[0] == (0, 6) and calls[-1] == (6, 6) and [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_an_engine_without_batches_gets_a_progress_line_as_replies_come(caplog):
    """The openai engine answers prompt by prompt: a line at most every `every_s` as replies come (here 0: each);
    an engine with batches only at their ends."""
    caplog.set_level(logging.INFO, logger="dflash_ring.producer.regenerate")
    reply = Reply(0, "text", "stop", 5, 7)

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "rows done" in r.getMessage()]

    streamed = ProgressMeter(2, 10, per_batch=False, every_s=0.0)
    streamed.begin()
    streamed.skipped(1)
    streamed.reply(reply)
    streamed.reply(reply)
    assert [m.split(",")[0] for m in lines()] == [
        "4/10 rows done (1 replies this start)",
        "5/10 rows done (2 replies this start)",
    ]
    caplog.clear()
    batched = ProgressMeter(0, 10, per_batch=True, every_s=0.0)
    batched.begin()
    batched.reply(reply)
    assert lines() == []
    batched.batch_done()
    assert len(lines()) == 1 and lines()[0].startswith("1/10 rows done (1 replies this start), ")


FAILING_TEMPLATE = (
    "{%- for m in messages %}{%- if 'FAIL' in m.content %}{{ raise_exception('cannot render FAIL') }}"
    "{%- endif %}{%- endfor %}" + QWEN3_STYLE_CHAT_TEMPLATE
)


def test_a_job_whose_every_prompt_fails_records_nothing(tmp_path, target):
    """Every prompt fails in the engine (its template refuses each): an error, and no shard recorded as done, so
    the same command retries them once the cause is fixed."""
    tiny_chat_tokenizer(tmp_path / "tok", chat_template=FAILING_TEMPLATE)
    data = write_rows(tmp_path / "src.jsonl", [{"prompt": f"row {i}: FAIL", "response": "x"} for i in range(6)])
    cfg = merged(settings(tmp_path, target, data), {"target": {"tokenizer": str(tmp_path / "tok")}})
    with pytest.raises(
        RegenerateError,
        match=r"failed on every prompt it was given \(6 rows of 2 shards; row 0: "
        r"chat template failed",
    ):
        regenerated(run_config(cfg))
    assert records(tmp_path / "out") == [] and output_rows(tmp_path / "out") == []


def test_a_tokenizer_of_another_model_fails_its_prompts_by_name(tmp_path, target):
    """target.tokenizer of another model gives ids past the target's embedding: each such prompt is an error saying
    so (was an IndexError out of generate, a traceback), and a job of only such prompts one refusal."""
    from support import foreign_tokenizer

    tokenizer, words = foreign_tokenizer(tmp_path / "other")
    data = write_rows(tmp_path / "src.jsonl", [{"prompt": " ".join(words[i : i + 20])} for i in range(0, 60, 20)])
    cfg = merged(settings(tmp_path, target, data), {"target": {"tokenizer": str(tokenizer)}})
    with pytest.raises(RegenerateError, match=r"row 0: the prompt holds token id \d+, past the \d+ embedding rows"):
        regenerated(run_config(cfg))


def test_failed_prompts_before_the_first_answer_do_not_end_the_job(tmp_path, target):
    """A first shard whose every prompt fails, then shards that work: the job goes on, and the failed rows are
    recorded as that shard's errors (held back only until the job is seen to work)."""
    tiny_chat_tokenizer(tmp_path / "tok", chat_template=FAILING_TEMPLATE)
    rows = [{"prompt": f"row {i}: FAIL", "response": "x"} for i in range(4)] + chat_rows(8)[4:]
    data = write_rows(tmp_path / "src.jsonl", rows)
    cfg = merged(settings(tmp_path, target, data), {"target": {"tokenizer": str(tmp_path / "tok")}})
    summary = regenerated(run_config(cfg))
    assert (summary.errors, summary.written, summary.shards) == (4, 4, 2)
    assert [[i for i, _ in rec["errors"]] for rec in records(tmp_path / "out")] == [[0, 1, 2, 3], []]


def test_an_output_directory_of_other_files_is_refused(tmp_path, target):
    data = write_rows(tmp_path / "src.jsonl", chat_rows(3))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.jsonl").write_text("{}\n")
    with pytest.raises(RegenerateError, match="already holds 'mine.jsonl'"):
        regenerated(run_config(settings(tmp_path, target, data)))


def _record_field(key: str, value) -> object:
    def change(out: Path) -> None:
        path = sorted((out / STATE_DIR).glob("shard-*.json"))[0]
        body = json.loads(path.read_text())
        body[key] = value
        path.write_text(json.dumps(body))

    return change


def _write(relative: str, text: str) -> object:
    return lambda out: (out / relative).write_text(text)


# A finished job's own files, damaged (by hand, a tool, a disk): each was a traceback when read back (a field of
# another type, a job record that is not an object, a JSON nested past the parser) or a stray *.jsonl that would be
# read with the replies; now one RegenerateError naming the file and what to do.
DAMAGED_JOB = {
    "job-record-a-list": (_write(f"{STATE_DIR}/job.json", "[1]"), "job.json cannot be read (a JSON list"),
    "job-record-too-deep": (_write(f"{STATE_DIR}/job.json", "[" * 100_000 + "]" * 100_000), "job.json cannot be"),
    "shard-index-a-string": (_record_field("shard", "0"), 'cannot be read (shard = "0" is not int)'),
    "rows-a-string": (_record_field("rows", "x"), 'cannot be read (rows = "x" is not int)'),
    "written-a-string": (_record_field("written", "yes"), 'cannot be read (written = "yes" is not int)'),
    "bad-rows-a-number": (_record_field("bad_rows", 5), "cannot be read (bad_rows = 5 is not"),
    "shard-record-too-deep": (
        _write(f"{STATE_DIR}/shard-00000.json", "[" * 100_000 + "]" * 100_000),
        "shard-00000.json cannot be read",
    ),
    "a-stray-jsonl": (_write("shard-abc.jsonl", ""), "holds 'shard-abc.jsonl', which is not a shard of this job"),
}


@pytest.mark.parametrize("case", list(DAMAGED_JOB))
def test_a_damaged_job_directory_is_refused_naming_the_file(tmp_path, target, case):
    change, says = DAMAGED_JOB[case]
    cfg = run_config(settings(tmp_path, target, write_rows(tmp_path / "src.jsonl", chat_rows(3))))
    regenerated(cfg)
    change(tmp_path / "out")
    with pytest.raises(RegenerateError) as e:
        regenerated(cfg)
    assert says in str(e.value), str(e.value)


# --- real processes: crashes, restarts, the command line -------------------------------------------


def _cli(tmp: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "dflash_ring", "regenerate", "--config", str(tmp / "regen.toml"), *extra],
        cwd=tmp,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def _finish(proc: subprocess.Popen, timeout: float = 180) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, out, err


@pytest.mark.processes
def test_killed_at_any_moment_a_restart_gives_each_usable_prompt_exactly_once(tmp_path, target):
    rows = chat_rows(36)
    data = write_rows(tmp_path / "src.jsonl", rows, {4: BAD_LINES[2], 17: BAD_LINES[3]})
    usable = len(rows)
    ref = tmp_path / "ref"
    ref.mkdir()
    write_config(ref / "regen.toml", settings(ref, target, data))
    rc, out, err = _finish(_cli(ref, "--json"))
    assert rc == 0, err
    reference = json.loads(out)
    assert (reference["written"], reference["bad_rows"], reference["shards"]) == (usable, 2, 10)
    want = {p.name: p.read_bytes() for p in (ref / "out").glob("shard-*.jsonl")}

    write_config(tmp_path / "regen.toml", settings(tmp_path, target, data))
    out_dir = tmp_path / "out"
    # After shard 2's file is written and synced, before its rename: the next start writes it again.
    rc, _, err = _finish(_cli(tmp_path, env={"DFLASH_RING_CRASH_AT": "regenerate.shard_written@3"}))
    assert rc == -signal.SIGKILL, err
    assert (out_dir / ".shard-00002.jsonl.tmp").exists() and not (out_dir / "shard-00002.jsonl").exists()
    assert [r["shard"] for r in records(out_dir)] == [0, 1]
    # After shard 4 is renamed into place, before its record: a shard file nobody counted yet.
    rc, _, err = _finish(_cli(tmp_path, env={"DFLASH_RING_CRASH_AT": "regenerate.shard_renamed@3"}))
    assert rc == -signal.SIGKILL, err
    assert (out_dir / "shard-00004.jsonl").exists() and [r["shard"] for r in records(out_dir)] == [0, 1, 2, 3]
    # At a random moment while shards are being written (after a random shard, a random few ms later).
    rng = random.Random(os.getpid())
    proc, target_records = _cli(tmp_path), rng.randint(5, 8)
    deadline = time.monotonic() + 120
    while len(list((out_dir / STATE_DIR).glob("shard-*.json"))) < target_records and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(rng.uniform(0, 0.03))
    proc.send_signal(signal.SIGKILL)
    assert _finish(proc)[0] == -signal.SIGKILL, "the job ended before the kill: nothing was tested"
    rc, out, err = _finish(_cli(tmp_path, "--json"))
    assert rc == 0, err
    summary = json.loads(out)
    assert 5 <= summary["shards_resumed"] < 10 and summary["written"] == usable and summary["bad_rows"] == 2

    indices = [row_of(r) for r in output_rows(out_dir)]
    assert sorted(indices) == list(range(usable)), "every usable prompt exactly once"
    assert {p.name: p.read_bytes() for p in out_dir.glob("shard-*.jsonl")} == want
    assert sorted(p.name for p in out_dir.iterdir()) == [STATE_DIR, *sorted(want)]  # no leftovers


@pytest.mark.processes
def test_an_engine_failure_is_one_line_and_keeps_finished_shards(tmp_path, target):
    """A real engine failure mid-job: shard 0 needs no engine (bad rows only), and the engine's start for shard 1 is
    refused on the meta device, where a target loads but cannot produce a token (common/device.py)."""
    rows = chat_rows(6)
    data = write_rows(
        tmp_path / "src.jsonl", rows, {0: BAD_LINES[0], 1: BAD_LINES[1], 2: BAD_LINES[2], 3: BAD_LINES[3]}
    )  # shard 0: bad rows only
    write_config(tmp_path / "regen.toml", settings(tmp_path, target, data))
    rc, _, err = _finish(_cli(tmp_path, "--device", "meta"))
    lines = err.strip().splitlines()
    assert rc == 2 and "Traceback" not in err, err
    assert lines[-1].startswith("dflash-ring regenerate: error: cannot start the hf engine: DeviceError: device 'meta'")
    assert "The 1 finished shards are kept" in lines[-1]
    assert [(r["shard"], len(r["bad_rows"])) for r in records(tmp_path / "out")] == [(0, 4)]
    rc, out, err = _finish(_cli(tmp_path, "--json"))
    assert rc == 0, err
    summary = json.loads(out)
    assert (summary["shards_resumed"], summary["written"], summary["bad_rows"]) == (1, 6, 4)
