"""`dflash-ring run` as a newcomer sees it: one config writer, progress from the ring and /metrics, a table
that agrees with the drafters' own final lines, and logs free of progress-bar fragments."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from support import build_target, cyclic_rows, free_port_base, load_tokenizer, tensorboard_scalars

from dflash_ring.common.config.dump import dump_toml
from dflash_ring.common.config.load import load_config
from dflash_ring.common.config.schema import Config
from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.common.lifecycle.resume_state import CursorFile, cursor_path
from dflash_ring.tools.launcher import embedded_run_config

DONE = re.compile(r"drafter-(\d) \| .*drafter \d done: (\d+) steps, (\d+) items")
STEP = re.compile(r"drafter-(\d) \| .* step (\d+)/(\d+) loss")


def test_embedded_config_is_written_by_the_one_writer_and_reads_back(tmp_path):
    cfg = embedded_run_config(tmp_path / "work", tmp_path / "tiny-target", mask_token_id=642, data=tmp_path / "replies")
    text = dump_toml(cfg, header="the embedded default")
    (tmp_path / "run.toml").write_text(text)
    assert load_config(tmp_path / "run.toml") == cfg
    assert re.findall(r"^\[(\w+)\]$", text, re.M) == ["run", "ring", "data", "target", "drafter", "train", "tracking"]
    assert len(text.splitlines()) < 40  # what the run sets, not 80 lines of defaults
    assert "layer_types" not in text  # derived from num_hidden_layers: an edited copy stays consistent


def _launcher_config(tmp_path) -> Config:
    target = build_target(tmp_path / "target", "qwen3", layers=4)
    d = Config()
    return Config(
        run=replace(d.run, name=f"launch{os.getpid()}", run_dir=str(tmp_path / "locks"), attach_timeout_s=60),
        ring=replace(d.ring, slots=4, slot_bytes=4 << 20, slot_header_bytes=64 << 10, wait_s=0.1),
        supervisor=replace(d.supervisor, reap_interval_s=0.1, exit_timeout_s=60),
        data=replace(
            d.data,
            path=str(cyclic_rows(tmp_path / "chat.jsonl", 96)),
            max_length=128,
            max_tokens_per_batch=512,
            epochs=5,
            cache_dir=str(tmp_path / "cache"),
        ),
        target=replace(
            d.target,
            path=str(target),
            mask_token_id=len(load_tokenizer(target)),
            state_dir=str(tmp_path / "state"),
            device="cpu",
        ),
        drafter=DrafterConfig(num_hidden_layers=1, block_size=4, num_anchors=16, loss_gamma=2.0),
        train=replace(
            d.train,
            lr=3e-3,
            warmup_ratio=0.1,
            device="cpu",
            average_every_steps=2,
            checkpoint_dir=str(tmp_path / "ckpt"),
            checkpoint_every_steps=5,
            log_every_steps=1,
        ),
        metrics=replace(d.metrics, port_base=free_port_base()),
        tracking=replace(d.tracking, backends=["tensorboard"]),  # as the embedded default
    )


@pytest.mark.processes
def test_run_reports_exact_totals_and_clean_logs(tmp_path):
    (tmp_path / "run.toml").write_text(dump_toml(_launcher_config(tmp_path)))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("COLUMNS", None)
    out = subprocess.run(
        [sys.executable, "-m", "dflash_ring", "run", "--config", str(tmp_path / "run.toml"), "--no-eval"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=540,
        env=env,
    )
    log = out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "\r" not in log  # no progress-bar fragments from datasets or transformers
    progress = [line for line in log.splitlines() if "progress |" in line]
    assert any("items " in line for line in progress), log[-4000:]
    assert not any("nan" in line for line in progress), progress
    first_items = next(i for i, line in enumerate(progress) if "items " in line)
    assert not any("waiting for the ring" in line for line in progress[first_items:]), progress
    # Each drafter's planned total is exact: its last step line is step N/N with N its final step count,
    # and no line ever counts past its total.
    done = {int(m[1]): (int(m[2]), int(m[3])) for m in DONE.finditer(log)}
    assert sorted(done) == [0, 1], log[-4000:]
    for j, (steps, items) in done.items():
        lines = [(int(m[2]), int(m[3])) for m in STEP.finditer(log) if int(m[1]) == j]
        assert all(step <= total for step, total in lines), lines
        assert lines[-1] == (steps, steps), (j, lines[-5:], steps)
        # The summary table says the same, on one unwrapped line per process (piped: no 80-column wrap).
        rows = [line for line in log.splitlines() if re.match(rf"\W*drafter-{j} [^|]", line)]
        assert len(rows) == 1 and re.match(rf"\W*drafter-{j}\W+0\W+{steps}\W+{items}\W", rows[0]), rows
    header = next(line for line in log.splitlines() if "process" in line and "exit" in line)
    assert "accept_len (last seen)" in header and "tok/s" in header
    # The curves the summary points at: the report picture and TensorBoard's event files, one run per drafter.
    assert f"report: {tmp_path / 'report.png'} (loss and accept length of 2 drafter(s)" in log, log[-2000:]
    assert f"tensorboard --logdir {tmp_path / 'tracking' / 'tensorboard'}" in log
    for j, (steps, _) in done.items():
        assert len(tensorboard_scalars(tmp_path / "tracking" / "tensorboard" / f"drafter-{j}", "loss")) == steps
    print(log[log.index(header) - 400 :])  # the table, for a reader of -s output


@pytest.mark.processes
def test_a_full_disk_under_the_checkpoints_ends_the_run_with_the_drafters_exit_code(tmp_path):
    """A real full disk: train.checkpoint_dir is a 64 KiB tmpfs (mounted in a mount namespace of its own, so
    nothing outlives the test), too small for a drafter's checkpoint. Each drafter exits 2 with one line; the
    launcher, which restarts nobody, then drains the run: it ends, with exit code 2 and a line saying why, instead
    of the supervisor waiting for ever for drafters that are gone; what the ring held goes to the replay lists."""
    as_root = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    if subprocess.run(["unshare", *as_root, "--mount", "true"], capture_output=True).returncode != 0:
        pytest.skip("a full disk needs a tmpfs mount: unshare --mount is not allowed here")
    cfg = _launcher_config(tmp_path)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "run.toml").write_text(dump_toml(replace(cfg, train=replace(cfg.train, checkpoint_every_steps=2))))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    script = (
        f"mount --make-rprivate / && mount -t tmpfs -o size=64k tmpfs {tmp_path / 'ckpt'} && exec "
        f"{sys.executable} -m dflash_ring run --config {tmp_path / 'run.toml'} --no-eval"
    )
    out = subprocess.run(
        ["unshare", *as_root, "--mount", "sh", "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=540,
        env=env,
    )
    log = out.stderr
    assert out.returncode == 2, log[-4000:]
    assert "No space left on device" in log, log[-4000:]
    assert "launcher | every drafter exited (drafter-0 with 2, drafter-1 with 2): the run cannot finish" in log, log[
        -4000:
    ]
    assert not (Path("/dev/shm") / f"dflash-ring.{cfg.run.name}").exists()  # the supervisor tore the ring down
    saved = CursorFile(cursor_path(cfg.target.state_dir, cfg.run.name, 0), "").read()
    assert saved is not None and saved[2].pending_replay, log[-4000:]  # the untrained items, to be produced again


def test_paired_difference_is_over_the_prompts_both_scored():
    from dflash_ring.tools.launcher import paired_difference

    mean, half, n = paired_difference([3.0, 2.0, None, 4.0], [2.0, 2.0, 5.0, 2.0])
    assert (mean, n) == (1.0, 3)
    assert half == pytest.approx(1.96 * 1.0 / 3**0.5)  # differences 1, 0, 2: sample sd 1
    assert paired_difference([3.0, None], [2.0, 2.0]) is None
