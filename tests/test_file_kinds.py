"""One rule for the kind of a file read back (common/bounded_read.py): opened without blocking, it must be a regular
file, read with a size cap; else a role's own file is kept aside (the damaged-file rule) and a user's file is refused
in one line naming it. Each case puts a FIFO, a directory, a symlink loop or a device where a role, the reaper,
`clean` or a tool reads a file back: before the rule a FIFO blocked its reader forever (here: released after a few
seconds and failed), a directory or a loop was a traceback, a device was read without end.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path

import pytest

from dflash_ring.common.bounded_read import read_bytes, read_own
from dflash_ring.common.damaged_file import SUFFIX
from dflash_ring.common.refusal import Refusal

BLOCKED_S = 5.0


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _directory(path: Path) -> None:
    path.mkdir()


def _loop(path: Path) -> None:
    os.symlink(path.name, path)  # a link to itself: ELOOP on open


KINDS = {"fifo": _fifo, "directory": _directory, "symlink-loop": _loop}


def _release_fifos(root: Path) -> None:
    """Open every FIFO under root for writing and close it: a reader blocked in open() then reads end of file."""
    for p in root.rglob("*"):
        with contextlib.suppress(OSError):
            if p.is_fifo():
                os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))


def within(root: Path, fn, *args, **kwargs):
    """fn(*args, **kwargs), which must return (or raise) within BLOCKED_S: a reader blocked on a FIFO under root
    is released (so the suite goes on) and the test fails."""
    out: dict = {}

    def call():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 (re-raised in the test's thread)
            out["error"] = e

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(BLOCKED_S)
    if t.is_alive():
        for _ in range(20):
            _release_fifos(root)
            t.join(0.25)
            if not t.is_alive():
                break
        pytest.fail(f"{getattr(fn, '__name__', fn)} blocked on a file of the wrong kind under {root}")
    if "error" in out:
        raise out["error"]
    return out["value"]


def kept_aside(path: Path) -> bool:
    return not os.path.lexists(path) and any(p.name.startswith(path.name + SUFFIX) for p in path.parent.iterdir())


def one_line_refusal(e: BaseException, path: Path) -> None:
    """What cli.main prints as the command's one error line (a Refusal, or a tool's RuntimeError), naming the file."""
    assert isinstance(e, (Refusal, RuntimeError)), f"{type(e).__name__}: {e}"
    assert "\n" not in str(e) and str(path) in str(e)


class _Refused(Refusal):
    pass


# ---------------------------------------------------------------------------------------------------------------------
# The helper itself.


@pytest.mark.parametrize("kind", KINDS)
def test_read_bytes_refuses_every_kind_but_a_regular_file_in_one_line(tmp_path, kind):
    path = tmp_path / "f"
    KINDS[kind](path)
    with pytest.raises(_Refused) as e:
        within(tmp_path, read_bytes, path, 100, _Refused, "some file")
    one_line_refusal(e.value, path)
    with pytest.raises(_Refused, match="is a device"):
        read_bytes("/dev/null", 100, _Refused, "some file")
    with pytest.raises(FileNotFoundError):  # a missing file stays what its callers expect
        read_bytes(tmp_path / "missing", 100, _Refused, "some file")


@pytest.mark.parametrize("kind", KINDS)
def test_read_own_keeps_a_file_of_the_wrong_kind_aside(tmp_path, kind):
    path = tmp_path / "own"
    KINDS[kind](path)
    assert within(tmp_path, read_own, path, 100, "own file") is None
    assert kept_aside(path)
    assert read_own(tmp_path / "missing", 100, "own file") is None
    big = tmp_path / "big"
    big.write_bytes(b"x" * 101)
    assert read_own(big, 100, "own file") is None and kept_aside(big)


# ---------------------------------------------------------------------------------------------------------------------
# What a role wrote itself: kept aside, the reader goes on.


@pytest.mark.parametrize("kind", KINDS)
def test_the_reaper_seals_past_an_open_segment_of_the_wrong_kind(tmp_path, kind):
    from dflash_ring.common.lifecycle.trained_journal import Journal, journal_dir, seal_drafter

    d = journal_dir(tmp_path, 0)
    Journal(d, ring=7, after_step=0).append({"producer": 0, "epoch": 0, "position": 1}, item=1)
    bad = d / f"open-00000000-{os.getpid() + 1}-7.jsonl"  # another (dead) drafter's segment
    KINDS[kind](bad)
    within(tmp_path, seal_drafter, tmp_path, 0, 7, [])
    assert kept_aside(bad)


@pytest.mark.parametrize("kind", KINDS)
def test_a_lost_segment_of_the_wrong_kind_is_kept_aside_and_owes_nothing(tmp_path, kind):
    from dflash_ring.common.lifecycle.trained_journal import journal_dir, owed_to

    d = journal_dir(tmp_path, 0)
    d.mkdir(parents=True)
    (d / "lost-00000000-11-7.jsonl").write_bytes(b'{"p":0,"e":0,"q":3,"i":3}\n')
    bad = d / "lost-00000000-12-7.jsonl"
    KINDS[kind](bad)
    owed = within(tmp_path, owed_to, 0, tmp_path, [])
    assert [k for k, _ in owed] == ["drafter-0/lost-00000000-11-7.jsonl"]
    assert kept_aside(bad)


@pytest.mark.parametrize("kind", KINDS)
def test_a_latest_pointer_of_the_wrong_kind_is_kept_aside_and_the_newest_checkpoint_taken(tmp_path, kind):
    from dflash_ring.common.lifecycle.checkpoint_choice import resume_step

    for step in (4, 8):
        (tmp_path / f"step-{step:08d}").mkdir()
    KINDS[kind](tmp_path / "latest")
    assert within(tmp_path, resume_step, tmp_path) == 8
    assert kept_aside(tmp_path / "latest")


@pytest.mark.parametrize("kind", KINDS)
def test_a_head_cache_of_the_wrong_kind_is_probed_again(tmp_path, kind):
    from dflash_ring.consumer.modeling.head_cache import cached_spec

    cache = tmp_path / "target-head.json"
    KINDS[kind](cache)
    assert within(tmp_path, cached_spec, cache, "key", untied_head=False) is None
    assert kept_aside(cache)


@pytest.mark.parametrize("kind", KINDS)
def test_a_record_file_of_the_wrong_kind_is_kept_aside_by_its_drafter_and_refused_by_the_report(tmp_path, kind):
    from dflash_ring.consumer.reporting.tracking import RecordFile, read_records

    path = tmp_path / "drafter-0.jsonl"
    KINDS[kind](path)
    with pytest.raises((Refusal, RuntimeError)) as e:
        within(tmp_path, read_records, path)
    one_line_refusal(e.value, path)
    record = within(tmp_path, RecordFile, path, {"series": "config"})
    record.write(1, "train", {"loss": 1.0})
    record.close()
    assert list(tmp_path.glob(f"drafter-0.jsonl{SUFFIX}*"))  # kept aside, then written again
    assert json.loads(path.read_text().splitlines()[1])["step"] == 1


# ---------------------------------------------------------------------------------------------------------------------
# What a user gave: refused in one line naming it.


def _target_config(tmp_path: Path, kind: str) -> Path:
    target = tmp_path / "target"
    target.mkdir()
    file = target / "config.json"
    if kind == "device":
        os.symlink("/dev/null", file)  # /dev/zero behaves the same here, but never ends without the rule
    elif kind == "huge":
        with open(file, "wb") as f:  # sparse: a config.json past the cap costs no disk
            f.truncate(16 << 20)
    else:
        KINDS[kind](file)
    return file


@pytest.mark.parametrize("kind", [*KINDS, "device", "huge"])
def test_a_target_config_json_of_the_wrong_kind_or_size_is_refused_naming_it(tmp_path, kind):
    from dflash_ring.common.config.target import TargetConfig
    from dflash_ring.common.target_geometry import read_model_config

    file = _target_config(tmp_path, kind)
    with pytest.raises(Refusal) as e:
        within(tmp_path, read_model_config, TargetConfig(path=str(file.parent)))
    one_line_refusal(e.value, file)
    assert any(w in str(e.value) for w in ("not a regular file", "larger than"))


@pytest.mark.parametrize("kind", [*KINDS, "device"])
def test_a_safetensors_file_of_the_wrong_kind_is_refused_naming_it(tmp_path, kind):
    from dflash_ring.common.safetensors_check import check_safetensors_file

    path = tmp_path / "model.safetensors"
    if kind == "device":
        os.symlink("/dev/zero", path)
    else:
        KINDS[kind](path)
    with pytest.raises(Refusal) as e:
        within(tmp_path, check_safetensors_file, path)
    one_line_refusal(e.value, path)
    assert "not a regular file" in str(e.value)


@pytest.mark.parametrize("kind", KINDS)
def test_an_exports_config_json_of_the_wrong_kind_is_refused_naming_it(tmp_path, kind):
    from dflash_ring.consumer.layouts.export import load_drafter

    export = tmp_path / "export"
    export.mkdir()
    KINDS[kind](export / "config.json")
    with pytest.raises(Refusal) as e:
        within(tmp_path, load_drafter, export)
    one_line_refusal(e.value, export / "config.json")


def test_a_group_secret_file_past_its_cap_is_refused_unread(tmp_path):
    from dflash_ring.common.ownership import group_secret

    secret = tmp_path / "secret"
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, os.urandom(32))
    os.ftruncate(fd, 4 << 20)  # sparse: 4 GB reads the same way, and was read whole
    os.close(fd)
    with pytest.raises(Refusal, match="larger than") as e:
        group_secret(str(secret))
    one_line_refusal(e.value, secret)


@pytest.mark.parametrize("kind", KINDS)
def test_an_eval_json_of_the_wrong_kind_is_refused_by_the_report(tmp_path, kind):
    from dflash_ring.tools.report import ReportError, calibration_of

    path = tmp_path / "eval.json"
    KINDS[kind](path)
    with pytest.raises(ReportError) as e:
        within(tmp_path, calibration_of, path)
    one_line_refusal(e.value, path)


@pytest.mark.parametrize("name", ["model.safetensors", "model.safetensors.index.json"])
@pytest.mark.parametrize("kind", [*KINDS, "device"])
def test_a_targets_weights_of_the_wrong_kind_are_refused_not_passed_over(tmp_path, kind, name):
    """check-config read a FIFO's or a directory's place as "no weights" and said OK; every role then blocked in
    transformers' load on the FIFO. Now the weights' reader names it (check_target_builds and the head read both go
    through weight_shapes / weight_files)."""
    from dflash_ring.common.safetensors_check import weight_files, weight_shapes

    path = tmp_path / name
    if kind == "device":
        os.symlink("/dev/zero", path)
    else:
        KINDS[kind](path)
    for read in (weight_shapes, weight_files):
        with pytest.raises(Refusal) as e:
            within(tmp_path, read, tmp_path)
        one_line_refusal(e.value, path)


def test_clean_removes_a_dead_run_past_journal_files_of_the_wrong_kind(tmp_path):
    """`dflash-ring clean` seals every drafter's journal against its `latest` checkpoint before the ring goes: a FIFO
    segment or pointer blocked it in open() and the ring stayed. Now each is kept aside and the ring removed."""
    from dflash_ring.common.config.load import load_config
    from dflash_ring.common.lifecycle.trained_journal import journal_dir
    from dflash_ring.common.ring import Ring
    from dflash_ring.common.ring_spec import ring_spec
    from dflash_ring.supervisor.cleanup import clean

    run = f"kinds-{os.getpid()}"
    cfg = load_config(None, [f"run.name={run}", "ring.slots=1", "ring.slot_bytes=8192", "ring.slot_header_bytes=4096"])
    Ring.unlink(run)
    Ring.create(ring_spec(cfg)).close()
    checkpoints = tmp_path / "checkpoints"
    d = journal_dir(checkpoints, 0)
    d.mkdir(parents=True)
    (checkpoints / "drafter-0" / "step-00000004").mkdir()
    os.mkfifo(checkpoints / "drafter-0" / "latest")
    os.mkfifo(d / "open-00000004-999999-1.jsonl")
    try:
        removed = within(tmp_path, clean, run, tmp_path / "locks", str(tmp_path / "state"), str(checkpoints))
    finally:
        Ring.unlink(run)
    assert removed and not Ring.exists(run)
    assert kept_aside(checkpoints / "drafter-0" / "latest") and kept_aside(d / "open-00000004-999999-1.jsonl")


@pytest.mark.parametrize("kind", KINDS)
def test_a_lock_file_of_the_wrong_kind_is_kept_aside_and_the_lock_taken(tmp_path, kind):
    """The reaper, a role's start and `clean` take lock files: a directory or a symlink loop in one's place was an
    [Errno 21] / [Errno 40] that stopped the supervisor (and every restart of it); a FIFO, no lock at all."""
    from dflash_ring.common.lifecycle.liveness import LockFile, is_alive

    path = tmp_path / "drafter-0.lock"
    KINDS[kind](path)
    assert within(tmp_path, is_alive, path) is False and kept_aside(path)
    KINDS[kind](path)
    lock = within(tmp_path, LockFile.try_acquire, path)
    assert lock is not None and path.is_file() and not path.is_symlink()
    lock.release(unlink=True)
