"""Loading, tokenizing and caching data for producers, on an offline tokenizer with a Qwen3-style template."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from dflash_ring.common.chat_encoding import ChatEncoder
from dflash_ring.common.config.data import DataConfig, DataError
from dflash_ring.producer.pretokenized import load_tokenized
from dflash_ring.embedded.tiny_tokenizer import tiny_chat_tokenizer

CHAT = [
    {"role": "system", "content": "be nice"},
    {"role": "user", "content": "hi there"},
    {"role": "assistant", "content": "hello world"},
    {"role": "user", "content": "what is the capital of France?"},
    {"role": "assistant", "content": "Paris, of course 😀"},
]
GOOD_ROWS = [
    {"messages": CHAT},
    {"prompt": "explain speculative decoding", "response": "a drafter guesses, the target checks"},
    {"messages": CHAT[1:3]},
]
# The same ChatML, with the assistant spans marked for HF's own mask.
MARKED_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- m.content + '<|im_end|>\\n' }}{%- endgeneration %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
UNMARKED_TEMPLATE = MARKED_TEMPLATE.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_chat_tokenizer(tmp_path_factory.mktemp("tok"))


def spans(tokenizer, ids, mask) -> list[str]:
    """The decoded runs of masked tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [tokenizer.decode(ids[s:e]) for s, e in zip(edges[::2], edges[1::2])]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sample(data, i) -> tuple[np.ndarray, np.ndarray]:
    s = slice(data.offsets[i], data.offsets[i + 1])
    return np.asarray(data.tokens[s]), np.asarray(data.loss_mask[s])


def test_tiny_tokenizer_round_trips_through_auto_tokenizer(tmp_path):
    tok = tiny_chat_tokenizer(tmp_path / "tok")
    again = AutoTokenizer.from_pretrained(tmp_path / "tok")
    text = "Grüße, 世界! <|im_start|>x"
    assert again.decode(again.encode(text, add_special_tokens=False)) == text
    assert tok.encode(text) == again.encode(text)
    assert again.chat_template == tok.chat_template


def test_loss_mask_multi_turn_chat_thinking_off(tokenizer):
    ids, mask = ChatEncoder(tokenizer, max_length=4096, enable_thinking=False).encode({"messages": CHAT})
    # The empty <think> block is part of the prompt when thinking is off, so it is not learned.
    assert spans(tokenizer, ids, mask) == ["hello world<|im_end|>\n", "Paris, of course 😀<|im_end|>\n"]
    rendered = tokenizer.apply_chat_template(CHAT, tokenize=False, enable_thinking=False)
    assert ids.tolist() == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert ids.dtype == np.int32 and mask.dtype == np.uint8


def test_loss_mask_thinking_on_learns_the_think_block(tokenizer):
    ids, mask = ChatEncoder(tokenizer, max_length=4096, enable_thinking=True).encode({"messages": CHAT})
    assert spans(tokenizer, ids, mask) == [
        "hello world<|im_end|>\n",
        "<think>\n\n</think>\n\nParis, of course 😀<|im_end|>\n",
    ]


def test_loss_mask_with_reasoning_in_history_and_last_turn(tokenizer):
    chat = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "<think>\nold thoughts\n</think>\n\nfirst answer"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "<think>\nnew thoughts\n</think>\n\nsecond answer"},
    ]
    ids, mask = ChatEncoder(tokenizer, max_length=4096, enable_thinking=True).encode({"messages": chat})
    # The template drops the reasoning of history turns; the last turn keeps it.
    assert spans(tokenizer, ids, mask) == [
        "first answer<|im_end|>\n",
        "<think>\nnew thoughts\n</think>\n\nsecond answer<|im_end|>\n",
    ]


def test_loss_mask_plain_row(tokenizer):
    ids, mask = ChatEncoder(tokenizer, max_length=4096, enable_thinking=False).encode(GOOD_ROWS[1])
    assert spans(tokenizer, ids, mask) == ["a drafter guesses, the target checks<|im_end|>\n"]
    assert tokenizer.decode(ids).startswith("<|im_start|>user\nexplain speculative decoding<|im_end|>\n")


def test_generation_markers_agree_with_template_diffing(tmp_path):
    marked = tiny_chat_tokenizer(tmp_path / "marked", chat_template=MARKED_TEMPLATE)
    unmarked = tiny_chat_tokenizer(tmp_path / "unmarked", chat_template=UNMARKED_TEMPLATE)
    by_markers = ChatEncoder(marked, max_length=4096, enable_thinking=False)
    by_diffing = ChatEncoder(unmarked, max_length=4096, enable_thinking=False)
    assert by_markers.uses_generation_markers and not by_diffing.uses_generation_markers
    for row in GOOD_ROWS:
        (ids_a, mask_a), (ids_b, mask_b) = by_markers.encode(row), by_diffing.encode(row)
        assert ids_a.tolist() == ids_b.tolist() and mask_a.tolist() == mask_b.tolist()
        assert mask_a.any()


@pytest.mark.parametrize(
    "template,says",
    [
        (MARKED_TEMPLATE.replace("m.content + ", "m.content } + "), "TemplateSyntaxError"),
        (  # markers around nothing: every reply unmarked
            MARKED_TEMPLATE.replace(
                "{%- generation %}{{- m.content + '<|im_end|>\\n' }}", "{{- m.content }}{%- generation %}"
            ),
            "its {% generation %} markers mark no token of the reply",
        ),
    ],
    ids=["does-not-parse", "marks-nothing"],
)
def test_a_marked_template_that_cannot_mark_a_reply_is_refused_before_any_row(tmp_path, template, says):
    """Each row of every data set was a bad row, reported as 'no usable row' with the rows' shape as the fix."""
    broken = tiny_chat_tokenizer(tmp_path / "tok", chat_template=template)
    with pytest.raises(DataError, match="cannot render a minimal user/assistant chat") as e:
        ChatEncoder(broken, max_length=4096, enable_thinking=False)
    assert says in str(e.value), str(e.value)


@pytest.mark.parametrize("template", [MARKED_TEMPLATE, UNMARKED_TEMPLATE], ids=["marked", "unmarked"])
def test_a_template_that_multiplies_a_row_skips_it_in_one_line_naming_the_template(tmp_path, caplog, template):
    """A chat template that loops over a row's content rendered it many times over and tokenizing it never ended
    (issue 46): a rendering past RENDER_FACTOR times the row's characters plus RENDER_SLACK is a bad row, skipped
    before anything tokenizes it, in one line naming the row and the template; the other rows are kept."""
    assert template.count("{%- endfor %}") == 1
    looping = template.replace(
        "{%- for m in messages %}",
        "{%- for m in messages %}{%- for _ in range(10000 if 'again' in m.content else 1) %}",
    ).replace("{%- endfor %}", "{%- endfor %}{%- endfor %}")
    tok = tiny_chat_tokenizer(tmp_path / "tok", chat_template=looping)
    looped = {"messages": [{"role": "user", "content": "again"}, {"role": "assistant", "content": "and again"}]}
    path = write_jsonl(tmp_path / "rows.jsonl", [GOOD_ROWS[0], looped])
    with caplog.at_level(logging.WARNING, logger="dflash_ring.producer.pretokenized"):
        data = load_tokenized(DataConfig(path=str(path), cache_dir=str(tmp_path / "cache")), tok)
    assert data.row_ids.tolist() == [0] and [i for i, _ in data.bad_rows] == [1]
    (line,) = [r.getMessage() for r in caplog.records if "skipping row 1 " in r.getMessage()]
    assert f"the chat template of {tok.name_or_path} renders it as" in line and "\n" not in line, line


def test_truncation_to_max_length(tokenizer):
    full_ids, full_mask = ChatEncoder(tokenizer, max_length=4096, enable_thinking=False).encode({"messages": CHAT})
    cut = int(np.flatnonzero(full_mask)[0]) + 3
    ids, mask = ChatEncoder(tokenizer, max_length=cut, enable_thinking=False).encode({"messages": CHAT})
    assert ids.tolist() == full_ids[:cut].tolist() and mask.tolist() == full_mask[:cut].tolist()


def test_bad_rows_are_skipped_counted_and_reported_once(tokenizer, tmp_path, caplog):
    path = tmp_path / "mixed.jsonl"
    lines = [
        json.dumps(GOOD_ROWS[0]),  # 0
        "{not json",  # 1
        json.dumps({"messages": "hello"}),  # 2 wrong type
        json.dumps({"messages": []}),  # 3 empty conversation
        json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),  # 4 no assistant turn
        json.dumps({"prompt": "q"}),  # 5 missing response
        json.dumps({"prompt": "q", "response": 7}),  # 6 wrong type
        json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]}),  # 7
        json.dumps({"messages": [{"role": "wizard", "content": "q"}, {"role": "assistant", "content": "a"}]}),  # 8
        json.dumps({"prompt": "bad \ud800 surrogate", "response": "a"}),  # 9 invalid unicode
        json.dumps(GOOD_ROWS[1]),  # 10
        json.dumps([1, 2]),  # 11 not an object
        json.dumps({"text": "no known field"}),  # 12
        "",  # 13 blank line
        json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]}),  # 14
        json.dumps(GOOD_ROWS[2]),  # 15
        "[" * 100_000 + "]" * 100_000,  # 16 nested past the parser's recursion
        '{"prompt": "q", "response": "a", "n": ' + "1" * 5000 + "}",  # 17 an integer past the digit limit
    ]
    raw = ("\n".join(lines) + "\n").encode()
    raw += b'{"prompt": "broken \xff\xfe bytes", "response": "a"}\n'  # 18 undecodable bytes
    path.write_bytes(raw)
    cfg = DataConfig(path=str(path), cache_dir=str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="dflash_ring.producer.pretokenized"):
        data = load_tokenized(cfg, tokenizer)
    bad = dict(data.bad_rows)
    assert sorted(bad) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 14, 16, 17, 18]
    assert data.row_ids.tolist() == [0, 10, 15] and data.num_rows == 19
    assert "JSON" in bad[1] and "not a list" in bad[2] and "no assistant" in bad[4] and "Unicode" in bad[9]
    assert "nested deeper" in bad[16] and "digits" in bad[17] and "U+FFFD" in bad[18]
    for index in bad:
        assert sum(f"skipping row {index} " in r.getMessage() for r in caplog.records) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dflash_ring.producer.pretokenized"):
        again = load_tokenized(cfg, tokenizer)
    assert again.from_cache and again.bad_rows == data.bad_rows
    assert not [r for r in caplog.records if "skipping row" in r.getMessage()]


def test_entirely_bad_data_set_is_a_clear_error(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"messages": "x"}, {"foo": 1}, 3])
    with pytest.raises(DataError, match="no usable row.*'messages'"):
        load_tokenized(DataConfig(path=str(path), cache_dir=str(tmp_path / "cache")), tokenizer)
    assert not list((tmp_path / "cache").glob("tokenized-*/"))


def test_empty_data_set_is_a_clear_error(tokenizer, tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="no rows"):
        load_tokenized(DataConfig(path=str(tmp_path / "empty.jsonl"), cache_dir=str(tmp_path / "c")), tokenizer)
    with pytest.raises(DataError, match="does not exist"):
        load_tokenized(DataConfig(path=str(tmp_path / "missing.jsonl"), cache_dir=str(tmp_path / "c")), tokenizer)


def test_parquet_without_row_columns_is_a_clear_error(tokenizer, tmp_path):
    pq.write_table(pa.Table.from_pylist([{"text": "a"}]), tmp_path / "x.parquet")
    with pytest.raises(DataError, match="none of the columns"):
        load_tokenized(DataConfig(path=str(tmp_path / "x.parquet"), cache_dir=str(tmp_path / "c")), tokenizer)


def _parquet_cut(root: Path, keep: float) -> Path:
    """A real parquet file of the good rows, cut to `keep` of its bytes (a copy stopped part way)."""
    table = pa.Table.from_pylist(
        [{"prompt": r.get("prompt", "q"), "response": r.get("response", "a")} for r in GOOD_ROWS]
    )
    pq.write_table(table, root / "whole.parquet")
    raw = (root / "whole.parquet").read_bytes()
    (root / "cut.parquet").write_bytes(raw[: int(len(raw) * keep)])
    return root / "cut.parquet"


def _file(root: Path, name: str, content: str | bytes, inside: str = "") -> Path:
    """root/name holding `content`; with `inside`, a directory root/name holding that file."""
    path = root / name
    if inside:
        path.mkdir()
    (path / inside if inside else path).write_bytes(content.encode() if isinstance(content, str) else content)
    return path


# What the data set reader refuses of a data set as a whole: one DataError naming it and what to do, never the
# library's traceback. (setup(tmp) -> (path, DataConfig overrides), what the message says)
UNREADABLE = {
    "parquet-not-parquet": (
        lambda t: (_file(t, "x.parquet", b"PAR1garbage"), {}),
        "format 'parquet'",
    ),
    "parquet-empty": (lambda t: (_file(t, "x.parquet", b""), {}), "0 bytes"),
    "parquet-truncated-head": (lambda t: (_parquet_cut(t, 0.1), {}), "cut.parquet cannot be read"),
    "parquet-truncated-half": (lambda t: (_parquet_cut(t, 0.5), {}), "cut.parquet cannot be read"),
    "parquet-truncated-tail": (lambda t: (_parquet_cut(t, 0.99), {}), "cut.parquet cannot be read"),
    "arrow-garbage": (lambda t: (_file(t, "x.arrow", b"garbage"), {}), "format 'arrow'"),
    "jsonl-read-as-parquet": (lambda t: (write_jsonl(t / "x.jsonl", GOOD_ROWS), {"format": "parquet"}), "data.format"),
    "unknown-split": (lambda t: (write_jsonl(t / "x.jsonl", GOOD_ROWS), {"split": "validation"}), "'validation'"),
    "malformed-split": (lambda t: (write_jsonl(t / "x.jsonl", GOOD_ROWS), {"split": "train[abc]"}), "data.split"),
    "empty-split": (lambda t: (write_jsonl(t / "x.jsonl", GOOD_ROWS), {"split": "train[:0]"}), "no data"),
    "save-to-disk-damaged": (
        lambda t: (_file(t, "d", "{", inside="state.json"), {}),
        "format 'disk'",
    ),
    "byte-order-mark-only": (lambda t: (_file(t, "x.jsonl", b"\xef\xbb\xbf"), {}), "no rows"),
    "empty-json-array": (lambda t: (_file(t, "x.json", "[ ]"), {}), "no rows"),
    "json-array-too-deep": (
        lambda t: (_file(t, "x.json", "[" * 100_000 + "]" * 100_000), {}),
        "not a valid JSON array (nested deeper",
    ),
    "a-device": (lambda t: (Path("/dev/null"), {"format": "jsonl"}), "neither a regular file nor a directory"),
    # Read a line per row, each of its lines was a bad row ("no usable row", naming no cause).
    "pretty-printed-object": (
        lambda t: (_file(t, "x.json", json.dumps(GOOD_ROWS[0], indent=2)), {}),
        "holds pretty-printed JSON (a row over several lines)",
    ),
    "pretty-printed-rows": (
        lambda t: (_file(t, "x.jsonl", "\n".join(json.dumps(r, indent=1) for r in GOOD_ROWS)), {}),
        "write one JSON object per line",
    ),
}


@pytest.mark.parametrize("case", list(UNREADABLE))
def test_an_unreadable_data_set_is_one_data_error(tokenizer, tmp_path, case):
    setup, says = UNREADABLE[case]
    path, settings = setup(tmp_path)
    cfg = DataConfig(path=str(path), cache_dir=str(tmp_path / "cache"), **settings)
    with pytest.raises(DataError) as e:
        load_tokenized(cfg, tokenizer)
    assert says in str(e.value) and (str(path) in str(e.value) or "no data" in str(e.value)), str(e.value)


def test_a_dangling_data_file_in_a_directory_is_refused_not_skipped(tokenizer, tmp_path):
    (tmp_path / "d").mkdir()
    write_jsonl(tmp_path / "d" / "a.jsonl", GOOD_ROWS)
    (tmp_path / "d" / "b.jsonl").symlink_to(tmp_path / "gone.jsonl")
    with pytest.raises(DataError, match="b.jsonl is not a readable regular file"):
        load_tokenized(DataConfig(path=str(tmp_path / "d"), cache_dir=str(tmp_path / "c")), tokenizer)


def test_a_fifo_is_refused_not_read(tokenizer, tmp_path):
    """A FIFO as data.path would block the reader forever (or read as an empty file): refused by kind."""
    os.mkfifo(tmp_path / "pipe.jsonl")
    with pytest.raises(DataError, match="pipe.jsonl is neither a regular file nor a directory"):
        load_tokenized(DataConfig(path=str(tmp_path / "pipe.jsonl"), cache_dir=str(tmp_path / "c")), tokenizer)


def _cut(name: str, keep: float):
    def change(d: Path) -> None:
        raw = (d / name).read_bytes()
        (d / name).write_bytes(raw[: int(len(raw) * keep)])

    return change


def _array(name: str, value):
    return lambda d: np.save(d / f"{name}.npy", value(np.load(d / f"{name}.npy")))


def _meta(**fields):
    return lambda d: (d / "meta.json").write_text(json.dumps({**json.loads((d / "meta.json").read_text()), **fields}))


# A tokenized cache entry damaged on disk. Each was a traceback at the next start (not JSON, mmap past the end, a
# pickled array, an index out of bounds in batching), a bare errno line (a file gone) or, for a row id of another
# dtype, a silent approximate read; now the entry is kept aside and tokenized again (common/damaged_file.py's rule).
DAMAGED_CACHE = {
    "meta-not-json": lambda d: (d / "meta.json").write_text("{x"),
    "meta-a-list": lambda d: (d / "meta.json").write_text("[]"),
    "meta-bad-rows-a-number": _meta(bad_rows=5),
    "meta-gone": lambda d: (d / "meta.json").unlink(),
    "tokens-cut-short": _cut("tokens.npy", 0.5),
    "tokens-header-cut": _cut("tokens.npy", 0.01),
    "offsets-gone": lambda d: (d / "offsets.npy").unlink(),
    "offsets-not-npy": lambda d: (d / "offsets.npy").write_bytes(b"garbage"),
    "offsets-too-few": _array("offsets", lambda a: a[:2]),
    "offsets-past-the-tokens": _array("offsets", lambda a: a * 100),
    "row-ids-floats": _array("row_ids", lambda a: a.astype(np.float32)),
    "loss-mask-short": _array("loss_mask", lambda a: a[:3]),
}


@pytest.mark.parametrize("case", list(DAMAGED_CACHE))
def test_a_damaged_tokenized_cache_is_kept_aside_and_rebuilt(tokenizer, tmp_path, caplog, case):
    path = write_jsonl(tmp_path / "rows.jsonl", GOOD_ROWS + [{"messages": "bad"}])
    cfg = DataConfig(path=str(path), cache_dir=str(tmp_path / "cache"))
    first = load_tokenized(cfg, tokenizer)
    want = [np.asarray(getattr(first, n)).tolist() for n in ("tokens", "loss_mask", "offsets", "row_ids")]
    DAMAGED_CACHE[case](first.directory)
    with caplog.at_level(logging.WARNING, logger="dflash_ring.common.damaged_file"):
        again = load_tokenized(cfg, tokenizer)
    assert not again.from_cache and again.bad_rows == first.bad_rows and again.num_rows == first.num_rows
    assert [np.asarray(getattr(again, n)).tolist() for n in ("tokens", "loss_mask", "offsets", "row_ids")] == want
    (aside,) = (tmp_path / "cache").glob("tokenized-*.damaged-*")
    assert [r.getMessage() for r in caplog.records if str(aside) in r.getMessage()], caplog.text
    assert load_tokenized(cfg, tokenizer).from_cache  # the rebuilt entry is whole


def _write(kind: str, root: Path) -> tuple[Path, str]:
    # Arrow needs one schema: chat and plain rows share the columns, each leaving the other's empty.
    table = pa.Table.from_pylist(
        [{"messages": r.get("messages"), "prompt": r.get("prompt"), "response": r.get("response")} for r in GOOD_ROWS]
    )
    if kind == "json":
        (root / "rows.json").write_text(json.dumps(GOOD_ROWS))
        return root / "rows.json", "auto"
    if kind == "jsonl":
        return write_jsonl(root / "rows.jsonl", GOOD_ROWS), "auto"
    if kind == "parquet":
        pq.write_table(table, root / "rows.parquet")
        return root / "rows.parquet", "auto"
    if kind == "arrow":
        with pa.ipc.new_stream(root / "rows.arrow", table.schema) as writer:
            writer.write_table(table)
        return root / "rows.arrow", "auto"
    if kind == "disk":
        datasets.Dataset(table).save_to_disk(str(root / "saved"))
        return root / "saved", "auto"
    datasets.DatasetDict({"train": datasets.Dataset(table.slice(0, 1)), "mine": datasets.Dataset(table)}).save_to_disk(
        str(root / "saved_dict")
    )
    return root / "saved_dict", "disk"


@pytest.mark.parametrize("kind", ["json", "jsonl", "parquet", "arrow", "disk", "disk_dict"])
def test_input_formats_give_identical_samples(tokenizer, tmp_path, kind):
    reference = ChatEncoder(tokenizer, max_length=3072, enable_thinking=False)
    path, fmt = _write(kind, tmp_path)
    split = "mine" if kind == "disk_dict" else "train"
    data = load_tokenized(DataConfig(path=str(path), format=fmt, split=split, cache_dir=str(tmp_path / "c")), tokenizer)
    assert len(data) == len(GOOD_ROWS) and not data.bad_rows
    assert data.row_ids.tolist() == [0, 1, 2]
    for i, row in enumerate(GOOD_ROWS):
        ids, mask = sample(data, i)
        want_ids, want_mask = reference.encode(row)
        assert ids.tolist() == want_ids.tolist() and mask.tolist() == want_mask.tolist()
    assert data.tokens.dtype == np.int32 and data.loss_mask.dtype == np.uint8
    assert data.offsets[-1] == len(data.tokens) == len(data.loss_mask)


def test_cache_is_reused_without_tokenizing(tokenizer, tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "rows.jsonl", GOOD_ROWS)
    cfg = DataConfig(path=str(path), cache_dir=str(tmp_path / "cache"))
    first = load_tokenized(cfg, tokenizer)
    assert not first.from_cache

    def refuse(*_args, **_kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(ChatEncoder, "encode", refuse)
    monkeypatch.setattr(datasets, "load_dataset", refuse)
    # Batching settings are not part of the cache key.
    second = load_tokenized(
        DataConfig(path=str(path), cache_dir=cfg.cache_dir, seed=5, max_tokens_per_batch=8192), tokenizer
    )
    assert second.from_cache and second.directory == first.directory
    assert np.array_equal(second.tokens, first.tokens) and np.array_equal(second.offsets, first.offsets)


def test_cache_is_invalidated_when_settings_change(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", GOOD_ROWS)
    cache = str(tmp_path / "cache")
    base = load_tokenized(DataConfig(path=str(path), cache_dir=cache), tokenizer)
    for cfg in (
        DataConfig(path=str(path), cache_dir=cache, max_length=40),
        DataConfig(path=str(path), cache_dir=cache, enable_thinking=True),
    ):
        changed = load_tokenized(cfg, tokenizer)
        assert not changed.from_cache and changed.directory != base.directory
    assert load_tokenized(DataConfig(path=str(path), cache_dir=cache, max_length=40), tokenizer).from_cache
    other = tiny_chat_tokenizer(tmp_path / "other", chat_template=UNMARKED_TEMPLATE)
    assert not load_tokenized(DataConfig(path=str(path), cache_dir=cache), other).from_cache
    write_jsonl(path, GOOD_ROWS[:2])
    edited = load_tokenized(DataConfig(path=str(path), cache_dir=cache), tokenizer)
    assert not edited.from_cache and len(edited) == 2


def test_parallel_tokenization_matches_serial(tokenizer, tmp_path):
    rows = [GOOD_ROWS[i % 3] for i in range(40)] + [{"messages": 1}]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    serial = load_tokenized(DataConfig(path=str(path), cache_dir=str(tmp_path / "a")), tokenizer)
    parallel = load_tokenized(DataConfig(path=str(path), cache_dir=str(tmp_path / "b"), num_proc=2), tokenizer)
    for name in ("tokens", "loss_mask", "offsets", "row_ids"):
        assert np.array_equal(getattr(serial, name), getattr(parallel, name))
    assert parallel.bad_rows == serial.bad_rows == ((40, "'messages' is not a list (got int)"),)


def test_config_rejects_impossible_settings():
    with pytest.raises(DataError, match="max_tokens_per_batch"):
        DataConfig(path="x", max_length=4096, max_tokens_per_batch=1024)
    with pytest.raises(DataError, match="format"):
        DataConfig(path="x", format="csv")
