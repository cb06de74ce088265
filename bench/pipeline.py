"""`dflash-ring bench pipeline`: a random-weight target and its drafter end to end, against the target alone.

Everything goes through the real paths: the target is saved as an HF checkpoint and loaded by the
producer's loader, the data is a chat JSONL tokenized by the producer's data path, and the
pipeline is the real supervisor, target and drafter processes on a real ring. Figures come from
the processes' own Prometheus metrics (the counters operators graph), read over a steady-state
window after the drafter's first steps (which compile).

  standalone: the same target, data and batches, forward only, in this process, before the pipeline;
  pipeline:   tokens/s trained by the drafter; ratio = pipeline / standalone.

With two GPUs the target runs on cuda:0 and the drafter on cuda:1; with one, both share it.
--kill-drafter then SIGKILLs the drafter, restarts it at once and reports what the target saw.
"""

from __future__ import annotations

import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from dflash_ring.bench.target import time_forward
from dflash_ring.bench.target_shapes import SHAPES
from dflash_ring.common.config import load_config
from dflash_ring.common.metrics import DRAFTER, SUPERVISOR, TARGET, port_of
from dflash_ring.common.drafter_config import build_target_layer_ids
from dflash_ring.producer.batching import ShardBatcher
from dflash_ring.producer.pretokenized import load_tokenized
from dflash_ring.producer.target import TargetModel
from dflash_ring.embedded.tiny_tokenizer import tiny_chat_tokenizer

WORDS = ("the model reads a block of tokens and drafts what comes next while the target checks every guess "
         "so that accepted tokens cost one forward pass instead of many").split()


def _save_random_target(path: Path, shape: dict[str, int], device: torch.device) -> Path:
    """Random weights in the target's dtype, saved like any HF checkpoint, plus a small chat tokenizer."""
    if (path / "config.json").exists():
        return path
    config = Qwen3Config(**shape, tie_word_embeddings=False)
    with torch.device(device):
        model = Qwen3ForCausalLM._from_config(config, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    model.save_pretrained(path)
    del model
    tiny_chat_tokenizer(path)
    return path


def _write_chat_rows(path: Path, rows: int, words: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            reply = " ".join(rng.choice(WORDS) for _ in range(words))
            f.write(json.dumps({"messages": [{"role": "user", "content": "write"},
                                             {"role": "assistant", "content": reply}]}) + "\n")
    return path


def _write_config(work: Path, target: Path, data: Path, *, shape: dict[str, int], tiny: bool, target_device: str,
                  drafter_device: str, port_base: int) -> Path:
    layers = 2 if tiny else 5
    layer_ids = build_target_layer_ids(shape["num_hidden_layers"], layers)
    max_length, max_tokens = (256, 1024) if tiny else (3072, 12288)
    slot_bytes = max_tokens * (len(layer_ids) * shape["hidden_size"] * (4 if tiny else 2) + 32) + (8 << 20)
    path = work / "run.toml"
    path.write_text(f"""[run]
name = "bench-pipeline-{os.getpid()}"
run_dir = "{work / 'locks'}"

[ring]
slots = 4
slot_bytes = {slot_bytes}
slot_header_bytes = 65536

[topology]
producers = 1
consumers = 1

[data]
path = "{data}"
max_length = {max_length}
max_tokens_per_batch = {max_tokens}
epochs = 100
num_proc = {min(8, os.cpu_count() or 1)}
cache_dir = "{work / 'data-cache'}"

[target]
path = "{target}"
layer_ids = {layer_ids}
mask_token_id = {shape['vocab_size'] - 1}
state_dir = "{work / 'state'}"
device = "{target_device}"

[drafter]
num_hidden_layers = {layers}
block_size = {8 if tiny else 16}
num_anchors = {32 if tiny else 512}

[train]
device = "{drafter_device}"
total_steps = 100000
checkpoint_dir = "{work / 'checkpoints'}"
checkpoint_every_steps = 100000
log_every_steps = 20

[metrics]
port_base = {port_base}
""")
    return path


def _standalone(cfg_path: Path, device: torch.device, batches: int) -> dict[str, Any]:
    """The target forward alone over the pipeline's own first batches, through the producer's loader."""
    cfg = load_config(cfg_path)
    tokenizer = AutoTokenizer.from_pretrained(cfg.target.path, local_files_only=True)
    data = load_tokenized(cfg.data, tokenizer)
    target = TargetModel.load(cfg.target, device, packed=True)
    it = ShardBatcher.from_config(data, cfg.data, rank=0, world_size=1).batches()
    plan = [next(it) for _ in range(batches + 2)]
    seconds = time_forward(target, plan[:2], plan[2:])
    tokens = sum(b.num_tokens for b in plan[2:])
    out = {"tokens_per_s": round(tokens / seconds, 1), "batches": batches, "tokens": tokens,
           "mean_sequences": round(sum(len(b.lengths) for b in plan[2:]) / batches, 2)}
    del target
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _scrape(port: int) -> dict[str, float]:
    """Sample name (labels folded in as name{k=v,...}) -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def _wait_for(predicate, timeout: float, what: str, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args[3]} exited with {p.returncode} while waiting for {what}")
        try:
            if predicate():
                return
        except OSError:
            pass  # metrics not served yet
        time.sleep(1.0)
    raise TimeoutError(f"no {what} within {timeout:.0f}s")


def _gpu_util(sample: dict[str, float]) -> float | None:
    values = [v for k, v in sample.items() if k.startswith("dflash_ring_gpu_utilization_ratio")]
    return sum(values) / len(values) if values else None


def _kill_and_restart_drafter(procs: list[subprocess.Popen], cmd: list[str], ports: dict[str, int],
                              log, timeout: float) -> dict[str, Any]:
    """SIGKILL the drafter mid-run, start it again at once (as Restart=on-failure would) and watch the target."""
    before = {role: _scrape(port) for role, port in ports.items()}
    target_pid = procs[1].pid
    procs[2].kill()
    procs[2].wait()
    t_kill = time.monotonic()
    procs[2] = subprocess.Popen(cmd, stderr=log)
    _wait_for(lambda: _scrape(ports[DRAFTER]).get("dflash_ring_drafter_steps_total", 0) >= 1, timeout,
              "a step of the restarted drafter", procs)
    recovered_s = time.monotonic() - t_kill
    after = {role: _scrape(port) for role, port in ports.items()}
    return {
        "drafter_first_step_after_kill_s": round(recovered_s, 1),  # process start, model load, compile
        "target_process_unchanged": procs[1].poll() is None and procs[1].pid == target_pid,
        "target_items_during_outage": after[TARGET].get("dflash_ring_target_items_total", 0)
        - before[TARGET].get("dflash_ring_target_items_total", 0),
        "redelivered_items": after[SUPERVISOR].get("dflash_ring_items_redelivered_total", 0)
        - before[SUPERVISOR].get("dflash_ring_items_redelivered_total", 0),
        "drafter_starts": after[SUPERVISOR].get("dflash_ring_process_starts_total{index=0,role=drafter}"),
        "drafter_resumed_at_step": after[DRAFTER].get("dflash_ring_drafter_step"),
    }


def _pipeline(cfg_path: Path, target_device: str, drafter_device: str, seconds: float,
              warmup_steps: int, work: Path, kill_drafter: bool) -> dict[str, Any]:
    cfg = load_config(cfg_path)
    ports = {role: port_of(cfg.metrics, role, 0) for role in (SUPERVISOR, TARGET, DRAFTER)}
    base = [sys.executable, "-m", "dflash_ring"]
    logs = {name: open(work / f"{name}.log", "w") for name in ("supervisor", "target", "drafter")}
    drafter_cmd = [*base, "drafter", "--config", str(cfg_path), "--index", "0", "--device", drafter_device]
    procs = [
        subprocess.Popen([*base, "supervisor", "--config", str(cfg_path)], stderr=logs["supervisor"]),
        subprocess.Popen([*base, "target", "--config", str(cfg_path), "--index", "0", "--device", target_device],
                         stderr=logs["target"]),
        subprocess.Popen(drafter_cmd, stderr=logs["drafter"]),
    ]
    outage = None
    try:
        _wait_for(lambda: _scrape(ports[DRAFTER]).get("dflash_ring_drafter_steps_total", 0) >= warmup_steps,
                  1200, f"{warmup_steps} drafter steps", procs)
        first = {role: _scrape(port) for role, port in ports.items()}
        t0 = time.monotonic()
        depth, target_util, drafter_util = [], [], []
        while time.monotonic() - t0 < seconds:
            time.sleep(min(2.0, seconds / 10))
            depth.append(_scrape(ports[SUPERVISOR]).get("dflash_ring_depth_items", 0.0))
            target_util.append(_gpu_util(_scrape(ports[TARGET])))
            drafter_util.append(_gpu_util(_scrape(ports[DRAFTER])))
        last = {role: _scrape(port) for role, port in ports.items()}
        dt = time.monotonic() - t0
        if kill_drafter:
            outage = _kill_and_restart_drafter(procs, drafter_cmd, ports, logs["drafter"], 1200)
    finally:
        subprocess.run([*base, "stop", "--now", "--config", str(cfg_path), "--timeout", "120"], capture_output=True)
        for p in procs:
            try:
                p.wait(180)
            except subprocess.TimeoutExpired:
                p.kill()
        subprocess.run([*base, "clean", "--config", str(cfg_path)], capture_output=True)

    def rate(role: str, name: str) -> float:
        return (last[role].get(name, 0.0) - first[role].get(name, 0.0)) / dt

    def mean(xs: list[float | None]) -> float | None:
        xs = [x for x in xs if x is not None]
        return round(sum(xs) / len(xs), 3) if xs else None

    steps = rate(DRAFTER, "dflash_ring_drafter_steps_total") * dt
    step_s = (last[DRAFTER].get("dflash_ring_drafter_step_seconds_sum", 0.0)
              - first[DRAFTER].get("dflash_ring_drafter_step_seconds_sum", 0.0))
    return {
        "window_s": round(dt, 1),
        "drafter_tokens_per_s": round(rate(DRAFTER, "dflash_ring_drafter_tokens_total"), 1),
        "target_tokens_per_s": round(rate(TARGET, "dflash_ring_target_tokens_total"), 1),
        "drafter_steps": int(steps),
        "drafter_step_s": round(step_s / steps, 4) if steps else None,
        "drafter_busy_ratio": round(min(1.0, step_s / dt), 3),  # wall time inside training steps
        "drafter_prefetch_wait_ratio": round(rate(DRAFTER, "dflash_ring_consumer_wait_seconds_total"), 3),
        "producer_blocked_ratio": round(rate(TARGET, "dflash_ring_producer_blocked_seconds_total"), 3),
        "ring_depth_mean": mean(depth),
        "ring_depth_samples": depth,
        "target_gpu_utilization": mean(target_util),
        "drafter_gpu_utilization": mean(drafter_util),
        "exit_codes": [p.returncode for p in procs],
        "drafter_kill": outage,
    }


def run_pipeline_bench(*, tiny: bool = False, seconds: float = 90.0, warmup_steps: int = 0,
                       workdir: str | None = None, port_base: int = 19460, kill_drafter: bool = False) -> dict[str, Any]:
    cuda = torch.cuda.is_available() and not tiny
    gpus = torch.cuda.device_count() if cuda else 0
    target_device = "cuda:0" if cuda else "cpu"
    drafter_device = "cuda:1" if gpus >= 2 else target_device
    shape = SHAPES["qwen3-8b" if cuda else "tiny"][1]
    work = Path(workdir or tempfile.mkdtemp(prefix="dflash-bench-pipeline-"))
    work.mkdir(parents=True, exist_ok=True)
    for stale in ("checkpoints", "state", "locks"):  # a reused workdir keeps its target and data, not its run
        shutil.rmtree(work / stale, ignore_errors=True)
    target = _save_random_target(work / "target", shape, torch.device(target_device))
    data = _write_chat_rows(work / "chat.jsonl", rows=400 if tiny else 2000, words=120 if tiny else 2600)
    cfg_path = _write_config(work, target, data, shape=shape, tiny=not cuda, target_device=target_device,
                             drafter_device=drafter_device, port_base=port_base)
    standalone = _standalone(cfg_path, torch.device(target_device), batches=4 if not cuda else 10)
    pipeline = _pipeline(cfg_path, target_device, drafter_device, seconds, warmup_steps or (3 if not cuda else 8),
                         work, kill_drafter)
    return {
        "benchmark": "pipeline",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
                 "gpus": [torch.cuda.get_device_name(i) for i in range(gpus)]},
        "placement": {"target": target_device, "drafter": drafter_device},
        "model": {"shape": "qwen3-8b" if cuda else "tiny", "target_layers": shape["num_hidden_layers"],
                  "hidden": shape["hidden_size"], "vocab": shape["vocab_size"]},
        "config": str(cfg_path),
        "standalone_target": standalone,
        "pipeline": pipeline,
        "ratio_pipeline_to_standalone_target": round(pipeline["drafter_tokens_per_s"] / standalone["tokens_per_s"], 3),
    }
