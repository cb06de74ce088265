"""Trackers (issue 22): a drafter's curves in TensorBoard, W&B (offline) and MLflow (file store), read back with
each library's own reader; a SIGKILLed drafter continues its series; a failing tracker never stops training;
`dflash-ring report` draws what the run recorded."""

from __future__ import annotations

import json
import logging
import re
import shutil
import signal

import numpy as np
import pytest

from dflash_ring.common.config.dump import dump_toml
from dflash_ring.common.config.load import load_config
from dflash_ring.common.config.schema import Config
from dflash_ring.common.ring import fingerprint_digest
from dflash_ring.common.ring_spec import run_fingerprint_fields
from dflash_ring.consumer.reporting.tracking import RunRecord, Tracking, read_records
from dflash_ring.consumer.reporting.wandb_offline import offline_runs
from support import (
    STEP,
    build_target,
    cyclic_rows,
    merged,
    pipeline_settings,
    tensorboard_scalars,
    tensorboard_text,
    wait_exit,
)

ALL = ["tensorboard", "wandb", "mlflow"]
BY_SOURCE = re.compile(r"step (\d+) by source: (.*)")


def tracking_of(cfg: Config, index: int) -> Tracking:
    """Drafter `index`'s Tracking as its process opens it (consumer/training/process.py run_drafter)."""
    run = RunRecord(cfg.run.name, dump_toml(cfg, full=True), fingerprint_digest(run_fingerprint_fields(cfg)).hex())
    return Tracking(cfg.tracking, cfg.tracking_dir(), index, run)


def mlflow_client(store):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=store.absolute().as_uri())


def test_every_backend_holds_the_drafters_series_once_across_a_sigkill_and_the_report_draws_it(run, monkeypatch):
    """One drafter tracks to all three backends; it is SIGKILLed after step 5 trained (crash point "trained",
    before step 5 is logged; its checkpoint is step 3) and restarted: it trains 4 and 5 again, and every backend
    holds steps 1..N exactly once, with the values the drafter logged, in one tracker run."""
    target = build_target(run.tmp / "target", "qwen3", layers=4)
    code, chat = cyclic_rows(run.tmp / "code.jsonl", 48, seed=1), cyclic_rows(run.tmp / "chat.jsonl", 32, seed=2)
    settings = merged(
        pipeline_settings(run.tmp, target, chat),
        {
            "data": {"epochs": 2, "sources": [{"path": str(code)}, {"path": str(chat)}]},
            "train": {"checkpoint_every_steps": 3, "async_checkpoints": False, "average_every_steps": 0},
            "tracking": {"backends": ALL, "tags": ["smoke"]},
        },
    )
    del settings["data"]["path"]  # the two sources instead
    cfg = run.write_config(1, 1, 8, 4 << 20, **settings)
    procs = [run.supervisor(), run.role("target", 0)]
    monkeypatch.setenv("DFLASH_RING_CRASH_AT", "trained@5")
    first = run.role("drafter", 0)
    monkeypatch.delenv("DFLASH_RING_CRASH_AT")
    assert wait_exit(first, 300) == -signal.SIGKILL, first.stderr.read()[-3000:]
    again = run.role("drafter", 0)
    for p in (*procs, again):
        assert wait_exit(p, 300) == 0, p.stderr.read()[-3000:]
    logs = [p.stderr.read() for p in (first, again)]
    logged = {int(m.group(1)): float(m.group(2)) for text in logs for m in STEP.finditer(text)}
    # The per-source losses the drafter computed, as its log lines print them (the restarted drafter's win).
    by_source = {
        (int(m.group(1)), name): float(loss)
        for text in logs
        for m in BY_SOURCE.finditer(text)
        for name, loss in re.findall(r"(\w+): loss ([\d.]+)", m.group(2))
    }

    root = run.tmp / "tracking"  # beside train.checkpoint_dir (run.tmp / "ckpt")
    lines = read_records(root / "drafter-0.jsonl")
    header, records = lines[0], [x for x in lines[1:] if x["series"] == "train"]
    steps = [x["step"] for x in records]
    done = max(logged)
    assert steps == list(range(1, done + 1)) and done > 6, steps  # 4 was trained twice, recorded once
    loss = {x["step"]: x["loss"] for x in records}
    assert all(round(loss[s], 4) == logged[s] for s in range(5, done + 1))  # the restarted drafter's own lines
    assert any(x["producers/tokens_per_s"] > 0 for x in records) and all(x["ring/depth"] >= 0 for x in records)
    # Two sources, each a series of its own in every step that trained one of its rows.
    per_source = {
        name: {x["step"]: x[f"source/{name}/loss"] for x in records if f"source/{name}/loss" in x}
        for name in ("code", "chat")
    }
    assert all(len(series) >= done // 2 for series in per_source.values()), per_source
    assert all(
        round(v, 4) == by_source[(s, name)] for name, series in per_source.items() for s, v in series.items() if s >= 5
    )
    assert header["fingerprint"] == fingerprint_digest(run_fingerprint_fields(cfg)).hex()
    assert load_config_text(header["config"]) == cfg

    tb = tensorboard_scalars(root / "tensorboard" / "drafter-0", "loss")
    assert [s for s, _ in tb] == steps and all(v == np.float32(loss[s]) for s, v in tb)
    assert load_config_text(tensorboard_text(root / "tensorboard" / "drafter-0", "config").strip("`\ntoml")) == cfg
    for name, series in per_source.items():
        tb = tensorboard_scalars(root / "tensorboard" / "drafter-0", f"source/{name}/loss")
        assert [s for s, _ in tb] == sorted(series) and all(v == np.float32(series[s]) for s, v in tb)

    # W&B's own records (wandb's protobuf messages) in its offline run files: one run id for both starts (the
    # killed one's file may hold nothing: wandb writes it every ~15 s, and the restart sent the steps it lacked).
    runs = offline_runs(root / "wandb")
    assert len(runs) == 2 and {r.run_id for r, _ in runs if r is not None} == {runs[-1][0].run_id}
    meta = runs[-1][0]
    assert meta.run_group == run.name and meta.display_name == f"{run.name}/drafter-0" and list(meta.tags) == ["smoke"]
    config = {u.key: json.loads(u.value_json) for u in meta.config.update}
    assert config["fingerprint"] == header["fingerprint"] and config["train"]["checkpoint_every_steps"] == 3
    history = [(row["_step"], row["loss"]) for _, rows in runs for row in rows if "loss" in row]
    assert history == [(s, loss[s]) for s in steps]
    for name, series in per_source.items():
        key = f"source/{name}/loss"
        assert [(row["_step"], row[key]) for _, rows in runs for row in rows if key in row] == sorted(series.items())

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = mlflow_client(root / "mlruns")
    (found,) = client.search_runs([client.get_experiment_by_name("dflash-ring").experiment_id])
    assert found.info.status == "FINISHED" and found.data.tags["fingerprint"] == header["fingerprint"]
    points = sorted((m.step, m.value) for m in client.get_metric_history(found.info.run_id, "loss"))
    assert points == [(s, loss[s]) for s in steps]
    for name, series in per_source.items():
        points = sorted((m.step, m.value) for m in client.get_metric_history(found.info.run_id, f"source/{name}/loss"))
        assert points == sorted(series.items())
    from mlflow.artifacts import load_text

    assert load_text(f"{found.info.artifact_uri}/config.toml") == header["config"]

    out = run.cli("report", str(run.tmp)).stdout
    assert f"{run.tmp / 'report.png'}: loss and accept length of 1 drafter(s) to step {done}" in out, out
    import matplotlib.image

    assert matplotlib.image.imread(run.tmp / "report.png").shape[2] in (3, 4)


def load_config_text(text: str):
    """A logged config, read back by the config reader (equal to the run's: the one writer wrote it whole)."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "c.toml").write_text(text)
        return load_config(Path(d) / "c.toml")


@pytest.mark.processes  # MLflow runs `uname`
def test_a_tracker_failing_mid_run_is_warned_about_once_and_the_rest_go_on(tmp_path, caplog, monkeypatch):
    """MLflow's run loses its metrics directory (a file stands there) after step 2: one warning names it, the
    record file and TensorBoard get every step."""
    cfg = load_config(None, [f'tracking.dir="{tmp_path}"', 'tracking.backends=["tensorboard", "mlflow"]'])
    with tracking_of(cfg, 0) as tracking:
        for step in (1, 2):
            tracking.emit(step, {"loss": 1.0 / step})
        (metrics,) = (tmp_path / "mlruns").glob("*/*/metrics")
        shutil.rmtree(metrics)
        metrics.write_text("not a directory")
        with caplog.at_level(logging.WARNING, logger="dflash_ring.consumer.reporting.tracking"):
            for step in (3, 4, 5):
                tracking.emit(step, {"loss": 1.0 / step})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and re.match(r"tracking: mlflow failed at step 3 .*training goes on", warnings[0])
    assert [s for s, _ in tensorboard_scalars(tmp_path / "tensorboard" / "drafter-0", "loss")] == [1, 2, 3, 4, 5]
    assert [x["step"] for x in read_records(tmp_path / "drafter-0.jsonl")[1:]] == [1, 2, 3, 4, 5]


@pytest.mark.processes  # MLflow runs `uname`, wandb its core service
@pytest.mark.parametrize(
    "setting, says",
    [
        (
            'tracking.dir="{tmp}/afile/x"',
            "tracking.dir: output directory {tmp}/afile/x: {tmp}/afile is not a directory",
        ),
        (
            'tracking.mlflow_tracking_uri="http://127.0.0.1:9"',
            "tracking.mlflow_tracking_uri = 'http://127.0.0.1:9': MLflow cannot start there",
        ),
        (
            'tracking.wandb_mode="online"',
            "tracking: W&B cannot start with wandb_mode = 'online': No API key configured",
        ),
    ],
)
def test_a_tracker_that_cannot_start_is_one_error_naming_its_setting(tmp_path, monkeypatch, setting, says):
    (tmp_path / "afile").write_text("x")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    backend = "wandb" if "wandb" in setting else "mlflow"
    cfg = load_config(
        None, [f'tracking.dir="{tmp_path / "t"}"', f'tracking.backends=["{backend}"]', setting.format(tmp=tmp_path)]
    )
    with pytest.raises(RuntimeError) as e:
        tracking_of(cfg, 0)
    assert str(e.value).startswith(says.format(tmp=tmp_path)) and "\n" not in str(e.value), str(e.value)


def test_no_record_key_is_the_start_of_another():
    """MLflow's file store keeps each key as a path: `accuracy` beside `accuracy/pos_1` would be a file and a
    directory at once (its store then refuses every later step)."""
    from dflash_ring.consumer.reporting.source_metrics import SourceStats
    from dflash_ring.consumer.reporting.step_record import WindowStats, eval_scalars, step_scalars
    from dflash_ring.consumer.training.trainer import StepMetrics

    m = StepMetrics(
        step=1,
        loss=1.0,
        ce=1.0,
        kl=0.0,
        cap=0.0,
        accuracy_per_position=[0.5, 0.25, 0.125],
        accept_len=1.5,
        accept_len_prob=1.4,
        lr=1e-3,
        grad_norm=0.5,
        tokens=10,
        step_s=0.1,
    )
    sources = {"code": SourceStats(2, 9, 1.5, 1.0, 1, 2, 3.0, 2.5), "chat": SourceStats(0, 4)}
    keys = step_scalars(
        m, WindowStats(seconds=1.0, tokens=10, wait_s=0.0, produced=2, produced_tokens=20, depth=1, by_source=sources)
    )
    assert "source/code/accept_len" in keys and "source/chat/tokens" in keys and "source/chat/loss" not in keys
    for record in (keys, eval_scalars(sources, 3)):
        assert not [(a, b) for a in record for b in record if b.startswith(a + "/")]


def test_the_ring_counts_the_tokens_producers_publish(run):
    """The producers' tokens/s in every step record comes from their rows' `tokens`, added at each publish."""
    import torch

    from dflash_ring.common.layout import Counter
    from dflash_ring.common.ring import Ring
    from dflash_ring.common.ring_spec import ring_spec

    cfg = run.write_config(2, 1, slots=4)
    with Ring.create(ring_spec(cfg)) as ring:
        for row, tokens in ((1, 100), (2, 7), (1, 30)):
            w = ring.producer(row).try_acquire()
            w.tensor("x", torch.float32, (4,))
            ring.producer(row).publish(w, tokens=tokens)
        drafter = ring.consumer(3)  # what a drafter's step record reads (consumer/training/ring_input.py: ring_reading)
        assert (drafter.produced_tokens(), ring.counter(Counter.PRODUCED)) == (137, 3)


def test_the_report_draws_each_drafter_and_source_the_records_have(tmp_path):
    """Two drafters' record files with two sources and held-out points: one picture, every series named."""
    import matplotlib.image

    from dflash_ring.tools.report import write_report

    cfg = load_config(None, [f'tracking.dir="{tmp_path / "tracking"}"', "run.name=mix"])
    for j in (0, 1):
        with tracking_of(cfg, j) as tracking:
            for step in range(1, 4 + j):
                tracking.emit(
                    step,
                    {
                        "loss": 3.0 / step,
                        "accept_len": 1 + step / 4,
                        "accept_len_prob": 1 + step / 5,
                        "source/code/loss": 3.5 / step,
                        "source/code/accept_len": 1 + step / 3,
                        "source/chat/loss": 2.5 / step,
                        "source/chat/accept_len": 1 + step / 6,
                    },
                )
            tracking.emit(2, {"eval/loss": 2.0, "eval/accept_len": 1.4})
    out, what = write_report(tmp_path)
    assert out == tmp_path / "report.png" and what == (
        "loss and accept length of 2 drafter(s) to step 3, 4, per source: chat, code"
    )
    height, width, _ = matplotlib.image.imread(out).shape
    assert width > height  # two columns: per drafter, per source


def test_both_panels_draw_one_definition_of_a_windows_value_and_the_held_out_curves(tmp_path):
    """A drafter trained on one source: its per-drafter curve (window/...) and that source's curve are the same
    numbers, the last step's own loss (another value) is not drawn; held-out points appear in both panels."""
    import matplotlib

    from dflash_ring.tools.report import _pyplot, checked_records, figure

    cfg = load_config(None, [f'tracking.dir="{tmp_path / "tracking"}"', "run.name=one"])
    with tracking_of(cfg, 0) as tracking:
        for step in range(1, 5):
            tracking.emit(
                step,
                {
                    "loss": 9.0 + step,
                    "accept_len": 9.0,
                    "window/loss": 3.0 / step,
                    "window/accept_len": 1 + step / 4,
                    "source/code/loss": 3.0 / step,
                    "source/code/accept_len": 1 + step / 4,
                },
            )
        tracking.emit(
            2,
            {
                "eval/loss": 2.0,
                "eval/accept_len": 1.4,
                "eval/source/code/loss": 2.0,
                "eval/source/code/accept_len": 1.4,
            },
        )
    records = {0: checked_records(tmp_path / "tracking" / "drafter-0.jsonl")}
    plt = _pyplot()
    fig, sources = figure(plt, records, "one", tmp_path)
    try:
        assert sources == ["code"] and matplotlib.get_backend().lower() == "agg"
        axes = fig.axes
        lines = {(i, ln.get_label()): list(ln.get_ydata()) for i, ax in enumerate(axes) for ln in ax.get_lines()}
        # axes: [0] per-drafter loss, [1] per-source loss, [2] per-drafter accept length, [3] per-source
        assert lines[(0, "drafter-0")] == lines[(1, "code (drafter-0)")] == [3.0 / s for s in range(1, 5)]
        assert lines[(2, "drafter-0")] == lines[(3, "code (drafter-0)")] == [1 + s / 4 for s in range(1, 5)]
        assert lines[(0, "drafter-0 held-out")] == lines[(1, "code (drafter-0) held-out")] == [2.0]
    finally:
        plt.close(fig)


def test_held_out_sums_wait_in_the_record_file_for_their_evaluation_record(tmp_path):
    """A held-out item's sums, written before its slot is released, are what a restarted drafter reads back as
    pending until an evaluation record covers them; a torn line of a kill mid-write is dropped, not misread."""
    cfg = load_config(None, [f'tracking.dir="{tmp_path / "tracking"}"', "run.name=held"])
    with tracking_of(cfg, 0) as tracking:
        tracking.emit(1, {"loss": 1.0})
        tracking.record.hold_out({"item": "a", "sources": {}})
        tracking.emit(2, {"eval/items": 1.0})
        tracking.record.hold_out({"item": "b", "sources": {}})
        tracking.record.hold_out({"item": "c", "sources": {}})
        assert [x["item"] for x in tracking.record.held_out] == ["b", "c"]
    with open(tmp_path / "tracking" / "drafter-0.jsonl", "ab") as f:
        f.write(b'{"series": "held-out", "it')  # a kill mid-write
    with tracking_of(cfg, 0) as tracking:
        assert [x["item"] for x in tracking.record.held_out] == ["b", "c"]  # after the last evaluation record
        assert not tracking.emit(2, {"eval/items": 2.0})  # its series has step 2: the sums must wait
        assert tracking.emit(3, {"eval/items": 2.0}) and tracking.record.held_out == []
    records = read_records(tmp_path / "tracking" / "drafter-0.jsonl")
    assert [r["step"] for r in records if r.get("series") == "eval"] == [2, 3]
