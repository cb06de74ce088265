"""The rule for a damaged file in a role's own directories (common/damaged_file.py), driven by fuzzers over bytes.

Each file a role reads back is written by its real writer, then damaged by hypothesis (a byte flipped, the file
cut, bytes inserted or deleted), then read by its real reader. The outcome is always one of: read as it is;
rebuilt from what can be trusted, with the damaged bytes kept aside as `NAME.damaged-<time>` and a warning; or
refused with one line naming the file (CursorFileError). Never another exception, never a value the writer did
not write taken from a damaged file without a word.
"""

from __future__ import annotations

import json
import logging
import math
import re
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_ring.common.damaged_file import SUFFIX
from dflash_ring.common.lifecycle.resume_state import CursorFile, CursorFileError, ResumeState
from dflash_ring.common.lifecycle.trained_journal import (
    Entry,
    Journal,
    journal_dir,
    owed_to,
    read_entries,
    seal,
    segments,
)
from dflash_ring.consumer.modeling.head_cache import _digest, cached_spec, store_spec
from dflash_ring.consumer.modeling.target_head import HeadSpec
from dflash_ring.consumer.reporting.tracking import RecordFile, checked_lines, read_records
from dflash_ring.producer.live_replay import LiveReplay

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def damaged(draw, data: bytes) -> bytes:
    """`data` with one to three edits: a byte flipped, a cut, bytes inserted, a range deleted."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["flip", "cut", "insert", "delete"]))
        i = draw(st.integers(0, max(0, len(out) - 1)))
        if kind == "flip" and out:
            out[i] ^= draw(st.integers(1, 255))
        elif kind == "cut":
            del out[i:]
        elif kind == "insert":
            out[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif out:
            del out[i : i + draw(st.integers(1, 16))]
    return bytes(out)


def asides(path: Path) -> list[Path]:
    return sorted(path.parent.glob(f"{path.name}{SUFFIX}*"))


# --- the drafter's journal ---------------------------------------------------------------------------------------


def _journal(root: Path) -> Path:
    j = Journal(journal_dir(root, 0), ring=3, after_step=0)
    for q in range(6):
        j.append({"producer": q % 2, "epoch": q // 4, "position": q}, item=q * 7)
    j.close()
    (path,) = [s.path for s in segments(journal_dir(root, 0))]
    return path


JOURNAL = _journal(Path(tempfile.mkdtemp(prefix="journal-"))).read_bytes()


@FUZZ
@given(st.data())
def test_a_damaged_journal_segment_is_rebuilt_from_its_readable_lines_and_kept_aside(data):
    bad = data.draw(damaged(JOURNAL))
    with tempfile.TemporaryDirectory() as d:
        path = journal_dir(d, 0) / "lost-00000000-1-3.jsonl"
        path.parent.mkdir(parents=True)
        path.write_bytes(bad)
        entries = read_entries(path)  # never raises
        assert all(isinstance(e, Entry) and min(e.producer, e.epoch, e.position, e.item) >= 0 for e in entries)
        kept = asides(path)
        if kept:  # rebuilt: the damaged bytes aside, the file now exactly the entries read
            assert [k.read_bytes() for k in kept] == [bad]
            assert read_entries(path) == entries and asides(path) == kept  # read again: clean, nothing new aside
        else:  # read as it is: every line an entry the writer could have written
            assert bad == b"".join(
                json.dumps(
                    {"p": e.producer, "e": e.epoch, "q": e.position, "i": e.item}, separators=(",", ":")
                ).encode()
                + b"\n"
                for e in entries
            )


@pytest.mark.parametrize(
    "line",
    [
        b'{"p":0,"e":0,"q":9,"i":\xff}',
        b'{"p":0,"e":0,"q":1e400,"i":1}',
        b'{"p":0,"e":0,"q":2.5,"i":1}',
        b'{"p":true,"e":0,"q":1,"i":1}',
        b"[1,2,3,4]",
    ],
)
def test_sealing_a_journal_with_a_line_of_the_issue_keeps_the_rest_and_the_damaged_copy(tmp_path, line, caplog):
    """What the drafter at join, the supervisor at teardown and `clean` all do with a dead drafter's segment:
    seal it. The issue's lines (a byte that is not UTF-8, a number like 1e400) crashed all three."""
    path = _journal(tmp_path)
    path.write_bytes(path.read_bytes() + line + b"\n")
    with caplog.at_level(logging.WARNING):
        assert seal(journal_dir(tmp_path, 0), 0, ring=3, in_ring=()) == 6
    (kept,) = asides(path)
    assert kept.read_bytes().endswith(line + b"\n")
    assert "1 journal line(s) unreadable (line 7), 6 kept" in caplog.text and str(kept) in caplog.text
    assert sorted(e.position for p in (0, 1) for _, es in owed_to(p, tmp_path, ()) for e in es) == list(range(6))


# --- the tracking record file ------------------------------------------------------------------------------------

HEADER = {"series": "config", "run": "r", "drafter": 0, "fingerprint": "ab", "config": "[run]\nname = 'r'\n"}


def _records(path: Path) -> bytes:
    f = RecordFile(path, HEADER)
    for step in range(1, 9):
        f.write(step, "train", {"loss": 1.0 / step, "accept_len": 1.5 + step / 10, "time_s": 0.25})
    f.write(8, "eval", {"eval/loss": 0.5})
    f.close()
    return path.read_bytes()


RECORDS = _records(Path(tempfile.mkdtemp(prefix="records-")) / "drafter-0.jsonl")


@FUZZ
@given(st.data())
def test_a_damaged_record_file_keeps_every_line_that_checks_and_the_damaged_copy(data):
    bad = data.draw(damaged(RECORDS))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "drafter-0.jsonl"
        path.write_bytes(bad)
        good, wrong, _ = checked_lines(bad)
        f = RecordFile(path, HEADER)  # never raises: the drafter starts
        kept = asides(path)
        assert [k.read_bytes() for k in kept] == ([bad] if wrong else [])
        assert f.logged == [r for r in good if "step" in r]  # no line that checks is lost with a damaged one
        f.write(100, "train", {"loss": 0.1})
        f.close()
        lines, bad_after, whole = checked_lines(path.read_bytes())
        assert not bad_after and whole == path.stat().st_size and lines[-1]["step"] == 100
        assert read_records(path) == lines


def test_one_flipped_byte_mid_file_costs_its_line_not_the_rest_of_the_curve(tmp_path, caplog):
    path = tmp_path / "drafter-0.jsonl"
    data = bytearray(_records(path))
    third = data.index(b'"step": 3')
    data[third + 2] ^= 0x80  # a byte of line 4 (step 3) that is not UTF-8 any more
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        f = RecordFile(path, HEADER)
    f.close()
    assert [(r["series"], r["step"]) for r in f.logged] == [("train", s) for s in (1, 2, 4, 5, 6, 7, 8)] + [("eval", 8)]
    assert "1 record line(s) unreadable (line 4), 9 kept" in caplog.text and len(asides(path)) == 1


@pytest.mark.parametrize(
    "line",
    [
        b"5",
        b'{"step": "x", "series": "train"}',
        b'{"step": 9, "series": 3}',
        b'{"step": 9, "series": "train", "loss": "low"}',
        b'{"no": "step"}',
    ],
)
def test_a_malformed_line_no_longer_stops_the_drafter_at_start(tmp_path, line):
    path = tmp_path / "drafter-0.jsonl"
    path.write_bytes(_records(path) + line + b"\n")
    f = RecordFile(path, HEADER)
    f.close()
    assert f.last == {"train": 8, "eval": 8} and asides(path)


# --- the head cache ----------------------------------------------------------------------------------------------


class _Errors:
    embedding, logits = 1e-7, 2e-7


SPECS = [HeadSpec(tied=False), HeadSpec(tied=True, embed_scale=8.0), HeadSpec(False, 0.5, 0.125, 30.0)]


@FUZZ
@given(st.data(), st.sampled_from(SPECS))
def test_a_damaged_head_cache_is_never_trusted_only_probed_again(data, spec):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "target-head.json"
        store_spec(path, "k" * 64, spec, _Errors)
        bad = data.draw(damaged(path.read_bytes()))
        path.write_bytes(bad)
        got = cached_spec(path, "k" * 64, untied_head=True)
        assert got is None or got == spec  # never another value than the one stored
        if got is None and path.exists():  # kept aside (or another target's key: simply probed again)
            assert json.loads(path.read_bytes().decode("utf-8", "replace")).get("key") != "k" * 64
        if asides(path):
            assert got is None and not path.exists() and asides(path)[0].read_bytes() == bad


def _edited(path: Path, redigest: bool, **head) -> None:
    record = json.loads(path.read_text())
    record["head"].update(head)
    if redigest:
        record["digest"] = _digest(record["key"], record["head"])
    path.write_text(json.dumps(record))


@pytest.mark.parametrize(
    "head, redigest, untied_head",
    [
        (dict(embed_scale=math.nan), True, True),  # trained NaN silently
        (dict(embed_scale=math.nan), False, True),
        (dict(logit_softcap=1e-6), False, True),  # trained nothing silently
        (dict(logit_softcap=-3.0), True, True),
        (dict(logit_multiplier=0.0), True, True),
        (dict(tied=False), True, False),  # a traceback blaming the target
        (dict(tied="yes"), True, True),
        (dict(embed_scale="8"), True, True),
    ],
)
def test_the_issues_head_cache_values_are_doubted(tmp_path, head, redigest, untied_head, caplog):
    path = tmp_path / "target-head.json"
    store_spec(path, "k", HeadSpec(tied=True, embed_scale=8.0, logit_softcap=30.0), _Errors)
    _edited(path, redigest, **head)
    with caplog.at_level(logging.WARNING):
        assert cached_spec(path, "k", untied_head=untied_head) is None
    assert not path.exists() and len(asides(path)) == 1 and "the head probe runs again" in caplog.text


# --- the producer's replay list ----------------------------------------------------------------------------------


def _in_plan(epoch: int, position: int) -> bool:
    return epoch == 0 and 0 <= position < 4


def test_a_sealed_segment_naming_a_batch_outside_the_plan_is_refused_before_the_list_is_saved(tmp_path, caplog):
    """The issue's crash loop: the entry was saved in the cursor file before the producer failed on it."""
    d = journal_dir(tmp_path, 0)
    d.mkdir(parents=True)
    (d / "lost-00000000-11-3.jsonl").write_text(
        '{"p":0,"e":0,"q":2,"i":1}\n{"p":0,"e":0,"q":999,"i":2}\n{"p":0,"e":7,"q":0,"i":3}\n'
    )
    cursor = CursorFile(tmp_path / "producer-0.json", "plan")
    live = LiveReplay(0, ResumeState(0, 4), cursor, tmp_path, _in_plan)  # (0, 2) was published: at the end of the plan
    with caplog.at_level(logging.ERROR):
        assert live.poll(force=True) == 1
    assert "names 2 batch(es) that are not in producer 0's plan" in caplog.text
    saved = cursor.load()
    assert saved.replay == ((0, 2),) and saved.taken == ("drafter-0/lost-00000000-11-3.jsonl",)
    assert live.poll(force=True) == 0  # taken once


def test_a_replay_list_already_holding_a_batch_outside_the_plan_is_rebuilt_without_it(tmp_path):
    """What an earlier version saved stays owed for ever (the supervisor waits on it) and stops the producer at
    each start: the pending part is rebuilt without it, the damaged file kept; the published part is untouched."""
    cursor = CursorFile(tmp_path / "producer-0.json", "plan")
    start = ResumeState(0, 3, replay=((0, 1), (5, 5), (0, 2), (0, 99)), replayed=2)
    cursor.save(start)
    live = LiveReplay(0, start, cursor, tmp_path, _in_plan)
    assert live.entries_from(2) == [(0, 2)] and len(asides(cursor.path)) == 1
    assert cursor.load().replay == ((0, 1), (5, 5), (0, 2)) and cursor.load().replayed == 2


@FUZZ
@given(st.data())
def test_a_damaged_cursor_file_is_read_or_refused_in_one_line(data):
    with tempfile.TemporaryDirectory() as d:
        cursor = CursorFile(Path(d) / "producer-0.json", "plan")
        cursor.save(ResumeState(1, 5, ((0, 1), (0, 2)), 1, ("drafter-0/lost-00000004-9-1.jsonl",)))
        cursor.path.write_bytes(data.draw(damaged(cursor.path.read_bytes())))
        try:
            cursor.read()
        except CursorFileError as e:
            assert str(cursor.path) in str(e) and "\n" not in str(e)


@pytest.mark.parametrize(
    "head, redigest",
    [
        (dict(tied=True), True),
        (dict(tied=False), True),
        (dict(embed_scale=math.nan), True),
        (dict(logit_softcap=1e-6), False),
    ],
)
def test_a_real_target_head_read_through_a_doubted_cache_is_the_probes(tmp_path, head, redigest):
    """Through the real loader on a real (untied) checkpoint: the issue's edits give the head the probe derives
    and a rewritten cache. A value the probe could derive with the digest made to match (a tiny softcap, so
    re-digested) is a forgery the digest cannot catch: the target's own outputs the probe recorded beside the values
    do (consumer/modeling/head_cache.py), and the probe runs again."""
    from support import build_target

    from dflash_ring.consumer.modeling.head_loader import load_target_head

    target = build_target(tmp_path / "target", "qwen3", layers=1, hidden=32)
    cache = tmp_path / "drafter-0" / "target-head.json"
    probed = load_target_head(target, cache=cache).spec
    _edited(cache, redigest, **head)
    got = load_target_head(target, cache=cache).spec
    assert got == probed and cached_spec(cache, json.loads(cache.read_text())["key"], not probed.tied) == probed
    unchanged = HeadSpec.from_json({**probed.to_json(), **head}) == probed
    assert len(asides(cache)) == (0 if unchanged else 1)


def test_the_report_refuses_a_line_that_is_not_json_in_one_line_naming_it(tmp_path):
    """The report reads a file it does not own: it refuses (the drafter that owns it rebuilds it)."""
    from dflash_ring.consumer.reporting.tracking import RecordFileError

    path = tmp_path / "drafter-0.jsonl"
    path.write_bytes(_records(path).replace(b'"step": 3', b'"step": \xff3'))
    with pytest.raises(RecordFileError, match=r"drafter-0.jsonl, line 4: not JSON") as e:
        read_records(path)
    assert "\n" not in str(e.value)


# --- a drafter's checkpoint directory: the `latest` pointer ---------------------------------------------------------


def _two_checkpoints(root: Path):
    from dflash_ring.consumer.training.checkpoint import Checkpoint, CheckpointStore

    store = CheckpointStore(root)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    for step in (1, 2):
        store.save(
            Checkpoint(
                step,
                {k: v.detach().clone() for k, v in model.state_dict().items()},
                opt.state_dict(),
                {"rng": torch.get_rng_state()},
            ),
            keep=2,
        )
    return store


@FUZZ
@given(st.data())
def test_a_damaged_latest_pointer_orders_nothing_and_the_newest_complete_checkpoint_loads(data):
    """The pointer only says which complete checkpoint comes first; damaged, it is kept aside with a warning and the
    newest complete checkpoint loads (it raised UnicodeDecodeError on a non-UTF-8 byte, a traceback at start)."""
    with tempfile.TemporaryDirectory() as tmp:
        store = _two_checkpoints(Path(tmp) / "ckpt")
        latest = store.root / "latest"
        written = latest.read_bytes()
        latest.write_bytes(data.draw(damaged(written)))
        name = latest.read_bytes()
        ckpt = store.load_latest()
        assert ckpt is not None
        text = name.decode("ascii", errors="replace").strip()
        if text in ("step-00000001", "step-00000002"):  # still a checkpoint's name: followed, kept
            assert ckpt.path.name == text and latest.read_bytes() == name and not asides(latest)
        elif re.fullmatch(r"step-\d{8}", text, re.ASCII):  # a checkpoint's name, of none that is complete: no order
            assert ckpt.step == 2 and latest.read_bytes() == name and not asides(latest)
        else:
            assert ckpt.step == 2 and not latest.exists() and asides(latest)[0].read_bytes() == name
        assert sorted(store.contents()[1]) == ["step-00000001", "step-00000002"]
