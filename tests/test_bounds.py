"""Bounded by the machine, checked before anything starts, in one line (common/host_bounds.py): counts and sizes
that scale processes, threads or memory against what this host has, and the values a command would otherwise take
to a traceback, a segfault or a silent wrong answer (a port no other host can know, NaN in a chart, a device that
holds no data). Each case failed on the code before the rule: accepted, a traceback, or a run that starts."""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import pytest

from dflash_ring.common.refusal import Refusal

CORES = len(os.sched_getaffinity(0))


def _argparse_refusal(capsys, parse, says: str) -> None:
    with pytest.raises(SystemExit) as e:
        parse()
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and says in last, last


# ---------------------------------------------------------------------------------------------------------------------
# Processes and threads against the host's cores.


@pytest.mark.skipif(CORES >= 1024, reason="data.num_proc's own range stops at 1024")
def test_data_num_proc_past_this_hosts_cores_is_refused_by_check_config(capsys):
    from dflash_ring.cli import main

    assert main(["check-config", "--set", f"data.num_proc={CORES + 1}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"data.num_proc = {CORES + 1}" in err and f"{CORES} CPU core" in err, err
    assert main(["check-config", "--set", f"data.num_proc={CORES}"]) == 0


@pytest.mark.skipif(CORES >= 1024, reason="data.num_proc's own range stops at 1024")
def test_data_num_proc_past_the_cores_is_refused_where_a_role_tokenizes():
    from dflash_ring.common.config.data import DataConfig
    from dflash_ring.producer.pretokenized import load_sources

    with pytest.raises(Refusal, match="data.num_proc"):
        load_sources(DataConfig(path="/nonexistent.jsonl", num_proc=CORES + 1), tokenizer=None)


@pytest.mark.parametrize(
    "command", [["eval", "--drafter", "d", "--target", "t", "--data", "x"], ["regenerate"]], ids=["eval", "regenerate"]
)
def test_threads_past_this_hosts_cores_are_argparse_s_refusal(capsys, command):
    """eval --threads 100000 was a segfault inside torch, after the models had loaded."""
    from dflash_ring.cli import main

    _argparse_refusal(capsys, lambda: main([*command, "--threads", "100000"]), f"this host has {CORES} CPU core")
    _argparse_refusal(capsys, lambda: main([*command, "--threads", "-1"]), "must be 0 or more, got -1")


def test_chaos_standbys_and_kills_past_the_runs_processes_and_time_are_refused(tmp_path):
    """--standbys 40 started 40 drafter processes on 2 cores; --kills 100000000 built a schedule of 10^8 kills."""
    from dflash_ring.tools.chaos import ChaosOptions

    def why(**kw) -> str | None:
        return ChaosOptions(**({"kills": 12, "seconds": 60.0, "seed": 0, "workdir": tmp_path} | kw)).refusal()

    assert why() is None and why(standbys=1) is None and why(kills=120, seconds=720.0) is None
    standbys = why(standbys=40)
    assert standbys and "--standbys 40" in standbys and "drafters" in standbys
    kills = why(kills=100_000_000)
    assert kills and "--kills 100000000" in kills and "--seconds 60" in kills
    # The run's own topology counts: one drafter has room for one standby.
    assert why(standbys=2, overrides=["topology.consumers=1"])
    assert why(standbys=1, overrides=["topology.consumers=1"]) is None


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="fp8 may run on this host's GPU")
def test_chaos_refuses_what_its_drafters_would_refuse_up_front(tmp_path):
    """drafter.precision = "fp8" on the CPU: every drafter refused it at its start and was restarted forever."""
    from dflash_ring.tools.chaos import ChaosOptions

    opts = ChaosOptions(kills=12, seconds=60.0, seed=0, workdir=tmp_path, overrides=['drafter.precision="fp8"'])
    assert (opts.refusal() or "").startswith('drafter.precision = "fp8" cannot run here: ')


# ---------------------------------------------------------------------------------------------------------------------
# Sizes against memory, and numbers that must be numbers.


@pytest.mark.parametrize("sizes", ["-1", "nan", "inf", "0", "1,x", "1e12"])
def test_bench_ring_sizes_are_checked_before_anything_is_created(capsys, sizes):
    """-1 or nan was a traceback with the ring's semaphores left in /dev/shm; 1e12 MB, more than any host holds."""
    from dflash_ring.bench.ring import add_arguments

    parser = argparse.ArgumentParser(prog="dflash-ring bench ring")
    add_arguments(parser)
    _argparse_refusal(capsys, lambda: parser.parse_args(["--sizes-mb", sizes]), "argument --sizes-mb")
    assert parser.parse_args(["--sizes-mb", "1,0.5"]).sizes_mb == [1.0, 0.5]


@pytest.fixture(scope="module")
def export_and_target(tmp_path_factory):
    import torch

    from support import save_tiny_qwen3
    from dflash_ring.common.config.drafter import DrafterConfig
    from dflash_ring.consumer.layouts.export import export_drafter
    from dflash_ring.consumer.families.build import build_drafter
    from dflash_ring.consumer.modeling.model import load_target_head

    root = tmp_path_factory.mktemp("bounds")
    target = root / "target"
    save_tiny_qwen3(target, num_hidden_layers=8, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    target_config = json.loads((target / "config.json").read_text())
    torch.manual_seed(0)
    cfg = DrafterConfig(num_hidden_layers=1, block_size=4, loss_gamma=2.0, mask_token_id=250)
    export = export_drafter(build_drafter(cfg, target_config), cfg, target_config, root / "export")
    del load_target_head
    return Path(export), target


@pytest.mark.parametrize("key,value", [("block_size", 10**9), ("vocab_size", 10**12)])
def test_an_exports_block_and_vocabulary_are_checked_against_memory_before_eval_allocates(
    tmp_path, export_and_target, key, value
):
    """block_size 1e9: eval allocated past 3 GB before it failed; now one line before any round is drafted."""
    import shutil

    from dflash_ring.consumer.evaluation.evaluate import evaluate_drafter

    export, target = export_and_target
    big = tmp_path / "export"
    shutil.copytree(export, big)
    config = json.loads((big / "config.json").read_text()) | {key: value}
    (big / "config.json").write_text(json.dumps(config))
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(Refusal) as e:
        evaluate_drafter(big, target, tmp_path / "data.jsonl")
    assert "\n" not in str(e.value) and key in str(e.value) and "memory" in str(e.value), str(e.value)


def test_rendezvous_port_0_is_refused():
    """Port 0: the store serves on a port the kernel picks, which no other host can know."""
    from dflash_ring.common.config.load import load_config
    from dflash_ring.common.config.schema import ConfigError

    for port in (0, 65536, 99999):
        with pytest.raises(ConfigError, match=f"group.rendezvous = 'tcp://127.0.0.1:{port}': the port must be"):
            load_config(None, [f'group.rendezvous="tcp://127.0.0.1:{port}"'])


@pytest.mark.parametrize("out", ["/dev/full", "/dev/null", "fifo", "fifo.png", "dir"])
def test_report_out_that_is_no_regular_file_is_refused(tmp_path, out):
    """--out /dev/full or a FIFO wrote NAME.png beside it (or blocked on the FIFO)."""
    from dflash_ring.tools.report import ReportError, checked_out

    os.mkfifo(tmp_path / "fifo")
    os.mkfifo(tmp_path / "fifo.png")
    (tmp_path / "dir").mkdir()
    path = Path(out) if out.startswith("/") else tmp_path / out
    with pytest.raises(ReportError, match="not a regular file") as e:
        checked_out(path)
    assert str(path) in str(e.value)
    assert checked_out(tmp_path / "new") == tmp_path / "new.png"


@pytest.mark.parametrize("device", ["meta", "cpu:7", "cpu:1"])
def test_a_device_that_holds_no_data_or_does_not_exist_is_refused(device):
    """drafter --device meta or cpu:7 was a SafetensorError traceback from the first load."""
    from dflash_ring.common.device import DeviceError, checked_device

    with pytest.raises(DeviceError, match=f"device '{device}'") as e:
        checked_device(device)
    assert "\n" not in str(e.value)
    assert str(checked_device("cpu")) == "cpu" and str(checked_device("cpu:0")) == "cpu:0"


def _eval_json(path: Path, **changes) -> Path:
    bins = [
        {"lo": b / 10, "hi": (b + 1) / 10, "count": 1, "mean_predicted": b / 10 + 0.05, "observed": 0.5}
        for b in range(10)
    ]
    row = {
        "position": 1,
        "count": 10,
        "observed": 0.5,
        "mean_predicted": 0.5,
        "ece": 0.1,
        "auroc": 0.6,
        "brier": 0.2,
        "bins": bins,
    } | changes
    body = {"tau": 2.0, "calibration": {"bins": 10, "positions": [row], "pooled": dict(row, position=0)}}
    path.write_text(json.dumps(body))  # json writes NaN as NaN, which json.loads reads back
    return path


@pytest.mark.parametrize(
    "changes",
    [{"ece": math.nan}, {"brier": -1e308}, {"count": -1}, {"auroc": math.inf}, {"observed": 2.0}, {"position": -3}],
    ids=["ece-nan", "brier-huge", "count-negative", "auroc-inf", "observed-past-1", "position-negative"],
)
def test_calibration_json_with_values_out_of_their_range_is_refused(tmp_path, changes):
    """NaN or -1e308 were drawn in silence (an empty or absurd reliability diagram)."""
    from dflash_ring.tools.report import ReportError, calibration_of

    assert calibration_of(_eval_json(tmp_path / "ok.json"))
    with pytest.raises(ReportError) as e:
        calibration_of(_eval_json(tmp_path / "bad.json", **changes))
    key = next(iter(changes))
    assert "\n" not in str(e.value) and key in str(e.value), str(e.value)


def test_a_bin_value_out_of_its_range_is_refused(tmp_path):
    from dflash_ring.tools.report import ReportError, calibration_of

    path = _eval_json(tmp_path / "bad.json")
    body = json.loads(path.read_text())
    body["calibration"]["pooled"]["bins"][3]["mean_predicted"] = math.nan
    path.write_text(json.dumps(body))
    with pytest.raises(ReportError, match="mean_predicted"):
        calibration_of(path)
