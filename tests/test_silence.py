"""The supervisor names a role that stops answering (issue 46, goal 5): a RUNNING row whose heartbeat has not moved
for supervisor.silent_after_s, with its pid and how long; again every minute while silent; once when it answers or
leaves. The process-level check (a SIGSTOPped drafter named before it is fenced) is in tests/test_whole_run_stop.py."""

from __future__ import annotations

import numpy as np

from dflash_ring.common.layout import ROW_DTYPE, Role, RowStatus
from dflash_ring.supervisor.silence import REPEAT_S, SilenceWatch

S = 1_000_000_000


def rows(*beats: tuple[Role, int, int, int]) -> np.ndarray:
    """Row 0 the supervisor's; then (role, index, pid, heartbeat in s) rows, RUNNING."""
    out = np.zeros(1 + len(beats), dtype=ROW_DTYPE)
    for i, (role, index, pid, beat) in enumerate(beats, start=1):
        out[i]["role"], out[i]["index"], out[i]["pid"] = role, index, pid
        out[i]["status"], out[i]["heartbeat_ns"] = RowStatus.RUNNING, beat * S
    return out


def test_a_silent_row_is_named_once_again_each_minute_and_when_it_answers():
    watch = SilenceWatch(after_s=30)
    table = rows((Role.PRODUCER, 0, 11, 1000), (Role.CONSUMER, 2, 22, 1000))
    assert watch.observe(table, 1029 * S) == []
    table[1]["heartbeat_ns"] = 1030 * S  # the producer beats on; the drafter stops
    (line,) = watch.observe(table, 1031 * S)
    assert line.startswith("drafter 2 (pid 22) has not answered for 31s")
    assert watch.observe(table, 1059 * S) == []  # named once a minute, not every look
    table[1]["heartbeat_ns"] = 1090 * S
    assert watch.observe(table, int((1031 + REPEAT_S) * S))[0].startswith("drafter 2 (pid 22) has not answered for 91s")
    table[2]["heartbeat_ns"] = 1100 * S
    assert watch.observe(table, 1100 * S) == ["drafter 2 (pid 22) answers again"]
    assert watch.observe(table, 1101 * S) == []


def test_rows_that_are_not_running_or_have_never_beaten_are_not_silent_and_a_damaged_role_is_no_crash():
    watch = SilenceWatch(after_s=5)
    table = rows((Role.PRODUCER, 0, 11, 0), (Role.CONSUMER, 0, 22, 100), (Role.CONSUMER, 1, 33, 100))
    table[2]["status"] = RowStatus.DONE
    table[3]["role"] = 77  # a role no process writes
    assert watch.observe(table, 200 * S) == [
        "role 1 (pid 33) has not answered for 100s (no heartbeat; still RUNNING "
        "and alive): stopped, hung or in a very long step; what it holds waits"
    ]
    table[3]["status"] = RowStatus.DEAD
    assert watch.observe(table, 201 * S) == ["role 1 (pid 33) left its row"]
