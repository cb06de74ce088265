"""`stop --now` while a drafter is still working: honest counts, no live lock removed, exit 0."""

from __future__ import annotations

import re

from support import wait_exit, wait_for

from dflash_ring.common.lifecycle.resume_state import CursorFile, cursor_path


def test_stop_now_with_a_busy_drafter_reports_what_was_left_and_exits_zero(run):
    run.write_config(1, 1, slots=3, target={"state_dir": str(run.tmp / "state")})
    # exit_timeout_s shorter than the drafter's item: a live drafter that heartbeats is waited for anyway.
    sup = run.supervisor("--set", "supervisor.exit_timeout_s=1.0")
    producer = run.worker("producer", 0, "--items", "100000", "--ring-cursor")
    consumer = run.worker("consumer", 0, "--work-s", "2.5")
    wait_for(
        lambda: len(run.ledger_lines("C")) >= 1 and len(run.ledger_lines("P")) >= 4,
        timeout=60,
        what="a full ring and a drafter mid-item",
    )
    stop = run.spawn("-m", "dflash_ring", "stop", "--config", str(run.config), "--now", "--timeout", "60")
    assert wait_exit(consumer) == 0 and wait_exit(producer) == 0
    assert wait_exit(stop) == 0, stop.stderr.read()
    assert wait_exit(sup) == 0
    err = sup.stderr.read()
    finished = [ln for ln in err.splitlines() if "finished; removed" in ln]
    assert finished and "consumer-0.lock" not in finished[0], "the supervisor removed the drafter's lock file"
    published, trained = len(run.ledger_lines("P")), len(run.ledger_lines("C"))
    assert "will not be trained" not in err
    # What the ring still held is not dropped: it is the producer's replay list, produced first next time.
    left = re.search(r"the ring held (\d+) untrained item\(s\)", err)
    assert left and int(left.group(1)) == published - trained >= 1, (published, trained, err)
    saved = CursorFile(cursor_path(run.tmp / "state", run.name, 0), plan="").read()
    assert saved is not None
    untrained = sorted({int(p[2]) for p in run.ledger_lines("P")} - {int(c[3]) for c in run.ledger_lines("C")})
    assert [pos for _, pos in saved[2].replay] == untrained and saved[2].replayed == 0
    assert (saved[2].epoch, saved[2].position) == (0, published)  # the plan goes on after the last published
    assert run.leftovers() == []


def test_a_straggler_fenced_at_stop_now_ends_the_supervisor_with_its_own_success_code(run):
    """A drafter SIGSTOPped mid-run, then `stop --now`: the supervisor gives up on it after exit_timeout_s, fences it
    (SIGKILL through its lock), tears the run down and exits EXIT_FENCED (3), the code the supervisor unit lists in
    SuccessExitStatus=, so systemd's Restart=on-failure does not restart a run that ended."""
    import signal

    from dflash_ring.supervisor.supervisor import EXIT_FENCED

    run.write_config(1, 1, slots=3)
    sup = run.supervisor("--set", "supervisor.exit_timeout_s=1.0")
    producer = run.worker("producer", 0, "--items", "100000")
    consumer = run.worker("consumer", 0, "--work-s", "0.05")
    wait_for(lambda: len(run.ledger_lines("C")) >= 1, timeout=60, what="a drafter at work")
    consumer.send_signal(signal.SIGSTOP)
    stop = run.spawn("-m", "dflash_ring", "stop", "--config", str(run.config), "--now", "--timeout", "60")
    assert wait_exit(sup) == EXIT_FENCED, sup.stderr.read()[-3000:]
    assert wait_exit(consumer) == -signal.SIGKILL and wait_exit(producer) == 0 and wait_exit(stop) == 0
    err = sup.stderr.read()
    assert "stopping them with SIGKILL" in err and "consumer-0" in err, err[-3000:]
    assert run.leftovers() == []
