"""The warm standby (`dflash-ring drafter --standby`, common/lifecycle/seat.py) through real processes and real
SIGKILLs.

A standby builds its drafter and attaches, then waits; it takes over a drafter whose process died, never one that
has not started or that stopped cleanly, and it exits 0 at the run's end when nothing died. Its takeover is a
restart's: the dead holder's journal sealed, its slots redelivered, so `reconcile` finds every batch trained exactly
once. A drafter started for an index whose seat a live process holds (its former standby) waits as its standby,
past run.attach_timeout_s, instead of failing into a restart loop.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from dflash_ring.common.layout import Counter
from dflash_ring.common.ring import Ring, RingNotFound
from dflash_ring.tools.reconcile import read_ledgers, reconcile

from support import Run, build_target, merged, pipeline_settings, wait_exit, wait_for, write_chat_rows

WAITING = "drafter standby for 0: built, ring attached, waiting"


def _config(run: Run, epochs: int) -> None:
    target = build_target(run.tmp / "target", "qwen3", layers=4, hidden=32)
    data = write_chat_rows(run.tmp / "chat.jsonl", 40)
    run.write_config(
        1,
        1,
        8,
        4 << 20,
        **merged(
            pipeline_settings(run.tmp, target, data),
            {
                "run": {"ledger_dir": str(run.tmp / "ledger")},
                "data": {"epochs": epochs},
                "train": {"checkpoint_every_steps": 3, "average_every_steps": 0},
            },
        ),
    )


def _log(run: Run, proc) -> str:
    return Path(run.tmp / f"proc-{run.procs.index(proc)}.stderr").read_text()


def _standby(run: Run):
    return run.spawn("-m", "dflash_ring", "drafter", "--config", str(run.config), "--standby")


def _starts(run: Run) -> list[dict]:
    ledgers = read_ledgers(run.tmp / "ledger")[0] if (run.tmp / "ledger").is_dir() else {}
    return [r for r in ledgers.get("drafter-0", []) if r["ev"] == "start"]


def _exactly_once(run: Run) -> dict:
    ledgers = read_ledgers(run.tmp / "ledger")[0]
    rec = reconcile(ledgers)
    assert rec["problems"] == [], rec["problems"]
    assert rec["trained_exactly_once"] == rec["planned_batches"] > 0, rec
    assert rec["trained_then_lost_with_crash"] == 0, rec
    return ledgers


def test_a_standby_takes_over_a_killed_drafter_and_every_batch_trains_exactly_once(run, monkeypatch):
    _config(run, epochs=3)
    procs = [run.supervisor(), run.role("target", 0)]
    # Two standbys before any drafter: drafter 0's row is EMPTY, so neither may take it.
    standbys = [_standby(run), _standby(run)]
    for s in standbys:
        wait_for(lambda s=s: WAITING in _log(run, s) or s.poll() is not None, timeout=300, what="a standby waiting")
        assert s.poll() is None, _log(run, s)[-3000:]
    # Drafter 0 SIGKILLs itself after its fifth step, between the step's ledger record and the slot's release.
    monkeypatch.setenv("DFLASH_RING_CRASH_AT", "trained@5")
    first = run.role("drafter", 0)
    monkeypatch.delenv("DFLASH_RING_CRASH_AT")
    assert wait_exit(first, 300) == -signal.SIGKILL, _log(run, first)[-3000:]
    for p in (*procs, *standbys):
        assert wait_exit(p, 300) == 0, _log(run, p)[-3000:]

    # The first start is the drafter's own (no standby took the index before it came), the second a standby's,
    # which names the pid it took over from; the other standby never started anything.
    starts = _starts(run)
    assert [r["pid"] for r in starts][:1] == [first.pid] and "took_over" not in starts[0], starts
    assert len(starts) == 2 and starts[1]["took_over"] == first.pid, starts
    (taker,) = [s for s in standbys if s.pid == starts[1]["pid"]]
    (idle,) = [s for s in standbys if s is not taker]
    assert f"standby (pid {taker.pid}) takes over drafter 0, whose holder (pid {first.pid}) died" in _log(run, taker)
    assert "drafter standby: the run ended before anything died" in _log(run, idle)
    ledgers = _exactly_once(run)
    trainers = {r["pid"] for r in ledgers["drafter-0"] if r["ev"] == "train"}
    assert trainers == {first.pid, taker.pid}  # the idle standby trained nothing
    assert run.leftovers() == []


def test_a_drafter_whose_seat_a_live_process_holds_waits_as_its_standby_past_the_attach_timeout(run):
    _config(run, epochs=2)
    procs = [run.supervisor()]
    holder = run.role("drafter", 0)  # no target yet: nothing is produced, so the run cannot end under the test
    wait_for(lambda: _starts(run), timeout=300, what="drafter 0 to join")
    # As systemd restarts the unit of a drafter whose standby took over: same index, its seat held by a live process
    # (which also serves the index's metrics port). It used to fail after run.attach_timeout_s (or at once, on the
    # port), and systemd restarted it into the same failure.
    waiter = run.role("drafter", 0, "--set", "run.attach_timeout_s=1")
    wait_for(
        lambda: "waiting as its standby" in _log(run, waiter) or waiter.poll() is not None,
        timeout=300,
        what="the second drafter 0 to wait",
    )
    time.sleep(2)  # twice the bound the wait used to have
    assert waiter.poll() is None, _log(run, waiter)[-3000:]
    holder.kill()
    assert wait_exit(holder) == -signal.SIGKILL
    procs.append(run.role("target", 0))
    for p in (*procs, waiter):
        assert wait_exit(p, 300) == 0, _log(run, p)[-3000:]
    starts = _starts(run)
    assert [(r["pid"], r.get("took_over")) for r in starts] == [(holder.pid, None), (waiter.pid, holder.pid)], starts
    _exactly_once(run)
    assert run.leftovers() == []


def test_a_drafter_waiting_as_a_standby_exits_0_when_its_holder_finishes_the_run(run):
    """The holder runs the run to its end and leaves cleanly: its seat frees in a finished run, which the waiting
    drafter must not take (it once did, and its serve then found the leaver's metrics port still bound: exit 2).
    The waiter and the supervisor are paused so that the waiter looks exactly there: after the shutdown and the
    holder's exit, before the supervisor's teardown (CI met it within one of the waiter's polls)."""
    _config(run, epochs=1)
    sup = run.supervisor()
    holder = run.role("drafter", 0)
    wait_for(lambda: _starts(run), timeout=300, what="drafter 0 to join")
    waiter = run.role("drafter", 0)
    wait_for(
        lambda: "waiting as its standby" in _log(run, waiter) or waiter.poll() is not None,
        timeout=300,
        what="the second drafter 0 to wait",
    )
    waiter.send_signal(signal.SIGSTOP)
    target = run.role("target", 0)
    wait_for(lambda: _shut_down(run.name), timeout=300, what="the shutdown broadcast")
    sup.send_signal(signal.SIGSTOP)  # its teardown waits: the seat frees while the lock directory is there
    assert wait_exit(holder, 300) == 0, _log(run, holder)[-3000:]
    waiter.send_signal(signal.SIGCONT)
    assert wait_exit(waiter, 300) == 0, _log(run, waiter)[-3000:]
    sup.send_signal(signal.SIGCONT)
    for p in (sup, target):
        assert wait_exit(p, 300) == 0, _log(run, p)[-3000:]
    assert "drafter 0: the run ended before its seat freed" in _log(run, waiter)
    assert [r["pid"] for r in _starts(run)] == [holder.pid]  # the waiter never joined
    _exactly_once(run)
    assert run.leftovers() == []


def _shut_down(name: str) -> bool:
    try:
        with Ring.open(name) as ring:
            return ring.counter(Counter.SHUTDOWN) != 0
    except (RingNotFound, OSError):
        return False
