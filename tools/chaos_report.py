"""The chaos report, for people (`format_report`) and machines (`report_json`)."""

from __future__ import annotations

import json
from typing import Any


def format_report(rep: dict[str, Any]) -> str:
    c = rep["chaos"]
    k, led, thr = c["kills"], c["ledger"], c["throughput"]
    lines = [
        f"chaos run, seed {rep['seed']}: {'PASSED' if rep['passed'] else 'FAILED'} "
        f"({rep['seconds_total']:.0f}s in all)",
        f"  kills: {k['sent']} sent ({', '.join(f'{r} {n}' for r, n in k['by_role'].items())}); "
        f"{', '.join(f'{r} {n}' for r, n in k['by_role_and_signal'].items())}",
        f"  restarts {c['restarts']}, full restarts after a drain {c['full_restarts_after_drain']}, "
        f"recoveries {c['recoveries']} (recovery p50 {c['recovery_s']['p50']}s, max {c['recovery_s']['max']}s; "
        + ", ".join(f"{r} p50 {v['p50']}s" for r, v in c["recovery_s_by_role"].items())
        + "), "
        f"not recovered before the end {c['not_recovered_before_the_end']}",
        f"  whole-run stops and restarts: {len(c['whole_run_stops'])} "
        f"({', '.join(s['mode'] for s in c['whole_run_stops']) or 'none'}); batches replayed {led['replayed_batches']}",
        f"  batches: planned {led['planned_batches']}, trained exactly once {led['trained_exactly_once']}, "
        f"held out {led['planned_eval_batches']} (evaluated exactly once {led['evaluated_exactly_once']}, "
        f"trained {led['held_out_trained']}), missing {led['missing']},"
        f" trained twice {led['trained_twice']}, published twice {led['published_twice']}",
        f"  redelivered {led['redelivered_items']} (seen twice, explained by redelivery or replay "
        f"{led['seen_twice_explained_by_redelivery_or_replay']}, unexplained {led['seen_twice_unexplained']}); "
        f"trains undone {led['trains_undone_by_redelivery_or_replay']}; lost in flight {led['lost_in_flight']}; "
        f"trained after a checkpoint and lost with a crash: produced again "
        f"{led['trained_then_replayed_after_crash']}, never {led['trained_then_lost_with_crash']}",
        f"  throughput in the fault window {thr.get('items_per_s')} items/s vs {thr.get('baseline_items_per_s')} "
        f"without faults: lost {thr.get('lost')}",
        *(
            f"  start-up of {role} ({st['starts']} starts): p50 {st['total_s']['p50']}s, max {st['total_s']['max']}s; "
            + ", ".join(f"{p} {v['p50']}/{v['max']}s" for p, v in st["phases_s"].items())
            for role, st in c["startup"].items()
        ),
        f"  hung: {c['hung'] or 'none'}; left after clean: {c['clean']['leftovers'] or 'nothing'}; "
        "checkpoints: " + ", ".join(f"{n} step {v.get('step')}" for n, v in c["checkpoints"].items()),
    ]
    lines += [f"  FAILURE: {f}" for f in rep["failures"]]
    return "\n".join(lines)


def report_json(rep: dict[str, Any]) -> str:
    return json.dumps(rep, indent=2, default=str)
