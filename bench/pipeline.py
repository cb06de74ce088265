"""`dflash-ring bench pipeline`: a random-weight target and its drafter end to end, against each alone.

Everything goes through the real paths: the target is saved as an HF checkpoint and loaded by the
producer's loader, the data is a chat JSONL tokenized by the producer's data path, and the
pipeline is the real supervisor, target and drafter processes on a real ring. Figures come from
the processes' own Prometheus metrics (the counters operators graph), read over a steady-state
window after the drafter's first steps (which compile).

  standalone target (T): the same target, data and batches, forward only, in this process, first;
  standalone drafter (D): the drafter process's own Trainer stepping on those batches' features (made
      by that target), in this process, after its warm-up steps. This is a drafter whose ring is never
      empty, on a device of its own, as T is a target that never waits for a slot. It is measured here
      and not inside the pipeline because there it is not free: on one GPU the drafter's steps share
      the device with the target's forwards, and on 1+1 its rate is bounded by the target's whenever
      the target is the slower. (The pipeline's tokens per second inside steps is reported beside it.)
  pipeline: tokens/s trained by the drafter; ratio = pipeline / standalone target.
  balanced topology: targets and drafters in the ratio D:T keep both busy, so tokens trained per
      GPU-second are 1 / (1/T + 1/D) at any scale; beside it the 1+1 run's pipeline tokens/s divided by
      the GPUs it used (one when both share it).

With two GPUs the target runs on cuda:0 and the drafter on cuda:1; with one, both share it.
--kill-drafter and --kill-target then SIGKILL that process after the window and start it again at
once (as Restart=on-failure would; both: the drafter first). Reported for each: its start-up phases
from its own dflash_ring_startup_seconds, seconds from the kill to its first step or first publish,
each role's tokens/s from the kill to that moment and over as long a stretch just before the kill,
and the goal checks (a drafter's first step within 10 s of its exec; a target's first publish within
its model load + 5 s of the kill). A kill run checkpoints every few steps (`train.checkpoint_every_steps`,
in the report), so the restarted drafter resumes from a checkpoint, as in production.

--standby (with --kill-drafter) adds a second drafter kill after the first, with a warm standby
(`dflash-ring drafter --standby`, on the drafter's device) started, built and waiting beforehand: the first
kill is the same-run baseline (a restart), the second the takeover. The killed drafter is started again at
once there too (systemd would), and finds its index taken: it waits as that drafter's standby. Reported for
the takeover: which process took over, seconds from the kill to the first step of the process that took
over, and its phases after its wait (`standby`): the takeover proper, whose sum is checked against the goal.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import tempfile
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from dflash_ring.common.arguments import non_negative, output_directory, port, seconds
from dflash_ring.bench.progress import progress
from dflash_ring.bench.target_shapes import SHAPES
from dflash_ring.bench.target_timing import time_forward
from dflash_ring.common.config.dump import dump_toml
from dflash_ring.common.config.load import load_config
from dflash_ring.common.config.data import DataConfig
from dflash_ring.common.config.schema import Config
from dflash_ring.common.config.target import TargetConfig
from dflash_ring.common.config.drafter import DrafterConfig, build_target_layer_ids
from dflash_ring.common.layout import Role
from dflash_ring.common.metrics import DRAFTER, SUPERVISOR, TARGET
from dflash_ring.common.ring import Ring
from dflash_ring.consumer.modeling.head_cache import CACHE_NAME as HEAD_CACHE_NAME
from dflash_ring.consumer.training.process import build
from dflash_ring.consumer.training.trainer import DeviceBatch, Trainer
from dflash_ring.embedded.tiny_tokenizer import tiny_chat_tokenizer
from dflash_ring.producer.batching import Batch, ShardBatcher
from dflash_ring.producer.pretokenized import load_tokenized
from dflash_ring.producer.process import prepare, run_target
from dflash_ring.producer.target import TargetModel
from dflash_ring.tools.fleet import Readiness, cli_command, role_command, scrape, spawn, wait_for, wait_for_metrics

WORDS = (
    "the model reads a block of tokens and drafts what comes next while the target checks every guess "
    "so that accepted tokens cost one forward pass instead of many"
).split()


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
            f.write(
                json.dumps(
                    {"messages": [{"role": "user", "content": "write"}, {"role": "assistant", "content": reply}]}
                )
                + "\n"
            )
    return path


def _write_config(
    work: Path,
    target: Path,
    data: Path,
    *,
    shape: dict[str, int],
    tiny: bool,
    target_device: str,
    drafter_device: str,
    port_base: int,
    checkpoint_every: int,
) -> Path:
    """The bench's run as a Config, written by the one writer (dump_toml); its path."""
    layers = 2 if tiny else 5
    layer_ids = build_target_layer_ids(shape["num_hidden_layers"], layers)
    max_length, max_tokens = (256, 1024) if tiny else (3072, 12288)
    slot_bytes = max_tokens * (len(layer_ids) * shape["hidden_size"] * (4 if tiny else 2) + 32) + (8 << 20)
    d = Config()
    cfg = Config(
        run=replace(d.run, name=f"bench-pipeline-{os.getpid()}", run_dir=str(work / "locks")),
        ring=replace(d.ring, slots=4, slot_bytes=slot_bytes, slot_header_bytes=65536),
        topology=replace(d.topology, producers=1, consumers=1),
        data=replace(
            d.data,
            path=str(data),
            max_length=max_length,
            max_tokens_per_batch=max_tokens,
            epochs=100,
            num_proc=min(8, os.cpu_count() or 1),
            cache_dir=str(work / "data-cache"),
        ),
        target=replace(
            d.target,
            path=str(target),
            layer_ids=layer_ids,
            mask_token_id=shape["vocab_size"] - 1,
            state_dir=str(work / "state"),
            device=target_device,
        ),
        drafter=DrafterConfig(
            num_hidden_layers=layers,
            block_size=8 if tiny else 16,  # derives layer_types
            num_anchors=32 if tiny else 512,
        ),
        train=replace(
            d.train,
            device=drafter_device,
            total_steps=100000,
            checkpoint_dir=str(work / "checkpoints"),
            checkpoint_every_steps=checkpoint_every,
            keep_checkpoints=1,
            log_every_steps=20,
        ),
        metrics=replace(d.metrics, port_base=port_base),
    )
    cfg.validate()
    path = work / "run.toml"
    path.write_text(dump_toml(cfg, header="The run of `dflash-ring bench pipeline`."))
    return path


def _fed_batch(target: TargetModel, batch: Batch, device: torch.device) -> DeviceBatch:
    """What a drafter takes out of a slot for `batch`: the target's features and the batch's ids and masks."""
    out = run_target(target, prepare(batch, packed=target.packed, pad_id=0, pin=False))
    return DeviceBatch(  # clones made outside inference mode: the drafter's autograd keeps them for backward
        features=out.features.clone(),
        input_ids=torch.from_numpy(batch.input_ids).to(device, torch.long),
        loss_mask=torch.from_numpy(batch.loss_mask).to(device, torch.bool),
        cu_seqlens=torch.from_numpy(batch.cu_seqlens).to(device, torch.long),
        final_hidden=None if out.final_hidden is None else out.final_hidden.clone(),
    )


def _standalone_target(
    target_cfg: TargetConfig, data_cfg: DataConfig, device: torch.device, batches: int, fed: int
) -> tuple[dict[str, Any], list[DeviceBatch]]:
    """T (module docstring): the target forward alone over the pipeline's own first batches, through the producer's
    loader; and the first `fed` batches as a drafter takes them out of a slot, for D."""
    tokenizer = AutoTokenizer.from_pretrained(target_cfg.path, local_files_only=True)
    data = load_tokenized(data_cfg, tokenizer)
    target = TargetModel.load(target_cfg, device, packed=True)
    if target_cfg.compile and device.type == "cuda":  # as the producer runs it (the warm-up batches compile)
        target.compile_layers()
    it = ShardBatcher.from_config(data, data_cfg, rank=0, world_size=1).batches()
    plan = [next(it) for _ in range(max(batches + 2, fed))]
    seconds = time_forward(target, plan[:2], plan[2 : batches + 2])
    timed = plan[2 : batches + 2]
    tokens = sum(b.num_tokens for b in timed)
    report = {
        "tokens_per_s": round(tokens / seconds, 1),
        "batches": batches,
        "tokens": tokens,
        "mean_sequences": round(sum(len(b.lengths) for b in timed) / batches, 2),
    }
    progress("pipeline", "standalone_target", report)
    return report, [_fed_batch(target, b, device) for b in plan[:fed]]


def _standalone_drafter(trainer: Trainer, total_steps: int, fed: list[DeviceBatch], warm: int) -> dict[str, Any]:
    """D (module docstring): the Trainer that consumer/training/process.py's `build` makes, stepped alone on `fed` (its
    first `warm` steps compile), minus the ring."""
    device = trainer.device
    t0 = time.perf_counter()
    for batch in fed[:warm]:  # the first steps compile
        trainer.train_step(batch, total_steps)
    _sync(device)
    t1 = time.perf_counter()
    for batch in fed[warm:]:
        trainer.train_step(batch, total_steps)
    _sync(device)
    seconds = time.perf_counter() - t1
    tokens = sum(b.num_tokens for b in fed[warm:])
    report = {
        "tokens_per_s": round(tokens / seconds, 1),
        "steps": len(fed) - warm,
        "tokens": tokens,
        "step_s": round(seconds / (len(fed) - warm), 4),
        "warmup_steps": warm,
        "warmup_s": round(t1 - t0, 1),
    }
    progress("pipeline", "standalone_drafter", report)
    return report


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _startup(sample: dict[str, float]) -> dict[str, float]:
    """A process's start-up phases (dflash_ring_startup_seconds), in seconds."""
    prefix = "dflash_ring_startup_seconds{phase="
    return {k[len(prefix) : -1]: round(v, 2) for k, v in sample.items() if k.startswith(prefix)}


def _gpu_util(sample: dict[str, float]) -> float | None:
    values = [v for k, v in sample.items() if k.startswith("dflash_ring_gpu_utilization_ratio")]
    return sum(values) / len(values) if values else None


STANDBY = "standby"  # a drafter kill with a warm standby waiting (--standby); its process in PipelineRun.procs
ROLE_OF = {DRAFTER: DRAFTER, STANDBY: DRAFTER, TARGET: TARGET}  # the role each kill kills
TOKENS = {TARGET: "dflash_ring_target_tokens_total", DRAFTER: "dflash_ring_drafter_tokens_total"}
FIRST_WORK = {TARGET: "first_publish", DRAFTER: "first_step"}  # the last start-up phase: doing its work again
KILL_TIMEOUT_S = 1200.0
KILL_REPORT = {DRAFTER: "drafter_kill", STANDBY: "drafter_kill_with_standby", TARGET: "target_kill"}  # report keys


class PipelineRun:
    """The supervisor, target and drafter processes of one run (tools/fleet.py), and their scrapes over time."""

    def __init__(self, cfg_path: Path, target_device: str, drafter_device: str, work: Path):
        self.cfg_path, self.work = cfg_path, work
        cfg = load_config(cfg_path)
        self.run_name, self.metrics = cfg.run.name, cfg.metrics
        self.latest_checkpoint = Path(cfg.train.checkpoint_dir) / "drafter-0" / "latest"
        self.devices = {SUPERVISOR: None, TARGET: target_device, DRAFTER: drafter_device, STANDBY: drafter_device}
        for role in self.devices:  # each log holds this run's starts of its process, one after the other
            (work / f"{role}.log").unlink(missing_ok=True)
        self.procs = {role: self._start(role) for role in (SUPERVISOR, TARGET, DRAFTER)}
        self.history: list[tuple[float, dict[str, dict[str, float]]]] = []  # (monotonic, scrape per role)

    def _start(self, role: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        name = role if role == SUPERVISOR else f"{role}-0"
        return spawn(role_command(name, self.cfg_path, device=self.devices[role]), self.work / f"{role}.log", env, name)

    def scrape(self, role: str) -> dict[str, float]:
        if (sample := scrape(self.metrics, role, 0, timeout_s=5.0)) is None:
            raise RuntimeError(f"the {role}'s /metrics did not answer (its log: {self.work / f'{role}.log'})")
        return sample

    def sample(self) -> dict[str, dict[str, float]]:
        scrapes = {role: self.scrape(role) for role in (SUPERVISOR, TARGET, DRAFTER)}
        self.history.append((time.monotonic(), scrapes))
        return scrapes

    def wait_steps(self, steps: int) -> None:
        wait_for_metrics(
            self.metrics,
            DRAFTER,
            0,
            lambda s: s.get("dflash_ring_drafter_steps_total", 0) >= steps,
            KILL_TIMEOUT_S,
            f"{steps} drafter steps",
            self.procs,
        )

    def watch(self, seconds: float) -> None:
        """Scrape every process every ~2 s for `seconds`."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            time.sleep(min(2.0, seconds / 10))
            self.sample()

    def start_standby(self) -> None:
        """A warm standby for the drafter, waiting (built and attached: its READY=1, as systemd would read it) when
        this returns."""
        readiness = Readiness()
        try:
            self.procs[STANDBY] = self._start(STANDBY, readiness.env())
            wait_for(readiness.ready, KILL_TIMEOUT_S, "the standby to wait", self.procs)
        finally:
            readiness.close()

    def drafter_seat_holder(self) -> int | None:
        """The pid in drafter 0's ring row, as the process that holds the seat wrote it when it joined."""
        with Ring.open(self.run_name) as ring:
            rows = ring.status().rows
        return next(
            (row["pid"] for row in rows if row["role"] == Role.CONSUMER.name.lower() and row["index"] == 0), None
        )

    def kill_and_restart(self, role: str, standby: bool = False) -> dict[str, Any]:
        """SIGKILL `role`, start it again at once (Restart=on-failure), wait for its first work; what everyone saw.
        With `standby`, a warm standby waits beside the drafter before the kill (the module docstring)."""
        other = TARGET if role == DRAFTER else DRAFTER
        other_pid = self.procs[other].pid
        if standby:
            self.start_standby()
        if role == DRAFTER:  # a restart that resumes: its checkpoint load is part of what is measured
            wait_for(self.latest_checkpoint.exists, KILL_TIMEOUT_S, "a durable drafter checkpoint", self.procs)
        pre = self.sample()
        t_pre = time.monotonic()
        self.procs[role].kill()
        self.procs[role].wait()
        t_kill = time.monotonic()
        self.procs[role] = self._start(role)
        wait_for_metrics(
            self.metrics,
            role,
            0,
            lambda s: FIRST_WORK[role] in _startup(s),
            KILL_TIMEOUT_S,
            f"the restarted {role}'s {FIRST_WORK[role].replace('_', ' ')}",
            self.procs,
            poll_s=0.1,
        )
        outage_s = time.monotonic() - t_kill
        after = self.sample()
        # Tokens from the kill to its recovery: the restarted process counts from 0, the other process on.
        during = {
            role: after[role].get(TOKENS[role], 0.0),
            other: after[other].get(TOKENS[other], 0.0) - pre[other].get(TOKENS[other], 0.0),
        }
        t_then, then = self._before(t_pre - outage_s)
        before_s = t_pre - t_then
        phases = _startup(after[role])
        sup_before, sup_after = pre[SUPERVISOR], after[SUPERVISOR]
        report: dict[str, Any] = {
            "startup_phases_s": phases,
            "startup_s": round(sum(phases.values()), 2),  # exec to first work
            f"{FIRST_WORK[role]}_after_kill_s": round(outage_s, 2),
            "tokens_per_s_from_kill_to_recovery": {r: round(during[r] / outage_s, 1) for r in (TARGET, DRAFTER)},
            "tokens_per_s_before_kill": {
                r: round((pre[r].get(TOKENS[r], 0.0) - then[r].get(TOKENS[r], 0.0)) / before_s, 1)
                if before_s > 0
                else None
                for r in (TARGET, DRAFTER)
            },
            "before_kill_window_s": round(before_s, 1),
            f"{other}_process_unchanged": self.procs[other].poll() is None and self.procs[other].pid == other_pid,
            "redelivered_items": sup_after.get("dflash_ring_items_redelivered_total", 0)
            - sup_before.get("dflash_ring_items_redelivered_total", 0),
            f"{role}_starts": sup_after.get(f"dflash_ring_process_starts_total{{index=0,role={role}}}"),
        }
        if standby:  # the port is the index's: after a takeover, the standby's phases (its wait among them)
            took_over = self.drafter_seat_holder() == self.procs[STANDBY].pid
            takeover = dict(list(phases.items())[list(phases).index("standby") + 1 :])
            report |= {
                "took_over_by": "standby" if took_over else "restarted drafter",
                "standby_wait_s": phases.get("standby"),
                "takeover_phases_s": takeover,
                "startup_s": round(sum(takeover.values()), 2),
            }
        if role == DRAFTER:
            step = int(after[DRAFTER].get("dflash_ring_drafter_step", 0))  # set by its first optimizer step
            report |= {
                "step_at_kill": int(pre[DRAFTER].get("dflash_ring_drafter_step", 0)),
                "resumed_at_step": step - 1 if step else None,
                "resumed_from_checkpoint": step > 1,
            }
            if standby:
                report["goal"] = {"check": "first_step_after_kill_s <= 10", "met": outage_s <= 10.0}
            else:
                report |= {
                    "first_step_after_restart_s": report["startup_s"],
                    "goal": {"check": "first_step_after_restart_s <= 10", "met": report["startup_s"] <= 10.0},
                }
        else:
            model_s = phases.get("model", 0.0)
            report |= {
                "model_load_s": model_s,
                "goal": {"check": "first_publish_after_kill_s <= model_load_s + 5", "met": outage_s <= model_s + 5.0},
            }
        self.history = [self.history[-1]]  # what follows the recovery is measured from here
        return report

    def _before(self, t: float) -> tuple[float, dict[str, dict[str, float]]]:
        """The latest scrape at or before monotonic time t (else the earliest kept)."""
        earlier = [h for h in self.history if h[0] <= t]
        return earlier[-1] if earlier else self.history[0]

    def stop(self) -> None:
        subprocess.run(cli_command("stop", "--now", "--timeout", "120", config=self.cfg_path), capture_output=True)
        for p in self.procs.values():
            try:
                p.wait(180)
            except subprocess.TimeoutExpired:
                p.kill()
        subprocess.run(cli_command("clean", config=self.cfg_path), capture_output=True)


def _pipeline(
    cfg_path: Path,
    target_device: str,
    drafter_device: str,
    seconds: float,
    warmup_steps: int,
    work: Path,
    kills: list[str],
) -> dict[str, Any]:
    run = PipelineRun(cfg_path, target_device, drafter_device, work)
    outages = {}
    try:
        run.wait_steps(warmup_steps)
        first = run.sample()
        run.watch(seconds)
        figures = _window_figures(first, run.history)
        progress("pipeline", "window", figures)
        for i, role in enumerate(kills):
            if i:  # settle after the previous recovery, so the next before-kill window is steady again
                previous = outages[kills[i - 1]]
                run.watch(max(10.0, previous[f"{FIRST_WORK[ROLE_OF[kills[i - 1]]]}_after_kill_s"]))
            outages[role] = run.kill_and_restart(ROLE_OF[role], standby=role == STANDBY)
            progress("pipeline", KILL_REPORT[role], outages[role])
    finally:
        run.stop()
    return {
        **figures,
        "exit_codes": {role: p.returncode for role, p in run.procs.items()},
        **{KILL_REPORT[role]: outages.get(role) for role in (DRAFTER, STANDBY, TARGET)},
    }


def _window_figures(
    first: dict[str, dict[str, float]], history: list[tuple[float, dict[str, dict[str, float]]]]
) -> dict[str, Any]:
    """The steady-state window's figures, from its first scrape and the ones that followed it."""
    last = history[-1][1]
    dt = history[-1][0] - history[0][0]
    window = [scrape for _, scrape in history[1:]]

    def rate(role: str, name: str) -> float:
        return (last[role].get(name, 0.0) - first[role].get(name, 0.0)) / dt

    def mean(xs: list[float | None]) -> float | None:
        xs = [x for x in xs if x is not None]
        return round(sum(xs) / len(xs), 3) if xs else None

    steps = rate(DRAFTER, "dflash_ring_drafter_steps_total") * dt
    step_s = last[DRAFTER].get("dflash_ring_drafter_step_seconds_sum", 0.0) - first[DRAFTER].get(
        "dflash_ring_drafter_step_seconds_sum", 0.0
    )
    return {
        "window_s": round(dt, 1),
        "drafter_tokens_per_s": round(rate(DRAFTER, TOKENS[DRAFTER]), 1),
        "target_tokens_per_s": round(rate(TARGET, TOKENS[TARGET]), 1),
        "drafter_steps": int(steps),
        "drafter_step_s": round(step_s / steps, 4) if steps else None,
        # Tokens over the time spent inside steps: the drafter's rate with every wait for the ring removed (on a
        # shared GPU its steps still compete with the target's forwards).
        "drafter_tokens_per_s_inside_steps": round(rate(DRAFTER, TOKENS[DRAFTER]) * dt / step_s, 1) if step_s else None,
        "drafter_busy_ratio": round(min(1.0, step_s / dt), 3),  # wall time inside training steps
        "drafter_prefetch_wait_ratio": round(rate(DRAFTER, "dflash_ring_consumer_wait_seconds_total"), 3),
        "producer_blocked_ratio": round(rate(TARGET, "dflash_ring_producer_blocked_seconds_total"), 3),
        "ring_depth_mean": mean([s[SUPERVISOR].get("dflash_ring_depth_items") for s in window]),
        "ring_depth_samples": [s[SUPERVISOR].get("dflash_ring_depth_items", 0.0) for s in window],
        "target_gpu_utilization": mean([_gpu_util(s[TARGET]) for s in window]),
        "drafter_gpu_utilization": mean([_gpu_util(s[DRAFTER]) for s in window]),
    }


def balanced_topology(target_tps: float, drafter_tps: float, pipeline_tps: float, devices: int) -> dict[str, Any]:
    """Tokens trained per GPU-second when targets and drafters run in the ratio of their speeds (module docstring),
    against what the measured 1+1 run reached per device it used."""
    balanced = 1.0 / (1.0 / target_tps + 1.0 / drafter_tps)
    measured = pipeline_tps / devices
    return {
        "target_tokens_per_s": target_tps,
        "drafter_tokens_per_s": drafter_tps,
        "drafters_per_target": round(
            target_tps / drafter_tps, 2
        ),  # the recommended topology, targets:drafters = 1:this
        "balanced_tokens_per_gpu_s": round(balanced, 1),
        "one_plus_one_devices": devices,
        "one_plus_one_tokens_per_device_s": round(measured, 1),
        "ratio_one_plus_one_to_balanced": round(measured / balanced, 3),
    }


def run_pipeline_bench(
    *,
    tiny: bool = False,
    seconds: float = 90.0,
    warmup_steps: int = 0,
    workdir: str | None = None,
    port_base: int = 19460,
    kill_drafter: bool = False,
    kill_target: bool = False,
    standby: bool = False,
) -> dict[str, Any]:
    cuda = torch.cuda.is_available() and not tiny
    gpus = torch.cuda.device_count() if cuda else 0
    target_device = "cuda:0" if cuda else "cpu"
    drafter_device = "cuda:1" if gpus >= 2 else target_device
    shape = SHAPES["qwen3-8b" if cuda else "tiny"][1]
    if standby and not kill_drafter:
        raise RuntimeError("--standby measures a drafter kill's takeover: add --kill-drafter")
    kills = [role for role, on in ((DRAFTER, kill_drafter), (STANDBY, standby), (TARGET, kill_target)) if on]
    work = Path(workdir or tempfile.mkdtemp(prefix="dflash-bench-pipeline-"))
    work.mkdir(parents=True, exist_ok=True)
    for stale in ("checkpoints", "state", "locks"):  # a reused workdir keeps its target and data, not its run
        shutil.rmtree(work / stale, ignore_errors=True)
    target = _save_random_target(work / "target", shape, torch.device(target_device))
    data = _write_chat_rows(work / "chat.jsonl", rows=400 if tiny else 2000, words=120 if tiny else 2600)
    # A kill run checkpoints often enough that the restarted drafter resumes from one (a checkpoint of the
    # Qwen3-8B-shaped drafter with its optimizer is ~12 GB: every 50 steps is about every 30 s on an H200).
    checkpoint_every = (5 if not cuda else 50) if DRAFTER in kills else 100000
    cfg_path = _write_config(
        work,
        target,
        data,
        shape=shape,
        tiny=not cuda,
        target_device=target_device,
        drafter_device=drafter_device,
        port_base=port_base,
        checkpoint_every=checkpoint_every,
    )
    cfg, device = load_config(cfg_path), torch.device(target_device)
    warm, timed = (1, 4) if not cuda else (4, 8)  # the drafter's steps alone: compiling, then timed
    standalone_target, fed = _standalone_target(
        cfg.target, cfg.data, device, batches=4 if not cuda else 10, fed=warm + timed
    )
    built = build(
        cfg.drafter,
        cfg.target,
        cfg.train,
        cfg.data.source_names(),
        cfg.run.compile_cache_dir,
        device,
        work / "standalone" / HEAD_CACHE_NAME,
    )  # as the drafter process builds it
    standalone_drafter = _standalone_drafter(built.trainer, cfg.train.total_steps, fed, warm)
    del built, fed
    if device.type == "cuda":
        torch.cuda.empty_cache()
    pipeline = _pipeline(
        cfg_path, target_device, drafter_device, seconds, warmup_steps or (3 if not cuda else 8), work, kills
    )
    balanced = balanced_topology(
        standalone_target["tokens_per_s"],
        standalone_drafter["tokens_per_s"],
        pipeline["drafter_tokens_per_s"],
        len({target_device, drafter_device}),
    )
    progress("pipeline", "balanced_topology", balanced)
    return {
        "benchmark": "pipeline",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": {
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "gpus": [torch.cuda.get_device_name(i) for i in range(gpus)],
        },
        "placement": {"target": target_device, "drafter": drafter_device},
        "model": {
            "shape": "qwen3-8b" if cuda else "tiny",
            "target_layers": shape["num_hidden_layers"],
            "hidden": shape["hidden_size"],
            "vocab": shape["vocab_size"],
        },
        "config": str(cfg_path),
        "checkpoint_every_steps": checkpoint_every,
        "standalone_target": standalone_target,
        "standalone_drafter": standalone_drafter,
        "pipeline": pipeline,
        "ratio_pipeline_to_standalone_target": round(
            pipeline["drafter_tokens_per_s"] / standalone_target["tokens_per_s"], 3
        ),
        "balanced_topology": balanced,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`dflash-ring bench pipeline`'s own options (cli.py registers every bench by name, and hands it the rest)."""
    parser.add_argument("--json", action="store_true", help="print the JSON report (the default output)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (a smoke run)")
    parser.add_argument("--seconds", type=seconds, default=90.0, help="steady-state window measured")
    parser.add_argument(
        "--warmup-steps", type=non_negative, default=0, help="drafter steps before the window (0: 8, tiny 3)"
    )
    parser.add_argument(
        "--workdir",
        type=output_directory,
        help="where the target, data and logs go (default: a new temporary directory)",
    )
    parser.add_argument("--port-base", type=port, default=19460, help="metrics ports of the bench's processes")
    parser.add_argument(
        "--kill-drafter",
        action="store_true",
        help="after the window: SIGKILL the drafter, restart it; its start-up and everyone's tokens/s",
    )
    parser.add_argument(
        "--kill-target",
        action="store_true",
        help="after the window (and a drafter kill): SIGKILL the target, restart it; likewise",
    )
    parser.add_argument(
        "--standby",
        action="store_true",
        help="with --kill-drafter: a second drafter kill with a warm standby waiting (the first is the "
        "restart baseline); kill to the first step of the process that took over, its phases",
    )


def main(args: argparse.Namespace) -> int:
    report = run_pipeline_bench(
        tiny=args.tiny,
        seconds=args.seconds,
        warmup_steps=args.warmup_steps,
        workdir=args.workdir,
        port_base=args.port_base,
        kill_drafter=args.kill_drafter,
        kill_target=args.kill_target,
        standby=args.standby,
    )
    print(json.dumps(report, indent=2))
    return 0
