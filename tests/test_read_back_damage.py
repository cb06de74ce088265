"""Exactly once whatever is read back (issue 46, goal 1): what a role reads back from its own files is checked, never
trusted because it is well-formed.

Each case was tried as an adversary would (a digit changed, a line repeated, a line naming a batch a checkpoint
already holds, a valid line added to a sealed segment, a replay list with a repeated or impossible entry, a cursor
past its plan, a tokenized cache with an altered token, a standby with other settings) and trained a batch twice, lost
one, or raised a traceback, in silence. Now each is damage named (kept aside as the damaged-file rule does) or a
contradiction named, and never makes a batch train twice or vanish without a word. The fuzzer at the end edits
journals as the chaos runs' kills cannot (bytes, digits, repeated, dropped and added lines) and checks what the
reader hands back against what the writer wrote.
"""

from __future__ import annotations

import json
import logging
import random
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_ring.common.config.data import DataConfig
from dflash_ring.common.config.load import load_config
from dflash_ring.common.damaged_file import SUFFIX
from dflash_ring.common.lifecycle.resume_state import CursorFile, CursorFileError, ResumeState
from dflash_ring.common.lifecycle.trained_journal import (
    Journal,
    journal_dir,
    lost_segments,
    owed_to,
    read_entries,
    seal,
    segments,
)
from dflash_ring.common.ring import ConfigMismatchError, Ring
from dflash_ring.common.ring_spec import ring_spec
from dflash_ring.embedded.tiny_tokenizer import tiny_chat_tokenizer
from dflash_ring.producer.live_replay import LiveReplay
from dflash_ring.producer.pretokenized import load_tokenized

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _meta(p: int, e: int, q: int) -> dict[str, int]:
    return {"producer": p, "epoch": e, "position": q}


def asides(path: Path) -> list[Path]:
    return sorted(path.parent.glob(f"{path.name}{SUFFIX}*"))


def _two_segments(root: Path) -> Path:
    """Drafter 0's journal across the states of checkpoints 0 and 4: batches 0-2 trained into steps 1-3 (the
    checkpoint of step 4 holds them), batches 3-5 into steps 5-7. Returns the journal's directory."""
    j = Journal(journal_dir(root, 0), ring=3, after_step=0)
    for q in range(3):
        j.append(_meta(0, 0, q), item=q, step=q + 1)
    j.rotate(4)
    for q in range(3, 6):
        j.append(_meta(0, 0, q), item=q, step=q + 2)
    j.close()
    return journal_dir(root, 0)


def _segment(d: Path, after: int) -> Path:
    (s,) = [s for s in segments(d) if s.after_step == after]
    return s.path


def _owed_positions(root: Path, producer: int = 0) -> list[int]:
    return sorted(e.position for _, es in owed_to(producer, root, ()) for e in es)


# --- the drafter's journal: each line checks itself, a segment is a set, a line may not contradict its checkpoint --


def test_a_digit_changed_in_a_journal_line_is_damage_named_never_another_batch(tmp_path, caplog):
    """The issue's case: one digit of a line changed (the line still JSON, its numbers still numbers) named
    another batch: that one trained twice, the line's own batch lost, and no word. Its checksum no longer fits."""
    d = _two_segments(tmp_path)
    path = _segment(d, 4)
    path.write_bytes(path.read_bytes().replace(b'"q":4', b'"q":1'))
    with caplog.at_level(logging.WARNING):
        assert seal(d, 4, ring=3, in_ring=()) == 2
    assert _owed_positions(tmp_path) == [3, 5]  # never batch 1, which the checkpoint of step 4 holds
    assert "1 journal line(s) unreadable (line 2)" in caplog.text and "may be missing" in caplog.text
    assert len(asides(path)) == 1


def test_a_repeated_journal_line_changes_nothing(tmp_path, caplog):
    d = _two_segments(tmp_path)
    path = _segment(d, 4)
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines + [lines[1], lines[1]]))
    with caplog.at_level(logging.WARNING):
        assert seal(d, 4, ring=3, in_ring=()) == 3
    assert _owed_positions(tmp_path) == [3, 4, 5]
    assert "2 line(s) repeat" in caplog.text


def test_a_journal_line_naming_a_batch_the_checkpoint_holds_is_named_not_produced_again(tmp_path, caplog):
    """A line of the segment before the checkpoint of step 4 (its batch in that checkpoint) copied into the segment
    after it: produced again, it trained twice. Each line says the step its update went into."""
    d = _two_segments(tmp_path)
    held = _segment(d, 0).read_bytes().splitlines(keepends=True)[1]  # batch 1, trained into step 2
    after = _segment(d, 4)
    after.write_bytes(after.read_bytes() + held)
    with caplog.at_level(logging.WARNING):
        assert seal(d, 4, ring=3, in_ring=()) == 3
    assert _owed_positions(tmp_path) == [3, 4, 5]
    assert "already holds" in caplog.text and len(asides(after)) == 1


def _sealed(root: Path) -> Path:
    d = _two_segments(root)
    assert seal(d, 4, ring=3, in_ring=()) == 3
    (lost,) = lost_segments(root)
    return lost.path


def _valid_line(root: Path, q: int, step: int) -> bytes:
    """A line exactly as a drafter writes it, for batch (0, 0, q): valid in every way but where it is put."""
    j = Journal(root / "elsewhere", ring=3, after_step=4)
    j.append(_meta(0, 0, q), item=40 + q, step=step)
    j.close()
    (path,) = (root / "elsewhere").iterdir()
    return path.read_bytes()


@pytest.mark.parametrize("where", ["inside", "after"])
def test_a_valid_line_added_to_a_sealed_segment_is_named_not_produced(tmp_path, caplog, where):
    """The issue's case: a well-formed in-plan line added to a lost segment was produced again (its batch trained
    twice). A sealed segment ends in a seal line that counts its entries and digests them as a set."""
    path = _sealed(tmp_path)
    lines = path.read_bytes().splitlines(keepends=True)
    added = _valid_line(tmp_path, 1, step=6)
    lines.insert(1 if where == "inside" else len(lines), added)
    path.write_bytes(b"".join(lines))
    with caplog.at_level(logging.WARNING):
        assert _owed_positions(tmp_path) == [3, 4, 5]
    assert "added after" in caplog.text and len(asides(path)) == 1
    assert _owed_positions(tmp_path) == [3, 4, 5] and len(asides(path)) == 1  # rebuilt: read again, clean


def test_a_line_removed_from_a_sealed_segment_is_named(tmp_path, caplog):
    path = _sealed(tmp_path)
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:1] + lines[2:]))
    with caplog.at_level(logging.WARNING):
        assert _owed_positions(tmp_path) == [3, 5]
    assert "removed since it was sealed" in caplog.text and len(asides(path)) == 1


def test_a_journal_written_before_checksums_is_still_read(tmp_path, caplog):
    """A fleet restarting a drafter mid-run onto this version: the segments its predecessors wrote have lines
    without a checksum or a step, and a sealed one no seal line. They are read as they were (nothing to check them
    against); a line without a checksum among lines that have one is damage."""
    d = journal_dir(tmp_path, 0)
    d.mkdir(parents=True)
    old = b"".join(b'{"p":0,"e":0,"q":%d,"i":%d}\n' % (q, q) for q in range(3))
    (d / "open-00000004-11-3.jsonl").write_bytes(old)
    (d / "lost-00000002-12-3.jsonl").write_bytes(b'{"p":0,"e":1,"q":0,"i":9}\n')
    with caplog.at_level(logging.WARNING):
        assert seal(d, 4, ring=3, in_ring=()) == 3
        assert _owed_positions(tmp_path) == [0, 0, 1, 2]
    assert not list(d.glob(f"*{SUFFIX}*")), caplog.text
    mixed = _segment(_two_segments(tmp_path / "b"), 4)
    mixed.write_bytes(mixed.read_bytes() + b'{"p":0,"e":0,"q":1,"i":1}\n')
    assert [e.position for e in read_entries(mixed)] == [3, 4, 5] and len(asides(mixed)) == 1


# --- across records: what a producer takes from sealed segments --------------------------------------------------


def _in_plan(epoch: int, position: int) -> bool:
    return epoch == 0 and 0 <= position < 10


def _lost(root: Path, name: str, positions: list[int], after: int = 4) -> None:
    """A sealed segment, written the way `seal` writes one."""
    tmp = root / f"src-{name}"
    j = Journal(journal_dir(tmp, 0), ring=3, after_step=after)
    for q in positions:
        j.append(_meta(0, 0, q), item=q, step=after + 1)
    j.close()
    seal(journal_dir(tmp, 0), after, ring=3, in_ring=())
    (s,) = lost_segments(tmp)
    d = journal_dir(root, 0)
    d.mkdir(parents=True, exist_ok=True)
    s.path.rename(d / s.path.name.replace(f"-{s.pid}-", f"-{name}-"))


def test_a_batch_owed_twice_at_once_or_not_yet_published_is_produced_once_or_not_at_all(tmp_path, caplog):
    """Two sealed segments not yet taken cannot both have lost one batch (it would have had to be produced again in
    between), a batch still pending in the replay list cannot have been lost again, and a batch at or past the
    producer's cursor was never published: each contradiction is named; none makes a batch train twice."""
    _lost(tmp_path, "21", [1, 2])
    _lost(tmp_path, "22", [2, 3, 7])
    cursor = CursorFile(tmp_path / "producer-0.json", "plan")
    start = ResumeState(0, 6, replay=((0, 3),), replayed=0)
    cursor.save(start)
    live = LiveReplay(0, start, cursor, tmp_path, _in_plan)
    with caplog.at_level(logging.ERROR):
        assert live.poll(force=True) == 2
    assert live.entries_from(0) == [(0, 3), (0, 1), (0, 2)]
    assert "epoch 0 position 7" in caplog.text and "not yet published" in caplog.text
    assert "already owed" in caplog.text
    assert cursor.load().replay == ((0, 3), (0, 1), (0, 2))


# --- the producer's cursor file ----------------------------------------------------------------------------------


def test_a_digit_changed_in_a_cursor_file_is_refused_in_one_line(tmp_path):
    cursor = CursorFile(tmp_path / "producer-0.json", "plan")
    cursor.save(ResumeState(1, 17, ((0, 1), (0, 2)), 1, ("drafter-0/lost-00000004-9-1.jsonl",)))
    cursor.path.write_text(cursor.path.read_text().replace('"position": 17', '"position": 19'))
    with pytest.raises(CursorFileError) as e:
        cursor.read()
    assert str(cursor.path) in str(e.value) and "checksum" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("replayed", [-1, 3, 10**12])
def test_a_replayed_count_outside_the_replay_list_is_refused(tmp_path, replayed):
    """-1 published the list's last entry again; a count past the list's end published none of it."""
    cursor = CursorFile(tmp_path / "producer-0.json", "plan")
    cursor.save(ResumeState(0, 5, ((0, 1), (0, 2)), replayed))
    with pytest.raises(CursorFileError, match="replayed"):
        cursor.read()


def test_a_repeated_or_unpublished_replay_entry_is_produced_once_or_not_at_all(tmp_path, caplog):
    cursor = CursorFile(tmp_path / "producer-0.json", "plan")
    start = ResumeState(0, 5, replay=((0, 1), (0, 2), (0, 2), (0, 1), (0, 8)), replayed=1)
    cursor.save(start)
    with caplog.at_level(logging.WARNING):
        live = LiveReplay(0, start, cursor, tmp_path, _in_plan)
    # (0, 1) once published and owed again is not a repeat; (0, 2) twice is; (0, 8) is past the cursor.
    assert live.entries_from(1) == [(0, 2), (0, 1)]
    assert cursor.load().replay == ((0, 1), (0, 2), (0, 1)) and len(asides(cursor.path)) == 1
    assert "repeat" in caplog.text and "epoch 0 position 8" in caplog.text


@pytest.mark.parametrize(
    "epoch, position, says",
    [(10**9, 0, "epoch 1000000000"), (0, 10**12, "position 1000000000000"), (2, 1, "epoch 2 position 1")],
)
def test_a_resume_point_outside_the_plan_is_refused_in_one_line(epoch, position, says):
    """A huge epoch lost the rest of the shard in silence; a huge position was a traceback at every start."""
    from dflash_ring.producer.resume import ResumePointError, check_resume_point

    check_resume_point(ResumeState(2, 0), [5, 7], "cursor file x.json")  # the shard's end: nothing left
    check_resume_point(ResumeState(1, 7), [5, 7], "cursor file x.json")
    with pytest.raises(ResumePointError) as e:
        check_resume_point(ResumeState(epoch, position), [5, 7], "cursor file x.json")
    assert says in str(e.value) and "x.json" in str(e.value) and "\n" not in str(e.value)


# --- the tokenized-data cache ------------------------------------------------------------------------------------

ROWS = [
    {"prompt": "explain speculative decoding", "response": "a drafter guesses, the target checks"},
    {"prompt": "what is the capital of France?", "response": "Paris, of course"},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_chat_tokenizer(tmp_path_factory.mktemp("tok"))


def _tokenized(tokenizer, tmp_path: Path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = DataConfig(path=str(path), cache_dir=str(tmp_path / "cache"))
    return cfg, load_tokenized(cfg, tokenizer)


def _set_token(directory: Path, value: int, old_meta: bool) -> None:
    tokens = np.load(directory / "tokens.npy")
    tokens[3] = value
    np.save(directory / "tokens.npy", tokens)
    if old_meta:  # as a version before checksums wrote it: nothing to check the arrays against
        meta = json.loads((directory / "meta.json").read_text())
        meta.pop("digests", None)
        (directory / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "value, old_meta", [("other", False), ("vocab", False), ("vocab", True), (-1, True), (2**31 - 1, True)]
)
def test_a_changed_token_in_the_tokenized_cache_is_kept_aside_and_tokenized_again(
    tokenizer, tmp_path, caplog, value, old_meta
):
    """An altered token was trained on in silence; one outside the vocabulary (or negative) was an IndexError
    traceback at every start. The entry carries its arrays' digests; one without them (an earlier version's) is
    held to the vocabulary."""
    cfg, first = _tokenized(tokenizer, tmp_path)
    want = np.asarray(first.tokens).tolist()
    if value == "other":
        value = (want[3] + 1) % len(tokenizer)
    elif value == "vocab":
        value = len(tokenizer)
    _set_token(first.directory, value, old_meta)
    with caplog.at_level(logging.WARNING):
        again = load_tokenized(cfg, tokenizer)
    assert not again.from_cache and np.asarray(again.tokens).tolist() == want
    assert len(list((tmp_path / "cache").glob("tokenized-*.damaged-*"))) == 1, caplog.text
    assert load_tokenized(cfg, tokenizer).from_cache


def test_a_tokenized_cache_of_an_earlier_version_is_reused_and_given_its_digests(tokenizer, tmp_path):
    cfg, first = _tokenized(tokenizer, tmp_path)
    meta = json.loads((first.directory / "meta.json").read_text())
    assert meta.pop("digests")
    (first.directory / "meta.json").write_text(json.dumps(meta))
    assert load_tokenized(cfg, tokenizer).from_cache
    assert "digests" in json.loads((first.directory / "meta.json").read_text())
    _set_token(first.directory, (int(first.tokens[3]) + 1) % len(tokenizer), old_meta=False)
    assert not load_tokenized(cfg, tokenizer).from_cache  # now checked


# --- a restarted role or a standby with the run's settings, or none --------------------------------------------


@pytest.mark.parametrize(
    "key, value, says",
    [
        ("train.checkpoint_dir", '"other-checkpoints"', "train.checkpoint_dir: ring has '"),
        ("train.lr", "0.1", "train.lr: ring has 0.0006, this process has 0.1"),
        ("train.grad_clip", "0.5", "train.grad_clip: ring has 1.0, this process has 0.5"),
        ("train.betas", "[0.8, 0.9]", "train.betas: ring has [0.9, 0.95], this process has [0.8, 0.9]"),
        ("train.weight_decay", "0.1", "train.weight_decay: ring has 0.0, this process has 0.1"),
        ("train.total_steps", "500", "train.total_steps: ring has 0, this process has 500"),
        ("train.warmup_ratio", "0.5", "train.warmup_ratio: ring has 0.04, this process has 0.5"),
    ],
)
def test_a_process_with_another_checkpoint_dir_optimizer_or_schedule_is_refused_at_attach(run, key, value, says):
    """The issue's standby with another train.checkpoint_dir took over a dead drafter's seat and started from step 0
    in its own directory (30 batches in no surviving model); one with another lr trained on with it. What exactly
    once and training depend on is in the ring's fingerprint: refused at attach, naming both values."""
    run.write_config(1, 2)
    same = load_config(run.config, ["train.betas=[0.9, 0.95]"])  # the default written out: the same settings
    with Ring.create(ring_spec(load_config(run.config))) as ring:
        Ring.attach(ring_spec(same), timeout_s=0).close()
        with pytest.raises(ConfigMismatchError) as e:
            Ring.attach(ring_spec(load_config(run.config, [f"{key}={value}"])), timeout_s=0)
        msg = str(e.value)
        assert says in msg and "\n" not in msg, msg
        if key == "train.checkpoint_dir":
            assert "other-checkpoints" in msg
        del ring


# --- the fuzzer: journals edited between kills, read back -----------------------------------------------------------


def _fuzzed_journal(root: Path) -> tuple[Path, dict[tuple[int, int, int], int]]:
    """A dead drafter's journal: a segment before the checkpoint of step 4 (its batches held by it) and one after;
    returns the journal's directory and the batches the segment after it truly lost, with their step."""
    j = Journal(journal_dir(root, 0), ring=3, after_step=0)
    for q in range(4):
        j.append(_meta(q % 2, 0, q), item=q, step=q + 1)
    j.rotate(4)
    lost = {}
    for q in range(4, 10):
        j.append(_meta(q % 2, q // 8, q), item=q, step=q + 1)
        lost[(q % 2, q // 8, q)] = q + 1
    j.close()
    return journal_dir(root, 0), lost


# What can be done to each kind of segment and still be told from what its writer wrote. A line dropped from an open
# segment cannot (it is the line a kill before the write never wrote): a sealed segment's seal line counts them.
EDITS = {
    "open": ["flip", "digit", "repeat", "move", "held", "cut"],
    "lost": ["flip", "digit", "repeat", "move", "held", "cut", "drop"],
}


@st.composite
def edits(draw, lines: list[bytes], held: list[bytes], kinds: list[str]) -> list[bytes]:
    """`lines` with one to four edits: a byte flipped, a digit changed, a line repeated, moved or dropped, a line
    of the segment before the checkpoint (a batch the checkpoint holds) added, a line cut short."""
    out = list(lines)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(kinds))
        if not out or kind == "held":
            out.insert(draw(st.integers(0, len(out))), draw(st.sampled_from(held)))
            continue
        i = draw(st.integers(0, len(out) - 1))
        line = bytearray(out[i])
        if kind == "flip":
            line[draw(st.integers(0, len(line) - 1))] ^= draw(st.integers(1, 255))
            out[i] = bytes(line)
        elif kind == "digit" and (digits := [k for k, c in enumerate(line) if chr(c).isdigit()]):
            k = draw(st.sampled_from(digits))
            line[k] = ord(str((int(chr(line[k])) + draw(st.integers(1, 9))) % 10))
            out[i] = bytes(line)
        elif kind == "repeat":
            out.insert(draw(st.integers(0, len(out))), out[i])
        elif kind == "move":
            out.insert(draw(st.integers(0, len(out) - 1)), out.pop(i))
        elif kind == "drop":
            del out[i]
        elif kind == "cut" and len(line) > 1:  # the line loses its end (and its newline): it runs into the next
            out[i] = bytes(line[: draw(st.integers(1, len(line) - 1))])
    return out


@FUZZ
@given(st.data(), st.sampled_from(["open", "lost"]))
def test_fuzzed_journals_never_make_a_batch_train_twice_or_vanish_in_silence(data, which):
    """Whatever the edits, what the producers are owed is a set of batches the segment truly lost (none the
    checkpoint holds, none twice, none made up by a changed digit), and every lost batch left out is named: a
    warning, with the edited file kept aside."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        d, lost = _fuzzed_journal(root)
        held = _segment(d, 0).read_bytes().splitlines(keepends=True)
        if which == "lost":
            seal(d, 4, ring=3, in_ring=())
            path = lost_segments(root)[0].path
        else:
            path = _segment(d, 4)
        edited = b"".join(data.draw(edits(path.read_bytes().splitlines(keepends=True), held, EDITS[which])))
        path.write_bytes(edited)
        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append  # type: ignore[method-assign]
        logging.getLogger("dflash_ring").addHandler(handler)
        try:
            if which == "open":
                seal(d, 4, ring=3, in_ring=())
            owed = [(e.producer, e.epoch, e.position) for p in (0, 1) for _, es in owed_to(p, root, ()) for e in es]
        finally:
            logging.getLogger("dflash_ring").removeHandler(handler)
        assert len(owed) == len(set(owed)), f"a batch owed twice: {owed}"
        assert set(owed) <= set(lost), f"owed a batch the segment did not lose: {set(owed) - set(lost)}"
        if missing := set(lost) - set(owed):
            warned = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
            assert any("damaged file" in m for m in warned), f"{missing} left out in silence"
            (lost_now,) = lost_segments(root)
            assert asides(lost_now.path) or asides(path), "left out without the edited file kept aside"


def _dead_pid_journal(root: Path, pid: int) -> dict[tuple[int, int, int], int]:
    """Drafter 0's journal as a dead process `pid` left it (segments after the checkpoints of steps 0 and 4), and an
    earlier dead drafter's sealed segment under drafter 1; returns the batches truly lost (owed once each)."""
    d, lost = _fuzzed_journal(root / "made")
    target = journal_dir(root, 0)
    target.mkdir(parents=True)
    for s in segments(d):
        s.path.rename(target / s.path.name.replace(f"-{s.pid}-", f"-{pid}-"))
    _lost(root / "one", "77", [20, 21])
    (earlier,) = lost_segments(root / "one")
    journal_dir(root, 1).mkdir(parents=True)
    earlier.path.rename(journal_dir(root, 1) / earlier.path.name)
    return {**lost, (0, 0, 20): 5, (0, 0, 21): 5}


@pytest.mark.parametrize("seed", range(12))
def test_the_chaos_runs_journal_edits_make_no_batch_train_twice_or_vanish(tmp_path, seed):
    """tools/journal_edits.py, as `chaos` runs it after each drafter SIGKILL (here without the run): whatever it
    edits, every batch truly lost is owed exactly once, and nothing else."""
    from dflash_ring.tools.journal_edits import edit_after_kill

    lost = _dead_pid_journal(tmp_path, pid=999_999_999)
    rng, edited = random.Random(seed), set()
    done = edit_after_kill(tmp_path, 999_999_999, rng, edited)
    assert {e["kind"].split("-")[0] for e in done} == {"open", "sealed"}, done
    seal(journal_dir(tmp_path, 0), 4, ring=3, in_ring=())
    done += edit_after_kill(tmp_path, 999_999_999, rng, edited)  # the segment sealed just now
    owed = [(e.producer, e.epoch, e.position) for p in (0, 1) for _, es in owed_to(p, tmp_path, ()) for e in es]
    assert sorted(owed) == sorted(lost), done
