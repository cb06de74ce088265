"""Ledger reconciliation for `dflash-ring chaos`: what the producers planned against what the drafters
took and trained, from the per-process ledgers (common/lifecycle/ledger.py; their records in
common/lifecycle/ledger_events.py). The windows it allows per kill are documented in tools/chaos.py."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from dflash_ring.common.lifecycle.ledger import read_ledger
from dflash_ring.common.lifecycle.ledger_events import (
    CheckpointDurable,
    DrafterStart,
    Evaluated,
    Exited,
    Got,
    Intake,
    LedgerEvent,
    ProducerStart,
    Published,
    Trained,
    is_one_of,
    kind,
)


def read_ledgers(directory: Path) -> tuple[dict[str, list[dict[str, Any]]], int]:
    """Records per role file (e.g. 'drafter-1'), sorted by time; and how many lines were cut."""
    out, cut = {}, 0
    for path in sorted(directory.glob("*.jsonl")) if directory.is_dir() else []:
        f = read_ledger(path)
        cut += f.cut_lines
        out[path.stem] = sorted(f.records, key=lambda r: r["t"])
    return out, cut


def _ident(r: dict[str, Any]) -> tuple[int, int, int]:
    return int(r["producer"]), int(r["epoch"]), int(r["pos"])


def reconcile(ledgers: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """What the producers planned against what the drafters trained (or evaluated), batch by batch.

    A drafter releases a slot only after training on it, so a `train` record is undone by what can only
    happen to an unreleased slot: the same item delivered again later (its holder died; the reaper
    redelivered it), or the batch published again as a replay (the ring was removed while it still held
    the slot). Every planned batch must end with exactly one `train` record not undone; a held-out batch
    (listed in its producer's start record under `eval`) with exactly one `eval` record instead, and never
    a `train` record: an `eval` record is undone exactly as a `train` record is.
    """
    problems: list[str] = []
    expected: set[tuple[int, int, int]] = set()
    held_out: set[tuple[int, int, int]] = set()
    published: dict[tuple[int, int, int], set[int]] = defaultdict(set)
    replays: dict[tuple[int, int, int], list[float]] = defaultdict(list)  # times of start records listing it
    replayed = 0
    plans: dict[int, list[int]] = {}
    for name, recs in ledgers.items():
        if not name.startswith("target-"):
            continue
        p = int(name.split("-")[1])
        for r in recs:
            if kind(r) == ProducerStart.KIND:
                if p in plans and plans[p] != r["plan"]:
                    problems.append(f"producer {p} changed its plan between restarts: {plans[p]} -> {r['plan']}")
                plans[p] = r["plan"]
                held_out |= {(p, e, pos) for e, positions in enumerate(r.get("eval", [])) for pos in positions}
                # A replay is known from the start record on: its publish may be claimed before the `pub` line.
                for e, pos in r.get("replay", []):
                    replays[(p, e, pos)].append(r["t"])
            elif kind(r) == Intake.KIND:  # a dead drafter's sealed journal: produced again from here on
                for e, pos in r.get("replay", []):
                    replays[(p, e, pos)].append(r["t"])
            elif kind(r) == Published.KIND and r.get("replay"):
                replayed += 1
            elif kind(r) == Published.KIND:
                published[(p, r["epoch"], r["pos"])].add(int(r["item"]))
    for p, plan in plans.items():
        expected |= {(p, e, pos) for e, n in enumerate(plan) for pos in range(n)}

    got: dict[tuple[int, int, int], list[dict[str, Any]]] = defaultdict(list)
    trained: dict[tuple[int, int, int], list[dict[str, Any]]] = defaultdict(list)  # `train` and `eval` records
    clean_exit: set[int] = set()
    drafter_pids: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for name, recs in ledgers.items():
        if not name.startswith("drafter-"):
            continue
        for r in recs:
            r = dict(r, drafter=name)
            drafter_pids[r["pid"]].append(r)
            if kind(r) == Got.KIND:
                got[_ident(r)].append(r)
            elif is_one_of(r, Trained, Evaluated):
                trained[_ident(r)].append(r)
            elif kind(r) == Exited.KIND:
                clean_exit.add(r["pid"])
    killed = {pid for pid in drafter_pids if pid not in clean_exit}
    for rs in (*got.values(), *trained.values()):
        rs.sort(key=lambda r: r["t"])  # gathered file by file: put each batch's records in time order

    # The state each drafter process's updates survive in, as the time it was taken: a `train` record after it, by a
    # process that was killed, is in no surviving state. For a killed process that is the state its successor (the
    # next process of its index: a restart, or a standby taking the seat over) resumed from, whose `start` record
    # says when it was taken: the truth, whatever the killed one managed to record. Its own newest `ckpt` record
    # says the same unless the kill fell after a checkpoint became the one to resume from and before the record;
    # without a successor (or a start record of a version without `snapshot_t`) that record decides.
    def survives_until(pid: int, recs: list[dict[str, Any]]) -> float:
        own = max(
            (r.get("snapshot_t", r["t"]) for r in recs if kind(r) == CheckpointDurable.KIND), default=float("-inf")
        )
        if pid not in killed:
            return own
        end = max(r["t"] for r in recs)
        later = [
            r for r in ledgers[recs[0]["drafter"]] if kind(r) == DrafterStart.KIND and r["pid"] != pid and r["t"] > end
        ]
        successor = min(later, key=lambda r: r["t"], default=None)
        return own if successor is None or successor.get("snapshot_t") is None else successor["snapshot_t"]

    last_snapshot = {pid: survives_until(pid, recs) for pid, recs in drafter_pids.items()}

    def lost(t: dict[str, Any]) -> bool:
        # (An `empty` batch had nothing to supervise: it made no update to lose.)
        return (
            kind(t) == Trained.KIND and not t.get("empty") and t["pid"] in killed and t["t"] > last_snapshot[t["pid"]]
        )

    def undone(t: dict[str, Any], k: tuple[int, int, int]) -> bool:
        """The trained slot was never released and was delivered again later (its holder died; the reaper
        redelivered it), or the update was lost (a killed drafter, after its last durable checkpoint) and the
        batch was announced to be produced again after it (the ring's removal held it, or a sealed journal)."""
        again = any(
            g["t"] > t["t"] and g["item"] == t.get("item") and g["deliveries"] > t.get("deliveries", 0)
            for g in got.get(k, [])
        )
        return again or (lost(t) or kind(t) == Evaluated.KIND) and any(rt > t["t"] for rt in replays.get(k, []))

    committed: dict[tuple[int, int, int], list[dict[str, Any]]] = {}
    undone_trains = 0
    lost_not_replayed = []
    for k, rs in trained.items():
        kept = [t for t in rs if not undone(t, k)]
        undone_trains += len(rs) - len(kept)
        lost_not_replayed += [(k, t) for t in kept if lost(t)]
        kept = [t for t in kept if not lost(t)]  # in no surviving state: the batch counts as not trained
        if kept:
            committed[k] = kept

    # Seen twice: explained by a redelivery (same item, more deliveries, first holder killed) or a replay between.
    redelivered = sum(1 for rs in got.values() for r in rs if int(r["deliveries"]) > 1)
    explained_dupes, unexplained = 0, []
    for k, rs in got.items():
        for first, later in zip(rs, rs[1:]):
            if (
                first["item"] == later["item"] and later["deliveries"] > first["deliveries"] and first["pid"] in killed
            ) or any(first["t"] < rt < later["t"] for rt in replays.get(k, [])):
                explained_dupes += 1
            else:
                unexplained.append({"batch": k, "records": [first, later]})
    twice_trained = [{"batch": k, "records": rs} for k, rs in committed.items() if len(rs) > 1]
    # Each batch done as its kind: a held-out batch evaluated and never trained, a training batch trained.
    held_out_trained = sorted(
        k for k, rs in committed.items() if k in held_out and any(kind(r) == Trained.KIND for r in rs)
    )
    evaluated_not_held_out = sorted(
        k for k, rs in committed.items() if k not in held_out and any(kind(r) == Evaluated.KIND for r in rs)
    )

    def once_as(event: type[LedgerEvent], k: tuple[int, int, int]) -> bool:
        return [kind(r) for r in committed.get(k, [])] == [event.KIND]

    republished = [{"batch": k, "items": sorted(items)} for k, items in published.items() if len(items) > 1]

    # Taken from the ring by a drafter and never trained by anyone for good: nothing may be lost in flight.
    lost_in_flight = sorted(k for k in got if k not in committed and k not in {b for b, _ in lost_not_replayed})
    if lost_in_flight:
        problems.append(
            f"{len(lost_in_flight)} batch(es) taken by a drafter and never trained (or evaluated), e.g. "
            f"{lost_in_flight[:5]}"
        )

    # Trained by a killed drafter after the state of its last durable checkpoint was taken, and never produced again:
    # the update went with it, and no surviving state holds the batch (its journal must have brought it back).
    if lost_not_replayed:
        problems.append(
            f"{len(lost_not_replayed)} batch(es) trained by a killed drafter after its last checkpoint "
            f"and never produced again, e.g. {[k for k, _ in lost_not_replayed[:5]]}"
        )

    missing = sorted(expected - set(committed) - set(lost_in_flight))
    unexpected = sorted(set(committed) - expected)
    seen_only = set(got) | set(published)
    never_published = sorted(k for k in missing if k not in seen_only)
    if missing:
        problems.append(
            f"{len(missing)} planned batch(es) never trained (or evaluated), e.g. {missing[:5]} "
            f"({len(never_published)} of them never published)"
        )
    if unexpected:
        problems.append(f"{len(unexpected)} trained batch(es) outside the producers' plan, e.g. {unexpected[:5]}")
    if twice_trained:
        problems.append(f"{len(twice_trained)} batch(es) trained (or evaluated) twice, e.g. {twice_trained[:2]}")
    if held_out_trained:
        problems.append(f"{len(held_out_trained)} held-out batch(es) trained, e.g. {held_out_trained[:5]}")
    if evaluated_not_held_out:
        problems.append(
            f"{len(evaluated_not_held_out)} training batch(es) evaluated instead of trained, e.g. "
            f"{evaluated_not_held_out[:5]}"
        )
    if unexplained:
        problems.append(
            f"{len(unexplained)} batch(es) taken twice without a redelivery or replay, e.g. {unexplained[:2]}"
        )
    if republished:
        problems.append(f"{len(republished)} batch(es) published twice, e.g. {republished[:3]}")
    pub_records = sum(len(v) for v in published.values())
    return {
        "planned_batches": len(expected),
        "plans": {str(p): plan for p, plan in sorted(plans.items())},
        "published_records": pub_records,
        "published_without_record": len({k for k in got if k not in published and k not in replays}),
        "replayed_batches": replayed,
        "taken_by_drafters": len(got),
        "trained_batches": sum(1 for rs in committed.values() if any(kind(r) == Trained.KIND for r in rs)),
        "trained_exactly_once": sum(1 for k in expected - held_out if once_as(Trained, k)),
        "planned_eval_batches": len(held_out & expected),
        "evaluated_batches": sum(1 for rs in committed.values() if any(kind(r) == Evaluated.KIND for r in rs)),
        "evaluated_exactly_once": sum(1 for k in held_out & expected if once_as(Evaluated, k)),
        "held_out_trained": len(held_out_trained),
        "trains_undone_by_redelivery_or_replay": undone_trains,
        "missing": len(missing),
        "missing_examples": missing[:20],
        "trained_twice": len(twice_trained),
        "published_twice": len(republished),
        "redelivered_items": redelivered,
        "seen_twice_explained_by_redelivery_or_replay": explained_dupes,
        "seen_twice_unexplained": len(unexplained),
        "lost_in_flight": len(lost_in_flight),
        "trained_then_lost_with_crash": len(lost_not_replayed),
        "trained_then_replayed_after_crash": sum(1 for rs in trained.values() for t in rs if lost(t))
        - len(lost_not_replayed),
        "killed_drafter_incarnations": len(killed),
        "problems": problems,
    }


def throughput(ledgers: dict[str, list[dict[str, Any]]], window: tuple[float, float] | None) -> dict[str, Any]:
    """Items the drafters got through (trained, or evaluated if held out) per second."""
    ts = sorted(
        r["t"]
        for name, recs in ledgers.items()
        if name.startswith("drafter-")
        for r in recs
        if is_one_of(r, Trained, Evaluated)
    )
    if len(ts) < 2:
        return {"items_done": len(ts), "items_per_s": None}
    lo, hi = (ts[0], ts[-1]) if window is None else (window[0], min(window[1], ts[-1]))
    n = sum(1 for t in ts if lo <= t <= hi)
    return {
        "items_done": len(ts),
        "measured_over_s": round(hi - lo, 1),
        "items_in_span": n,
        "items_per_s": round(n / (hi - lo), 2) if hi > lo else None,
    }


# ---- the command ------------------------------------------------------------------------------------
