"""`dflash-ring report RUN_DIR`: a picture of how the drafters learned, with no tracker running.

It reads the record files every drafter writes whatever the trackers (`<tracking dir>/drafter-<j>.jsonl`,
consumer/reporting/tracking.py) and draws loss and acceptance length per drafter, and per data source where the records
have `source/<name>/...` keys, into one PNG (matplotlib, from the `tracking` extra). Both panels draw one value
per logged step, by one definition: the window since the previous logged step, every block of it (per drafter:
`window/...`, all sources together; per source: `source/<name>/...`, that source's blocks), so one drafter's curve
of one source is the same line in both. Records written before `window/...` existed fall back to the logged step's
own figures, labelled "(last step)". Held-out figures (`eval/...`, `eval/source/<name>/...`) are drawn as marked
dashed lines over the training curves, in both panels.

Given instead a JSON file of `dflash-ring eval --json` whose drafter has a confidence head (DSpark), it draws that
confidence's reliability diagram: per position k and pooled over positions, the mean predicted
prod_{j<=k} sigmoid(c_j) against the observed fraction of rounds whose first k drafts were all accepted, per bin
(consumer/evaluation/calibration.py), with each position's ECE, AUROC and Brier score beside it.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from dflash_ring.common.bounded_read import RECORD_BYTES, check_output, read_text
from dflash_ring.consumer.reporting.tracking import EVAL, TRAIN, read_records, step_out_of_range

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
    raise ReportError(
        f"no drafter record files (drafter-<j>.jsonl) in {run_dir / 'tracking'} or {run_dir}: give "
        "the run's directory (the one holding train.checkpoint_dir) or its tracking.dir"
    )


# The keys the report reads as numbers (besides "step"): the per-drafter curves, held-out points, per-source curves.
NUMBER_KEY = re.compile(r"^(eval/|window/)?(loss|accept_len|accept_len_prob)$|^(eval/)?source/.+/(loss|accept_len)$")


def checked_records(path: Path) -> list[dict[str, Any]]:
    """The records of a record file as the report reads them, each checked first: a line that is not an object,
    a logged step without an integer "step" or a string "series", or a curve's value that is not a number is
    refused (ReportError) naming the file, the line and what is wrong, instead of failing while drawing."""
    records = read_records(path)
    for line, r in enumerate(records, 1):
        where = f"record file {path}, line {line}"
        if not isinstance(r, dict):
            raise ReportError(
                f"{where}: expected a JSON object, got {type(r).__name__}: the file is not a drafter's "
                "record file, or was edited; move it out of the directory"
            )
        logged = "step" in r or r.get("series") in (TRAIN, EVAL)
        if logged:
            if type(r.get("step")) is not int:  # noqa: E721 (a bool is no step)
                raise ReportError(f'{where}: a logged step needs an integer "step", got {r.get("step")!r}')
            if why := step_out_of_range(r["step"]):
                raise ReportError(
                    f"{where}: {why}: no drafter logs it (an edit, or damage); the drafter rebuilds the file at its "
                    "next start without it, keeping the damaged copy, or move the file out of the directory"
                )
            if not isinstance(r.get("series"), str):
                raise ReportError(
                    f'{where}: a logged step needs a string "series" ({TRAIN!r} or {EVAL!r}), got {r.get("series")!r}'
                )
        for key, value in r.items():
            if NUMBER_KEY.match(key) and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ReportError(f"{where}: {key!r} = {value!r}: expected a number")
        if "fingerprint" in r and not isinstance(r["fingerprint"], str):
            raise ReportError(f"{where}: 'fingerprint' = {r['fingerprint']!r}: expected a string")
    return records


def series(records: list[dict[str, Any]], key: str, kind: str = TRAIN) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if r.get("series") == kind and key in r]
    return [s for s, _ in points], [v for _, v in points]


def _pyplot():
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its first import logs building a font cache
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no screen
        import matplotlib.pyplot as plt
    except ImportError:
        raise ReportError("dflash-ring report draws with matplotlib: pip install 'dflash-ring[tracking]'") from None
    return plt


def write_report(run_dir: Path, out: Path | None = None) -> tuple[Path, str]:
    """Draw the run's curves (or, given an eval JSON file, its reliability diagram); returns the PNG's path and one
    line saying what it shows."""
    if run_dir.is_file():
        return write_reliability(run_dir, out)
    out = checked_out(out or run_dir / "report.png")
    plt = _pyplot()
    files = record_files(run_dir)
    records = {j: checked_records(p) for j, p in files.items()}
    fig, sources = figure(plt, records, run_dir.name, files[next(iter(files))].parent)
    _save(plt, fig, out)
    last = {j: max((r["step"] for r in rs if r.get("series") == TRAIN), default=0) for j, rs in records.items()}
    return out, (
        f"loss and accept length of {len(records)} drafter(s) to step "
        f"{', '.join(f'{s}' for s in last.values())}" + (f", per source: {', '.join(sources)}" if sources else "")
    )


def figure(plt: Any, records: dict[int, list[dict[str, Any]]], name: str, where: Path) -> tuple[Any, list[str]]:
    """The picture of these drafters' records, and the sources it draws (see the module docstring)."""
    header = next((r for rs in records.values() for r in rs if r.get("series") == "config"), {})
    sources = sorted({m.group(1) for rs in records.values() for r in rs for k in r if (m := SOURCE_KEY.match(k))})
    cols = 2 if sources else 1
    fig, axes = plt.subplots(2, cols, figsize=(7 * cols, 7), squeeze=False, sharex="col")
    drawn = 0
    for j, rs in records.items():
        for row, (key, label) in enumerate((("loss", "loss"), ("accept_len", "accept length (teacher-forced)"))):
            ax = axes[row][0]
            steps, values = series(rs, f"window/{key}")
            last_step = not steps
            if last_step:  # a record file from before window/ figures: the logged steps' own
                steps, values = series(rs, key)
            drawn += bool(steps)
            (line,) = ax.plot(steps, values, label=f"drafter-{j}" + (" (last step)" if last_step else ""))
            prob_key = "accept_len_prob" if last_step else "window/accept_len_prob"
            if key == "accept_len" and (prob := series(rs, prob_key))[0]:
                ax.plot(*prob, linestyle=":", color=line.get_color(), label=f"drafter-{j} (probabilistic)")
            if (ev := series(rs, f"eval/{key}", EVAL))[0]:
                ax.plot(*ev, linestyle="--", marker="o", color=line.get_color(), label=f"drafter-{j} held-out")
            ax.set_ylabel(label)
        for row, key in enumerate(("loss", "accept_len")):
            for i, source in enumerate(sources):  # a colour per source, a line style per drafter
                steps, values = series(rs, f"source/{source}/{key}")
                if steps:
                    axes[row][1].plot(
                        steps,
                        values,
                        color=f"C{i % 10}",
                        linestyle=STYLES[j % len(STYLES)],
                        label=f"{source} (drafter-{j})",
                    )
                if (ev := series(rs, f"eval/source/{source}/{key}", EVAL))[0]:
                    axes[row][1].plot(
                        *ev, color=f"C{i % 10}", linestyle="--", marker="o", label=f"{source} (drafter-{j}) held-out"
                    )
    if not drawn:
        plt.close(fig)
        raise ReportError(f"the record files in {where} hold no logged step yet")
    axes[0][0].set_title("per drafter (each window since the last logged step)")
    if cols == 2:
        axes[0][1].set_title("per data source (each window since the last logged step)")
        axes[0][1].set_ylabel("loss")
        axes[1][1].set_ylabel("accept length (teacher-forced)")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("optimizer step")
    run = header.get("run", name)
    fig.suptitle(
        f"run {run}: {len(records)} drafter(s)"
        + (f", {len(sources)} source(s)" if sources else "")
        + (f", config fingerprint {header['fingerprint'][:12]}" if "fingerprint" in header else "")
    )
    fig.tight_layout()
    return fig, sources


def checked_out(out: Path) -> Path:
    """The file the picture goes to: `--out X` is X.png (what savefig writes for a name without a suffix, and what
    the line printed then names); a suffix other than .png is refused before anything is read or drawn, and so is
    a path that is there and not a regular file (a FIFO would block the write, /dev/full refuse it, and either
    given without a suffix would have had NAME.png written beside it)."""
    check_output(out, ReportError, "--out")
    if not out.suffix:
        png = out.with_suffix(".png")
    elif out.suffix.lower() != ".png":
        raise ReportError(f"--out {out}: the report is a PNG; give a path ending in .png (or none, and .png is added)")
    else:
        png = out
    check_output(png, ReportError, "--out")
    return png


def _save(plt: Any, fig: Any, out: Path) -> None:
    try:
        fig.savefig(out, dpi=100)
    except OSError as e:
        raise ReportError(f"cannot write {out}: {e.strerror or e}") from None
    finally:
        plt.close(fig)


def calibration_of(path: Path) -> dict[str, Any]:
    """The `calibration` object of an eval JSON file, checked enough to draw: ReportError naming what is wrong."""
    try:
        report = json.loads(read_text(path, RECORD_BYTES, ReportError, "eval JSON"))
    except ReportError:
        raise  # not a regular file (a FIFO is never waited on), past its cap, not UTF-8: named by read_text
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ReportError(
            f"{path} is neither a run directory nor a readable JSON file ({type(e).__name__}: {e})"
        ) from None
    if not isinstance(report, dict) or "tau" not in report:
        raise ReportError(
            f"{path} is not the JSON of `dflash-ring eval --json`: give a run's directory, or an eval's "
            "JSON to draw its confidence's reliability diagram"
        )
    calibration = report.get("calibration")
    if calibration is None:
        raise ReportError(f"{path} holds no calibration data: only a drafter with a confidence head (DSpark) has it")
    try:
        rows = [*calibration["positions"], calibration["pooled"]]
        for row in rows:
            for b in row["bins"]:
                _in_range(b, BIN_RANGES, "bin ")
            _in_range(row, ROW_RANGES, "")
    except (KeyError, TypeError, ValueError) as e:
        raise ReportError(f"{path}: its calibration data is malformed ({type(e).__name__}: {e})") from None
    return report


# What consumer/evaluation/calibration.py writes, field by field: (integer?, may be None?); every number a probability
# but the counts (>= 0) and the position (>= 0). JSON takes NaN and -1e308, which were drawn in silence.
ROW_RANGES = {
    "position": (True, False),
    "count": (True, False),
    "ece": (False, False),
    "brier": (False, False),
    "observed": (False, False),
    "mean_predicted": (False, False),
    "auroc": (False, True),
}
BIN_RANGES = {
    "count": (True, False),
    "lo": (False, False),
    "hi": (False, False),
    "mean_predicted": (False, True),
    "observed": (False, True),
}


def _in_range(fields: dict[str, Any], ranges: dict[str, tuple[bool, bool]], what: str) -> None:
    for key, (integer, optional) in ranges.items():
        value = fields[key]
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
            raise TypeError(f"{what}{key} = {value!r}")
        if not (value >= 0 if integer else 0.0 <= value <= 1.0):  # NaN fails both
            raise ValueError(f"{what}{key} = {value!r}: {'a count >= 0' if integer else 'a probability in [0, 1]'}")


def write_reliability(path: Path, out: Path | None = None) -> tuple[Path, str]:
    """The reliability diagram of an eval JSON's confidence calibration, beside it as NAME.reliability.png."""
    out = checked_out(out or path.with_suffix(".reliability.png"))
    report = calibration_of(path)
    plt = _pyplot()
    calibration = report["calibration"]
    positions, pooled = calibration["positions"], calibration["pooled"]
    fig, (ax, counts_ax, metrics_ax) = plt.subplots(1, 3, figsize=(17, 5.5), gridspec_kw={"width_ratios": [1.25, 1, 1]})
    ax.plot([0, 1], [0, 1], linestyle=":", color="grey", label="perfect calibration")
    for i, row in enumerate([*positions, pooled]):
        filled = [b for b in row["bins"] if b["count"]]
        is_pooled = row is pooled
        label = f"pooled (ECE {row['ece']:.3f})" if is_pooled else f"k = {row['position']} (ECE {row['ece']:.3f})"
        style = (
            dict(color="black", linewidth=2.5, marker="s", zorder=3)
            if is_pooled
            else dict(color=f"C{i % 10}", linewidth=1, marker="o", alpha=0.8)
        )
        ax.plot([b["mean_predicted"] for b in filled], [b["observed"] for b in filled], label=label, **style)
    ax.set_xlim(-0.02, 1.02)
    ax.set_ylim(-0.02, 1.02)
    ax.set_aspect("equal")
    ax.set_xlabel("predicted: prod_{j<=k} sigmoid(c_j), mean per bin")
    ax.set_ylabel("observed: fraction with the first k drafts all accepted")
    ax.set_title("reliability diagram")
    ax.legend(fontsize=7, loc="upper left")
    bins = pooled["bins"]
    width = bins[0]["hi"] - bins[0]["lo"]
    counts_ax.bar(
        [b["lo"] for b in bins],
        [b["count"] for b in bins],
        width=width,
        align="edge",
        color="lightgrey",
        edgecolor="black",
        label="pooled",
    )
    for i, row in enumerate(positions):
        counts_ax.plot(
            [b["lo"] + width / 2 for b in row["bins"]],
            [b["count"] for b in row["bins"]],
            marker=".",
            color=f"C{i % 10}",
            linewidth=1,
            label=f"k = {row['position']}",
        )
    counts_ax.set_xlim(0, 1)
    counts_ax.set_xlabel("predicted (bin)")
    counts_ax.set_ylabel("predictions in the bin")
    counts_ax.set_title("how the predictions spread")
    counts_ax.legend(fontsize=7)
    ks = [row["position"] for row in positions]
    metrics_ax.plot(ks, [row["ece"] for row in positions], marker="o", label="ECE")
    metrics_ax.plot(ks, [row["brier"] for row in positions], marker="o", label="Brier")
    aurocs = [(row["position"], row["auroc"]) for row in positions if row["auroc"] is not None]
    if aurocs:
        metrics_ax.plot(*zip(*aurocs), marker="o", label="AUROC")
    metrics_ax.plot(
        ks,
        [row["observed"] for row in positions],
        linestyle="--",
        color="grey",
        label="observed acceptance of the first k",
    )
    metrics_ax.set_ylim(0, 1)
    metrics_ax.set_xticks(ks)
    metrics_ax.set_xlabel("position k")
    metrics_ax.set_title("per position")
    metrics_ax.legend(fontsize=7)
    for a in (ax, counts_ax, metrics_ax):
        a.grid(alpha=0.3)
    temperature = report.get("temperature", 0)
    decoding = "greedy" if not temperature else f"temperature {temperature:g}"
    rounds = pooled["count"] // max(len(positions), 1)
    fig.suptitle(
        f"{path.name}: confidence of {len(positions)} drafts per round over {rounds} rounds, {decoding}, "
        f"tau {report['tau']:.3f}"
    )
    fig.tight_layout()
    _save(plt, fig, out)
    return out, (
        f"reliability diagram of the confidence at {len(positions)} positions over {rounds} rounds, "
        f"pooled ECE {pooled['ece']:.3f}"
    )
