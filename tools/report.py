"""`dflash-ring report RUN_DIR`: a picture of how the drafters learned, with no tracker running.

It reads the record files every drafter writes whatever the trackers (`<tracking dir>/drafter-<j>.jsonl`,
consumer/tracking.py) and draws loss and acceptance length per drafter, and per data source where the records
have `source/<name>/...` keys, into one PNG (matplotlib, from the `tracking` extra).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from dflash_ring.consumer.tracking import EVAL, TRAIN, read_records

RECORD = re.compile(r"drafter-(\d+)\.jsonl$")
SOURCE_KEY = re.compile(r"^source/(.+)/(loss|accept_len)$")
STYLES = ("-", "-.", (0, (5, 1)), (0, (1, 1)))


class ReportError(RuntimeError):
    """Nothing to draw from, or no way to draw; the message says where it looked and what to do."""


def record_files(run_dir: Path) -> dict[int, Path]:
    """drafter index -> its record file, from RUN_DIR/tracking (the default tracking.dir) or RUN_DIR itself."""
    for d in (run_dir / "tracking", run_dir):
        found = {int(m.group(1)): p for p in d.glob("drafter-*.jsonl") if (m := RECORD.search(p.name))}
        if found:
            return dict(sorted(found.items()))
    raise ReportError(f"no drafter record files (drafter-<j>.jsonl) in {run_dir / 'tracking'} or {run_dir}: give "
                      "the run's directory (the one holding train.checkpoint_dir) or its tracking.dir")


# The keys the report reads as numbers (besides "step"): the per-drafter curves, held-out points, per-source curves.
NUMBER_KEY = re.compile(r"^(eval/)?(loss|accept_len|accept_len_prob)$|^source/.+/(loss|accept_len)$")


def checked_records(path: Path) -> list[dict[str, Any]]:
    """The records of a record file as the report reads them, each checked first: a line that is not an object,
    a logged step without an integer "step" or a string "series", or a curve's value that is not a number is
    refused (ReportError) naming the file, the line and what is wrong, instead of failing while drawing."""
    records = read_records(path)
    for line, r in enumerate(records, 1):
        where = f"record file {path}, line {line}"
        if not isinstance(r, dict):
            raise ReportError(f"{where}: expected a JSON object, got {type(r).__name__}: the file is not a drafter's "
                              "record file, or was edited; move it out of the directory")
        logged = "step" in r or r.get("series") in (TRAIN, EVAL)
        if logged:
            if type(r.get("step")) is not int:  # noqa: E721 (a bool is no step)
                raise ReportError(f"{where}: a logged step needs an integer \"step\", got {r.get('step')!r}")
            if not isinstance(r.get("series"), str):
                raise ReportError(f"{where}: a logged step needs a string \"series\" ({TRAIN!r} or {EVAL!r}), got "
                                  f"{r.get('series')!r}")
        for key, value in r.items():
            if NUMBER_KEY.match(key) and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ReportError(f"{where}: {key!r} = {value!r}: expected a number")
        if "fingerprint" in r and not isinstance(r["fingerprint"], str):
            raise ReportError(f"{where}: 'fingerprint' = {r['fingerprint']!r}: expected a string")
    return records


def series(records: list[dict[str, Any]], key: str, kind: str = TRAIN) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if r.get("series") == kind and key in r]
    return [s for s, _ in points], [v for _, v in points]


def write_report(run_dir: Path, out: Path | None = None) -> tuple[Path, str]:
    """Draw the run's curves; returns the PNG's path and one line saying what it shows."""
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its first import logs building a font cache
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no screen
        import matplotlib.pyplot as plt
    except ImportError:
        raise ReportError("dflash-ring report draws with matplotlib: pip install 'dflash-ring[tracking]'") from None
    files = record_files(run_dir)
    records = {j: checked_records(p) for j, p in files.items()}
    header = next((r for rs in records.values() for r in rs if r.get("series") == "config"), {})
    sources = sorted({m.group(1) for rs in records.values() for r in rs for k in r if (m := SOURCE_KEY.match(k))})
    cols = 2 if sources else 1
    fig, axes = plt.subplots(2, cols, figsize=(7 * cols, 7), squeeze=False, sharex="col")
    drawn = 0
    for j, rs in records.items():
        for row, (key, label) in enumerate((("loss", "loss"), ("accept_len", "accept length (teacher-forced)"))):
            ax = axes[row][0]
            steps, values = series(rs, key)
            drawn += bool(steps)
            line, = ax.plot(steps, values, label=f"drafter-{j}")
            if key == "accept_len" and (prob := series(rs, "accept_len_prob"))[0]:
                ax.plot(*prob, linestyle=":", color=line.get_color(), label=f"drafter-{j} (probabilistic)")
            if (ev := series(rs, f"eval/{key}", "eval"))[0]:
                ax.plot(*ev, linestyle="--", marker="o", color=line.get_color(), label=f"drafter-{j} held-out")
            ax.set_ylabel(label)
        for row, key in enumerate(("loss", "accept_len")):
            for i, name in enumerate(sources):  # a colour per source, a line style per drafter
                steps, values = series(rs, f"source/{name}/{key}")
                if steps:
                    axes[row][1].plot(steps, values, color=f"C{i % 10}", linestyle=STYLES[j % len(STYLES)],
                                      label=f"{name} (drafter-{j})")
    if not drawn:
        raise ReportError(f"the record files in {files[next(iter(files))].parent} hold no logged step yet")
    axes[0][0].set_title("per drafter")
    if cols == 2:
        axes[0][1].set_title("per data source")
        axes[0][1].set_ylabel("loss")
        axes[1][1].set_ylabel("accept length (teacher-forced)")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("optimizer step")
    run = header.get("run", run_dir.name)
    fig.suptitle(f"run {run}: {len(records)} drafter(s)" + (f", {len(sources)} source(s)" if sources else "")
                 + (f", config fingerprint {header['fingerprint'][:12]}" if "fingerprint" in header else ""))
    fig.tight_layout()
    out = out or run_dir / "report.png"
    if not out.suffix:  # savefig adds .png to a name without a suffix: report the file it writes
        out = out.with_suffix(".png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    last = {j: max((r["step"] for r in rs if r.get("series") == TRAIN), default=0) for j, rs in records.items()}
    return out, (f"loss and accept length of {len(records)} drafter(s) to step "
                 f"{', '.join(f'{s}' for s in last.values())}" + (f", per source: {', '.join(sources)}" if sources else ""))
