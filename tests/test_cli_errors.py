"""Bad invocations get one line on stderr that says what is wrong, no traceback, exit 2 (issue 14 item 12)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_ring.common.config import load_config
from dflash_ring.common.ring import Ring

NO_METRICS = ["--set", "metrics.enabled=false"]


def _foreign_ring(tmp: Path, name: str) -> list[str]:
    """A ring of this run name whose segment belongs to another user."""
    Ring.create(load_config(None, [f"run.name={name}", "ring.slots=1", "ring.slot_bytes=8192",
                                   "ring.slot_header_bytes=4096"])).close()
    os.chown(f"/dev/shm/dflash-ring.{name}", 65534, 65534)
    return []


def _model_dir_without_weights(tmp: Path, name: str) -> list[str]:
    d = tmp / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 6, "vocab_size": 100,
        "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 128, "head_dim": 32}))
    return ["--set", f'target.path="{d}"']


def _a_file(tmp: Path, name: str) -> list[str]:
    (tmp / "afile").write_text("x")
    return []


# (id, setup(tmp, run) -> extra args, argv with {run} and {tmp}, what the line must say)
CASES = [
    ("status-invalid-name", None, ["status", ".."], "is not allowed"),
    ("clean-invalid-name", None, ["clean", "a/../b"], "is not allowed"),
    ("stop-missing-run", None, ["stop", "{run}", "--timeout", "1"], "no ring for run"),
    ("status-foreign-run", _foreign_ring, ["status", "{run}"], "belongs to uid 65534"),
    ("clean-foreign-run", _foreign_ring, ["clean", "{run}"], "belongs to uid 65534"),
    ("missing-config", None, ["status", "--config", "{tmp}/nope.toml"], "does not exist"),
    ("export-unwritable", _a_file, ["export", "{tmp}/ckpt", "{tmp}/afile/out"], "is not a directory"),
    ("export-no-checkpoint", None, ["export", "{tmp}/ckpt", "{tmp}/out"], "no complete checkpoint"),
    ("target-index-out-of-range", None, ["target", "--index", "3", *NO_METRICS], "--index 3 is out of range"),
    ("drafter-index-out-of-range", None, ["drafter", "--index", "-1", *NO_METRICS], "--index -1 is out of range"),
    ("drafter-no-target", None, ["drafter", "--index", "0", *NO_METRICS], "target.path is empty"),
    ("drafter-model-without-weights", _model_dir_without_weights, ["drafter", "--index", "0", *NO_METRICS],
     "no model.safetensors"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_invocation_is_one_line_exit_2(tmp_path, case):
    ident, setup, argv, says = case
    if setup is _foreign_ring and os.geteuid() != 0:
        pytest.skip("needs root to hand a segment to another uid")
    name = f"e{os.getpid()}-{ident[:20]}"
    try:
        extra = setup(tmp_path, name) if setup else []
        args = [a.format(run=name, tmp=tmp_path) for a in argv] + extra
        if args[0] in ("target", "drafter"):
            args += ["--set", f"run.name={name}", "--set", "run.attach_timeout_s=0"]
        out = subprocess.run([sys.executable, "-m", "dflash_ring", *args], cwd=tmp_path, capture_output=True,
                             text=True, timeout=120)
    finally:
        for p in Path("/dev/shm").glob(f"*dflash-ring.{name}*"):
            p.unlink()
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and "Traceback" not in out.stderr and len(lines) == 1, (out.returncode, out.stderr)
    assert lines[0].startswith(f"dflash-ring {args[0]}: error: ") and says in lines[0], lines[0]
