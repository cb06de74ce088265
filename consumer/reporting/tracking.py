"""A drafter's learning curves: its record file, and the trackers of [tracking] (TensorBoard, W&B, MLflow).

Every logged step's record (consumer/reporting/step_record.py) goes to `<tracking dir>/drafter-<j>.jsonl` first, always,
tracker or not: `dflash-ring report` draws from it, and it is what a restarted drafter resumes from. Then to each
tracker of `tracking.backends`.

Replicas are grouped runs, one tracker run per drafter, all named after the ring run: TensorBoard runs
`<dir>/tensorboard/drafter-<j>` (one chart per key, the replicas overlaid), W&B runs grouped by the run name,
MLflow runs in one experiment tagged with the run name. Not one run with `drafter-<j>/` keys: a W&B run takes
one writer with a rising step, and TensorBoard's purge of a restarted writer's stale steps applies to every
writer of its directory.

A restarted drafter resumes at its checkpoint's step and trains again the steps after it. Each series keeps a
step once: steps at or below the last one in the record file are not logged again (the series keep what the
killed drafter logged of them), and what a tracker lost in the kill (W&B buffers ~15 s; any tracker may miss the
record's last line) is sent to it again from the record file, so a series has no duplicate and no gap. The
tracker run is found again, never a second one: TensorBoard writes to the same directory (purge_step at the
record's last step, which is sent again), W&B resumes the run id derived from the run's name and directory
(offline, its run files say which steps it kept), MLflow finds its run by that id in a tag (and its last step).

A tracker that cannot start stops the drafter at start with one line naming the setting (`tracking.dir` before
the model is built; the trackers themselves once the drafter's seat is its own, common/lifecycle/seat.py); one that
fails later is warned about once and dropped, and training goes on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from dflash_ring.common.bounded_read import REPORT_BYTES, read_bytes, read_own
from dflash_ring.common.config.tracking import TrackingConfig
from dflash_ring.common.config.train import MAX_STEPS
from dflash_ring.common.damaged_file import keep_aside, write_atomic
from dflash_ring.common.output_dir import OutputDirError, check_output_dir

log = logging.getLogger(__name__)

TRAIN, EVAL = "train", "eval"
# A held-out item's sums, written to the record file before the item is released: the evaluation record that
# will hold them comes at the next multiple of train.eval_every_steps, and a kill before it must not lose them.
HELD_OUT = "held-out"
INSTALL = "pip install 'dflash-ring[tracking]'"


class TrackingError(RuntimeError):
    """A tracker that cannot start; the message names the setting and what to do."""


def record_path(root: Path, index: int) -> Path:
    return root / f"drafter-{index}.jsonl"


def series_of(record: dict[str, float]) -> str:
    """EVAL for a record of evaluation keys only (`eval/...`), else TRAIN: each series resumes on its own."""
    return EVAL if record and all(k.startswith("eval/") for k in record) else TRAIN


class RecordFileError(RuntimeError):
    """A record file line that is not JSON, for a reader that does not own the file (`dflash-ring report`): the
    message names the file, the line and what to do. The drafter, which owns it, rebuilds it instead."""


def read_records(path: Path) -> list[Any]:
    """The JSON values of a record file's whole lines (a torn last line, from a kill mid-write, left out), as they
    are: the report checks their shape itself. A line that is not JSON is RecordFileError."""
    out = []
    for n, line in enumerate(read_bytes(path, REPORT_BYTES, RecordFileError, "record file").split(b"\n")[:-1], 1):
        try:
            out.append(json.loads(line.decode("utf-8")))
        except (ValueError, RecursionError) as e:
            raise RecordFileError(
                f"record file {path}, line {n}: not JSON ({type(e).__name__}): a damaged byte or "
                "an edit; the drafter rebuilds the file at its next start, keeping the damaged "
                "copy, or move the file out of the directory"
            ) from None
    return out


def step_out_of_range(step: int) -> str | None:
    """Why a logged step read back is none a drafter writes (past train.total_steps' bound, MAX_STEPS), or None. A
    successor logs only steps past the record's last one (a step of 1e12 silenced it for good) and TensorBoard purges
    from there (10**30 overflowed it at every start, a crash loop)."""
    return None if 0 <= step <= MAX_STEPS else f"step {step} is out of range (0 to {MAX_STEPS:_})"


def _record(line: bytes) -> dict[str, Any] | None:
    """A line's record, or None when it is none: a JSON object that is either the header (series "config"), a
    held-out item's sums (series HELD_OUT, a string item and a sources object: their values are checked where they
    are read, held_out_sources) or a logged step (an integer step in range, series train or eval, and a number for
    every other key but "series", an integer one within int64 as every tracker takes it)."""
    try:
        r = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):  # not UTF-8, not JSON
        return None
    if not isinstance(r, dict):
        return None
    if "step" not in r:
        if r.get("series") == HELD_OUT:
            return r if isinstance(r.get("item"), str) and isinstance(r.get("sources"), dict) else None
        return r if r.get("series") == "config" else None
    if type(r["step"]) is not int or step_out_of_range(r["step"]) or r.get("series") not in (TRAIN, EVAL):  # noqa: E721
        return None
    if any(k != "series" and (isinstance(v, bool) or not isinstance(v, (int, float))) for k, v in r.items()):
        return None
    if any(isinstance(v, int) and not -(2**63) <= v < 2**63 for v in r.values()):
        return None
    return r


def _out_of_range(line: bytes) -> str | None:
    """What is out of range in a line `_record` refused, where that is why (not unreadable, not of another shape)."""
    try:
        r = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    if not isinstance(r, dict) or type(r.get("step")) is not int:  # noqa: E721
        return None
    if why := step_out_of_range(r["step"]):
        return why
    big = next((k for k, v in r.items() if type(v) is int and not -(2**63) <= v < 2**63), None)  # noqa: E721
    return None if big is None else f"{big} = {r[big]} is out of range (an int64)"


def checked_lines(data: bytes) -> tuple[list[dict[str, Any]], list[int], int]:
    """(the records of the whole lines that check, the 1-based numbers of those that do not, the length of the
    whole lines). The last piece without a newline is a torn write of a killed drafter: not a record, not
    damage. Each line is checked on its own, so one damaged line costs that line, not the rest of the file."""
    pieces = data.split(b"\n")
    whole = len(data) - len(pieces[-1])
    out, bad = [], []
    for n, line in enumerate(pieces[:-1], 1):
        if (r := _record(line)) is None:
            bad.append(n)
        else:
            out.append(r)
    return out, bad, whole


class RecordFile:
    """`drafter-<j>.jsonl`: a header line (config, fingerprint), then {"step", "series", "time", **record} per
    logged step, each line synced before any tracker sees it (its last step is where a restart resumes)."""

    def __init__(self, path: Path, header: dict[str, Any]):
        self.last: dict[str, int] = {}
        data = read_own(path, REPORT_BYTES, "record file")  # not a regular file: kept aside, written anew
        lines, bad, whole = checked_lines(data) if data is not None else ([], [], 0)
        if bad:  # rebuilt from its good lines before this drafter appends: the damaged copy is kept aside
            pieces = data.split(b"\n")
            ranges = [f"line {n}: {why}" for n in bad if (why := _out_of_range(pieces[n - 1]))]
            keep_aside(
                path,
                f"{len(bad)} record line(s) unreadable (line {', '.join(map(str, bad[:5]))}"
                f"{', ...' if len(bad) > 5 else ''}), {len(lines)} kept; the curves lack those steps"
                + "".join(f"; {r}" for r in ranges[:3]),
            )
            if lines and lines[0].get("series") != "config":  # the header was the damaged line: this config's
                lines.insert(0, header)
            write_atomic(path, b"".join(json.dumps(x).encode() + b"\n" for x in lines))
            whole = path.stat().st_size
        self.logged = [x for x in lines if "step" in x]  # what a restarted drafter may send a tracker again
        # The held-out items evaluated after the last evaluation record: the next one's (a restart's too).
        self.held_out: list[dict[str, Any]] = []
        for x in lines:
            if x.get("series") == EVAL:
                self.held_out = []
            elif x.get("series") == HELD_OUT:
                self.held_out.append(x)
        for x in self.logged:
            self.last[x["series"]] = max(self.last.get(x["series"], 0), int(x["step"]))
        self.fresh = whole == 0
        self.header = header  # written with the first step: a drafter that fails to start leaves the file fresh
        self.f = open(path, "r+b" if path.exists() else "wb")  # noqa: SIM115 (open for the drafter's lifetime)
        self.f.truncate(whole)  # a torn line of a killed drafter goes
        self.f.seek(whole)

    def write(self, step: int, series: str, record: dict[str, float]) -> None:
        if self.f.tell() == 0:
            self._line(self.header)
        self._line({"step": step, "series": series, "time": round(time.time(), 3), **record})
        self.last[series] = step
        if series == EVAL:
            self.held_out = []

    def hold_out(self, line: dict[str, Any]) -> None:
        """One held-out item's sums (HELD_OUT, no "step": no tracker's series), synced before its slot is released."""
        if self.f.tell() == 0:
            self._line(self.header)
        self._line({"series": HELD_OUT, **line})
        self.held_out.append({"series": HELD_OUT, **line})

    def _line(self, value: dict[str, Any]) -> None:
        self.f.write(json.dumps(value).encode() + b"\n")
        self.f.flush()
        os.fsync(self.f.fileno())

    def close(self) -> None:
        self.f.close()


class Backend(Protocol):
    name: str
    # The newest step this tracker holds of a resumed series, where it may lack some of the record file's
    # (it buffers, and a SIGKILL loses the buffer): the record file's steps after it are sent to it again.
    # None: it holds every step the record file has.
    kept: int | None

    def log(self, step: int, record: dict[str, float]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class RunRecord:
    """What every series of a run says about the run: its name, its whole config as TOML (`dump_toml(cfg,
    full=True)`) and its fingerprint's digest (hex). The drafter's entry point makes it from the whole config, so
    the trackers take only their section, their directory and this."""

    name: str
    config_text: str
    fingerprint: str


def series_id(root: Path, run_name: str, index: int) -> str:
    """The tracker run of drafter `index`: the run's name and its tracking directory `root` on this host, so a
    restart finds it again and another run of the same name elsewhere does not."""
    where = f"{socket.gethostname()}:{os.path.abspath(root)}"
    digest = hashlib.sha256(where.encode()).hexdigest()[:8]
    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in run_name)
    return f"{name}-drafter-{index}-{digest}"


class TensorBoard:
    name = "tensorboard"

    def __init__(self, t: TrackingConfig, root: Path, index: int, resume_after: int | None, run: RunRecord):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise TrackingError(
                f"tracking.backends has 'tensorboard' but the tensorboard package is not installed: "
                f"{INSTALL}, or drop it from tracking.backends"
            ) from None
        logdir = root / "tensorboard" / f"drafter-{index}"
        # Resumed: TensorBoard's readers drop what this directory holds from the record's last step on (a
        # killed drafter may have logged it or not), and that step is sent again.
        self.kept = None if resume_after is None else max(0, resume_after - 1)
        self.writer = SummaryWriter(str(logdir), purge_step=None if resume_after is None else resume_after)
        if resume_after is None:
            self.writer.add_text("config", "```toml\n" + run.config_text + "```", 0)
            self.writer.add_text("fingerprint", run.fingerprint, 0)
            self.writer.flush()

    def log(self, step: int, record: dict[str, float]) -> None:
        for key, value in record.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a killed drafter loses nothing it logged

    def close(self) -> None:
        self.writer.close()


class WandB:
    name = "wandb"

    def __init__(self, t: TrackingConfig, root: Path, index: int, resume_after: int | None, run: RunRecord):
        try:
            import wandb
        except ImportError:
            raise TrackingError(
                f"tracking.backends has 'wandb' but the wandb package is not installed: {INSTALL}, "
                "or drop it from tracking.backends"
            ) from None
        run_name = t.run_name or run.name
        try:
            self.run = wandb.init(
                mode=t.wandb_mode,
                dir=str(root),
                project=t.project,
                entity=t.wandb_entity or None,
                id=series_id(root, run.name, index),
                resume="allow",
                group=run_name,
                name=f"{run_name}/drafter-{index}",
                job_type="drafter",
                tags=list(t.tags),
                config={**tomllib.loads(run.config_text), "fingerprint": run.fingerprint},
                settings=wandb.Settings(
                    silent=True,
                    console="off",
                    disable_git=True,
                    save_code=False,
                    x_disable_stats=True,
                    x_disable_machine_info=True,
                ),
            )
        except wandb.errors.UsageError as e:
            hint = (
                'set a key (`wandb login` or WANDB_API_KEY) or tracking.wandb_mode = "offline"'
                if t.wandb_mode == "online"
                else "check tracking.project, tracking.wandb_entity and tracking.dir"
            )
            raise TrackingError(f"tracking: W&B cannot start with wandb_mode = {t.wandb_mode!r}: {e}; {hint}") from None
        except wandb.errors.Error as e:
            raise TrackingError(
                f"tracking: W&B cannot start ({e}): check tracking.wandb_mode, tracking.project and "
                "tracking.wandb_entity, or drop 'wandb' from tracking.backends"
            ) from None
        # Offline, what the killed drafter's run files kept (wandb writes them every ~15 s); online, the server
        # has what was streamed.
        self.kept = None
        if resume_after is not None and t.wandb_mode == "offline":
            from dflash_ring.consumer.reporting.wandb_offline import last_step

            self.kept = last_step(root / "wandb", series_id(root, run.name, index))

    def log(self, step: int, record: dict[str, float]) -> None:
        self.run.log(record, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflow:
    name = "mlflow"

    def __init__(self, t: TrackingConfig, root: Path, index: int, resume_after: int | None, run: RunRecord):
        uri = t.mlflow_tracking_uri or (root / "mlruns").absolute().as_uri()
        if uri.startswith("file:") or "://" not in uri:
            # MLflow 3 keeps its file store in maintenance and asks for this opt-in; a local store needs no server.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")  # an unreachable server fails in seconds
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        try:
            from mlflow.entities import Metric
            from mlflow.exceptions import MlflowException
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise TrackingError(
                f"tracking.backends has 'mlflow' but mlflow is not installed: {INSTALL}, or drop it "
                "from tracking.backends"
            ) from None
        self.Metric = Metric
        sid, run_name = series_id(root, run.name, index), t.run_name or run.name
        try:
            self.client = MlflowClient(tracking_uri=uri)
            experiment = self._experiment(t.project, MlflowException)
            found = self.client.search_runs([experiment], filter_string=f"tags.`dflash_ring.series` = '{sid}'")
            self.kept = None
            if found:
                self.run_id = found[0].info.run_id
                self.client.update_run(self.run_id, status="RUNNING")
                # A drafter killed between its record line and this store's write left that step out.
                self.kept = max((m.step for m in self.client.get_metric_history(self.run_id, "loss")), default=0)
            else:
                tags = {
                    "dflash_ring.series": sid,
                    "dflash_ring.run": run.name,
                    "dflash_ring.drafter": str(index),
                    "fingerprint": run.fingerprint,
                    **{tag: "" for tag in t.tags},
                }
                self.run_id = self.client.create_run(
                    experiment, tags=tags, run_name=f"{run_name}/drafter-{index}"
                ).info.run_id
                self.client.log_text(self.run_id, run.config_text, "config.toml")
        except Exception as e:  # MlflowException, or the HTTP client's own errors for an unreachable server
            raise TrackingError(
                f"tracking.mlflow_tracking_uri = {uri!r}: MLflow cannot start there "
                f"({' '.join(str(e).split())[:300]}): check the URI or the server, or drop 'mlflow' "
                "from tracking.backends"
            ) from None

    def _experiment(self, name: str, MlflowException: type) -> str:
        if (e := self.client.get_experiment_by_name(name)) is not None:
            return e.experiment_id
        try:
            return self.client.create_experiment(name)
        except MlflowException:  # the other drafter created it first
            return self.client.get_experiment_by_name(name).experiment_id

    def log(self, step: int, record: dict[str, float]) -> None:
        ms = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self.Metric(k, float(v), ms, step) for k, v in record.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


BACKENDS = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}


def check_tracking_dir(root: Path) -> Path:
    """The tracking directory (`Config.tracking_dir()`), made if missing; one line naming it when it cannot be. A
    drafter checks it before it builds its model: it opens `Tracking` only once its index's seat is its own (another
    process may be writing its series)."""
    try:
        root = check_output_dir(root)
        root.mkdir(parents=True, exist_ok=True)
    except (OutputDirError, OSError) as e:
        raise TrackingError(f"tracking.dir: {e}") from None
    return root


class Tracking:
    """One drafter's sink for logged records: its record file, then its trackers (see the module docstring)."""

    def __init__(self, tracking: TrackingConfig, root: Path, index: int, run: RunRecord):
        root = check_tracking_dir(root)
        self.record = RecordFile(
            record_path(root, index),
            {
                "series": "config",
                "run": run.name,
                "drafter": index,
                "fingerprint": run.fingerprint,
                "config": run.config_text,
            },
        )
        resume_after = None if self.record.fresh else self.record.last.get(TRAIN, 0)
        self.backends: list[Backend] = []
        try:
            for name in tracking.backends:
                self.backends.append(BACKENDS[name](tracking, root, index, resume_after, run))
        except BaseException:
            self.close()
            raise
        if resume_after is not None:
            for b in list(self.backends):
                if b.kept is not None:
                    self._send(b, [x for x in self.record.logged if x["step"] > b.kept])
            log.info(
                "tracking: drafter %d's series resume after step %d (%s)",
                index,
                resume_after,
                ", ".join(f"{b.name}{'' if b.kept is None else f' had {b.kept}'}" for b in self.backends)
                or "record file only",
            )

    def emit(self, step: int, record: dict[str, float]) -> bool:
        """One logged step's record, once per series: a restarted drafter's steps up to its last logged one are
        in the series already. Whether it was written (False: that series has this step)."""
        series = series_of(record)
        if step <= self.record.last.get(series, 0):
            return False
        self.record.write(step, series, record)
        for b in list(self.backends):
            self._send(b, [{"step": step, **record}])
        return True

    def _send(self, b: Backend, lines: list[dict[str, Any]]) -> None:
        step = 0
        try:
            for line in lines:
                step = line["step"]
                b.log(step, {k: v for k, v in line.items() if k not in ("step", "series", "time")})
        except Exception as e:  # a tracker's own failure, whatever its kind: training goes on without it
            log.warning(
                "tracking: %s failed at step %d (%s); it is dropped for the rest of this run, training "
                "goes on (the record file %s keeps every step)",
                b.name,
                step,
                " ".join(str(e).split())[:300] or type(e).__name__,
                self.record.f.name,
            )
            self.backends.remove(b)

    def close(self) -> None:
        for b in self.backends:
            try:
                b.close()
            except Exception as e:
                log.warning("tracking: closing %s failed (%s)", b.name, e)
        self.backends = []
        self.record.close()

    def __enter__(self) -> Tracking:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
