"""The ring under real processes: exactly-once delivery, balance, kills, and the stop protocol."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter

import pytest

from support import wait_exit, wait_for


def reconcile(run, producers: int, items: int) -> list[list[str]]:
    """Every produced item consumed exactly once, intact; return the consumer lines."""
    produced = {(int(f[1]), int(f[2])) for f in run.ledger_lines("P")}
    assert produced == {(p, k) for p in range(producers) for k in range(items)}
    consumed = run.ledger_lines("C")
    assert all(f[6] == "ok" for f in consumed), [f for f in consumed if f[6] != "ok"]
    counts = Counter((int(f[2]), int(f[3])) for f in consumed)
    assert set(counts) == produced, f"lost: {sorted(produced - set(counts))[:10]}"
    assert max(counts.values()) == 1, f"duplicated: {[k for k, v in counts.items() if v > 1][:10]}"
    return consumed


@pytest.mark.parametrize("producers,consumers", [(5, 3), (3, 2)])
def test_any_ratio_delivers_exactly_once_and_balances(run, producers, consumers):
    items = 24
    run.write_config(producers, consumers, slots=6)
    sup = run.supervisor()
    # Consumers are the bottleneck (equal work per item): a shared ring must keep all of them busy,
    # where per-consumer queues with round-robin assignment gave 5 producers / 3 consumers = 2,2,1.
    # They all join before the first item, so start-up skew on a loaded box is not measured as imbalance.
    procs = [run.worker("consumer", j, "--work-s", "0.03") for j in range(consumers)]
    run.wait_joined("consumer", range(consumers))
    procs += [run.worker("producer", i, "--items", str(items)) for i in range(producers)]
    for p in procs:
        assert wait_exit(p, 120) == 0, p.stderr.read()
    assert wait_exit(sup) == 0, sup.stderr.read()
    consumed = reconcile(run, producers, items)
    share = Counter(int(f[1]) for f in consumed)
    fair = producers * items / consumers
    assert min(share[j] for j in range(consumers)) >= 0.6 * fair, f"starved consumer: {dict(share)}"
    # FIFO within the ring: each consumer sees item numbers in increasing order.
    for j in range(consumers):
        seq = [int(f[4]) for f in consumed if int(f[1]) == j]
        assert seq == sorted(seq)
    assert run.leftovers() == []


def test_killed_consumer_item_is_redelivered_and_killed_producer_slot_is_freed(run):
    run.write_config(2, 2, slots=4)
    sup = run.supervisor()
    marker_c, marker_p = run.tmp / "c.marker", run.tmp / "p.marker"
    victim_c = run.worker("consumer", 0, "--hold-at", "2", "--hold-s", "600", "--marker", str(marker_c))
    other_c = run.worker("consumer", 1, "--work-s", "0.01")
    # Both consumers in before any item: a victim still importing on a loaded box would find every item taken by
    # the other and never reach the item it is to hold.
    run.wait_joined("consumer", [0, 1])
    victim_p = run.worker(
        "producer", 1, "--items", "12", "--hold-at", "5", "--hold-s", "600", "--marker", str(marker_p)
    )
    producer0 = run.worker("producer", 0, "--items", "12", "--delay-s", "0.01")
    wait_for(marker_c.exists, what="the consumer to hold a slot")
    held_item = int(marker_c.read_text())
    wait_for(marker_p.exists, what="the producer to be mid-write")
    victim_c.send_signal(signal.SIGKILL)
    victim_p.send_signal(signal.SIGKILL)
    wait_exit(victim_c), wait_exit(victim_p)
    status = wait_for(
        lambda: (
            (s := json.loads(run.cli("status", "--config", str(run.config), "--json").stdout))["counters"][
                "redelivered"
            ]
            >= 1
            and s["counters"]["reclaimed"] >= 1
            and s
        ),
        what="the reaper to redeliver and reclaim",
    )
    assert status["counters"]["redelivered"] == 1 and status["counters"]["reclaimed"] == 1
    dead = {(r["role"], r["index"]) for r in status["rows"] if r["status"] == "dead"}
    assert dead == {("consumer", 0), ("producer", 1)}
    # Restart both, as systemd would: each takes its row back and the run completes.
    run.worker("consumer", 0, "--work-s", "0.01")
    run.worker("producer", 1, "--items", "12", "--resume")
    assert wait_exit(producer0) == 0
    assert wait_exit(sup, 90) == 0, sup.stderr.read()
    consumed = reconcile(run, 2, 12)
    redelivered = [f for f in consumed if int(f[4]) == held_item]
    assert len(redelivered) == 1 and int(redelivered[0][5]) == 2  # second delivery of the held item
    assert run.leftovers() == []


def test_early_producer_finish_never_stops_consumers(run):
    """Producer 0 finishes at once, producer 1 trickles; consumers idle in waits must see it all."""
    run.write_config(2, 3, slots=4)
    sup = run.supervisor()
    consumers = [run.worker("consumer", j) for j in range(3)]
    fast = run.worker("producer", 0, "--items", "3")
    assert wait_exit(fast) == 0
    time.sleep(1.0)  # the ring is empty and one producer is done: nobody may leave
    assert all(c.poll() is None for c in consumers)
    slow = run.worker("producer", 1, "--items", "8", "--delay-s", "0.2")
    assert wait_exit(slow) == 0
    for c in consumers:  # all three blocked in waits: the broadcast must reach each
        assert wait_exit(c, 30) == 0
    assert wait_exit(sup) == 0
    reconcile_items = {(int(f[2]), int(f[3])) for f in run.ledger_lines("C")}
    assert reconcile_items == {(0, k) for k in range(3)} | {(1, k) for k in range(8)}


def test_supervisor_killed_and_restarted_adopts_the_ring(run):
    run.write_config(2, 2, slots=4)
    sup = run.supervisor()
    procs = [run.worker("producer", i, "--items", "30", "--delay-s", "0.02") for i in range(2)]
    procs += [run.worker("consumer", j, "--work-s", "0.01") for j in range(2)]
    wait_for(lambda: len(run.ledger_lines("C")) >= 10, what="training to be under way")
    sup.send_signal(signal.SIGKILL)
    wait_exit(sup)
    time.sleep(0.3)
    sup2 = run.supervisor()
    for p in procs:
        assert wait_exit(p, 90) == 0, p.stderr.read()
    assert wait_exit(sup2) == 0
    assert "adopted live ring" in sup2.stderr.read()
    reconcile(run, 2, 30)
    assert run.leftovers() == []


def test_sigterm_to_supervisor_drains_and_everyone_exits_zero(run):
    run.write_config(2, 2, slots=4)
    sup = run.supervisor()
    producers = [run.worker("producer", i, "--items", "100000", "--delay-s", "0.01") for i in range(2)]
    consumers = [run.worker("consumer", j, "--work-s", "0.01") for j in range(2)]
    # Everyone in before the drain: one still importing when the run ends would find no ring to attach to.
    run.wait_joined("producer", range(2))
    run.wait_joined("consumer", range(2))
    wait_for(lambda: len(run.ledger_lines("C")) >= 10, what="training to be under way")
    sup.send_signal(signal.SIGTERM)
    for p in producers + consumers + [sup]:
        assert wait_exit(p, 60) == 0, p.stderr.read()
    # Drained: whatever was published was consumed, nothing more.
    produced = {(f[1], f[2]) for f in run.ledger_lines("P")}
    consumed = {(f[2], f[3]) for f in run.ledger_lines("C")}
    assert produced == consumed
    assert run.leftovers() == []


def test_stop_command_drains_from_another_shell(run):
    run.write_config(1, 1)
    sup = run.supervisor()
    producer = run.worker("producer", 0, "--items", "100000", "--delay-s", "0.01")
    consumer = run.worker("consumer", 0)
    wait_for(lambda: len(run.ledger_lines("C")) >= 5, what="training to be under way")
    out = run.cli("stop", "--config", str(run.config), "--timeout", "60")
    assert "stopped" in out.stdout
    for p in (producer, consumer, sup):
        assert wait_exit(p) == 0
    assert run.leftovers() == []


def test_waiting_consumer_uses_under_two_percent_of_a_core(run):
    run.write_config(1, 1)
    sup = run.supervisor()
    consumer = run.worker("consumer", 0)
    wait_for(lambda: (run.lock_dir / "consumer-0.lock").exists(), what="the consumer to join")
    time.sleep(1.0)

    def cpu_s() -> float:
        fields = open(f"/proc/{consumer.pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    c0, t0 = cpu_s(), time.monotonic()
    time.sleep(5.0)
    used = (cpu_s() - c0) / (time.monotonic() - t0)
    assert used < 0.02, f"a waiting consumer used {used:.1%} of a core"
    run.cli("stop", "--config", str(run.config), "--now")
    assert wait_exit(consumer) == 0 and wait_exit(sup) == 0
