"""A target sharded over N ranks of one host by transformers' own tensor parallelism: one producer to the ring.

    leader (rank 0) = the producer process: data, ring row, cursor, replay list, ledger, metrics
        | starts ranks 1..N-1 (`python -m dflash_ring.producer.tensor_rank`), holds their rendezvous (a FileStore
        | in a private directory: no port), joins one torch.distributed group with them: NCCL on GPUs, gloo on the CPU
    every rank: `from_pretrained(..., tp_plan="auto")`: transformers shards the linears by the family's own
        base_model_tp_plan (DTensor; never a sharding of ours), and the decoder is truncated as on one device

Each forward the leader runs (every batch, and each of the conformance probe's) is first broadcast to the ranks:
the packing mode and the model inputs; then all ranks run the same forward, whose collectives meet. A decoder
layer's output is replicated after its row-wise all-reduce, so the leader's captured features are the whole
features; the other ranks only compute and drop theirs. So the group is one producer to the ring: one row, one
cursor, one replay list, the leader's.

Faults. The leader watches its ranks: a rank that exits while the group runs takes the leader down at once (exit
1), and every rank dies with its leader (PR_SET_PDEATHSIG), so the group always stops and restarts as one
(systemd: one unit per group, the leader's; `dflash-ring run`'s restarter likewise). To the ring the group's
death is its producer's death: the reaper or the restarted leader undoes the WRITING slot and rolls the cursor
back, so nothing is lost or published twice.

Stalls. A rank that stops answering without exiting (SIGSTOPped, or hung holding its interpreter) would block its
leader silently in the next collective until the group's 30-minute timeout. So each rank touches a beat file of its
own in the group's private directory every second, from a thread that runs whatever its main thread waits on (a
rank blocked in a collective on another still beats: the one that stopped is the one named). The leader's beat watch
names a rank whose beat is older than a few seconds (its pid, what the leader waits on it for and since when), again
at a bounded rate while it lasts, and once more when it answers again. It only names: the timeout is unchanged.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from dflash_ring.common.config.target import TargetConfig, TargetConfigError
from dflash_ring.common.target_geometry import read_model_config
from dflash_ring.common.target_loading import load_target_hf_config

from .packing import packed_spans

log = logging.getLogger(__name__)

# One header per message, int64: [op, packed, max_length, then per input key: present, ndim, dim0, dim1, dtype].
RUN, COMPILE, STOP = 1, 2, 3
INPUT_KEYS = ("input_ids", "position_ids", "attention_mask", "cu_seq_lens_q", "cu_seq_lens_k")
DTYPES = (torch.int64, torch.int32)
HEADER = 3 + 5 * len(INPUT_KEYS)
JOIN_TIMEOUT = datetime.timedelta(minutes=30)  # ranks load their shard of the target before the first collective
BEAT_EVERY = 1.0  # seconds between a rank's beats (and the leader's looks at them)
STALL_AFTER = 5.0  # a beat older than this: the rank is named as not answering
STALL_REPEAT = 30.0  # while a stall lasts, it is named again at most this often
START_GRACE = 300.0  # before its first beat a rank is still importing torch (a minute on a loaded box): not a stall


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """A group's ranks take consecutive GPUs from the leader's (a systemd group unit sees just its N)."""
    return torch.device("cuda", (device.index or 0) + rank) if device.type == "cuda" else device


# What a tensor-parallel plan splits N ways: attention heads (column-wise q, k, v) and the MLP's inner width
# (column-wise gate/up, row-wise down). A count N does not divide would split inside a head or leave ranks
# unequal shards, so it is refused before any rank starts.
SHARDED_COUNTS = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size")


def tensor_parallel_refusal(cfg: TargetConfig) -> str | None:
    """Why target.tensor_parallel cannot shard this target (None: it can): a count the ranks do not divide (from
    config.json), or a family whose transformers config has no tensor-parallel plan (its config class:
    the one place this needs transformers). One line, naming the families that have a plan."""
    n = cfg.tensor_parallel
    if n == 1:
        return None
    config = read_model_config(cfg)
    for key in SHARDED_COUNTS:
        value = config.get(key)
        if type(value) is int and value % n:  # noqa: E721 (a bool is no count)
            return (
                f"target.tensor_parallel = {n} does not divide the target's {key} = {value}: use a divisor "
                f"of it (the ranks shard it evenly)"
            )
    text = load_target_hf_config(cfg.path).get_text_config()
    if not getattr(text, "base_model_tp_plan", None):
        return (
            f"target.tensor_parallel = {n} refused: transformers has no tensor-parallel plan for "
            f"{text.model_type!r} (set target.tensor_parallel = 1); families with one: "
            f"{', '.join(tensor_parallel_families())}"
        )
    return None


def tensor_parallel_families() -> list[str]:
    """The model types whose installed transformers config carries a tensor-parallel plan (base_model_tp_plan)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return sorted(
        name for name, config_class in CONFIG_MAPPING.items() if getattr(config_class, "base_model_tp_plan", None)
    )


def check_group(cfg: TargetConfig, device: torch.device) -> None:
    """target.tensor_parallel against the target and this host, in one line each: a count the ranks do not divide,
    a family without a plan, more ranks than GPUs (or CPU cores), or the CPU asked for on a host whose accelerator
    transformers' tensor parallelism would bind instead."""
    n = cfg.tensor_parallel
    if n == 1:
        return
    if why := tensor_parallel_refusal(cfg):
        raise TargetConfigError(why)
    if device.type == "cuda":
        first, count = device.index or 0, torch.cuda.device_count()
        if first + n > count:
            raise TargetConfigError(
                f"target.tensor_parallel = {n} from {device} needs GPUs {first}..{first + n - 1}, "
                f"but {count} are visible: lower it or start the group on an earlier GPU"
            )
    elif torch.cuda.is_available():
        raise TargetConfigError(
            f"target.tensor_parallel = {n} on the CPU refused on a host with CUDA devices: "
            "transformers' tensor parallelism binds the accelerator; use a cuda device"
        )
    elif n > (os.cpu_count() or 1):
        raise TargetConfigError(
            f"target.tensor_parallel = {n}: more ranks than this host's {os.cpu_count()} CPU cores; lower it"
        )


def _send(header: list[int], tensors: list[torch.Tensor], device: torch.device) -> None:
    dist.broadcast(torch.tensor(header + [0] * (HEADER - len(header)), dtype=torch.int64, device=device), src=0)
    for t in tensors:
        dist.broadcast(t.contiguous(), src=0)


def send_run(inputs: dict, packed: bool, device: torch.device) -> None:
    """The leader's side of one forward: what every rank needs to run the same one."""
    header, tensors = [RUN, int(packed), int(inputs.get("max_length_q", 0))], []
    for key in INPUT_KEYS:
        t = inputs.get(key)
        if t is None:
            header += [0, 0, 0, 0, 0]
            continue
        if t.dim() > 2 or t.dtype not in DTYPES:
            raise TypeError(f"{key}: a {t.dim()}-d {t.dtype} tensor cannot go to the group's ranks")
        shape = list(t.shape) + [0] * (2 - t.dim())
        header += [1, t.dim(), *shape, DTYPES.index(t.dtype)]
        tensors.append(t.to(device))
    unknown = set(inputs) - set(INPUT_KEYS) - {"max_length_q", "max_length_k"}
    if unknown:
        raise TypeError(f"forward inputs {sorted(unknown)} cannot go to the group's ranks")
    _send(header, tensors, device)


def receive(device: torch.device) -> tuple[int, bool, dict]:
    """A rank's side: (op, packed, the forward's inputs)."""
    header = torch.empty(HEADER, dtype=torch.int64, device=device)
    dist.broadcast(header, src=0)
    h = header.tolist()
    op, packed, max_length = h[:3]
    inputs: dict = {}
    for i, key in enumerate(INPUT_KEYS):
        present, ndim, d0, d1, dtype = h[3 + 5 * i : 8 + 5 * i]
        if present:
            t = torch.empty([d0, d1][:ndim], dtype=DTYPES[dtype], device=device)
            dist.broadcast(t, src=0)
            inputs[key] = t
    if "cu_seq_lens_q" in inputs:
        inputs["max_length_q"] = inputs["max_length_k"] = max_length
    return op, bool(packed), inputs


def serve_rank(target, device: torch.device) -> None:
    """A rank's loop: mirror each of the leader's forwards (features dropped) until the leader says stop."""
    while True:
        op, packed, inputs = receive(device)
        if op == STOP:
            return
        if op == COMPILE:
            target.compile_layers()
            continue
        if packed != target.packed:
            target.use_packing(packed)
        with torch.inference_mode():
            try:
                if "cu_seq_lens_q" in inputs:
                    bounds = inputs["cu_seq_lens_q"].tolist()
                    with packed_spans(list(zip(bounds[:-1], bounds[1:])), device):
                        target._run(**inputs)
                else:
                    target._run(**inputs)
            except Exception as e:  # noqa: BLE001 - the leader's same forward raised it too (a probe's finding)
                log.warning("rank forward raised %s: %s (the leader's did as well)", type(e).__name__, e)
            finally:
                target._captured.clear()


def beat_path(rendezvous: Path, rank: int) -> Path:
    return rendezvous / f"rank-{rank}.beat"


def start_beating(path: Path) -> None:
    """In a rank: touch its beat file every BEAT_EVERY seconds from a daemon thread, until the leader removes the
    group's directory (its close) or the rank ends. A stopped or interpreter-hung rank stops beating."""

    def beat() -> None:
        try:
            while True:
                path.touch()
                time.sleep(BEAT_EVERY)
        except FileNotFoundError:  # the group's directory is gone: the leader is closing the group
            return

    threading.Thread(target=beat, name="beat", daemon=True).start()


def die_with_leader(leader: int) -> None:
    """In a rank, first thing: SIGKILL when the leader dies, however it dies (Linux prctl PR_SET_PDEATHSIG), set by
    the rank itself (a preexec_fn is unsafe in a leader that already runs threads); a leader already gone by then
    is seen as another parent."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    if os.getppid() != leader:
        os._exit(1)


class TensorGroup:
    """The leader's hold on its ranks: their processes, the group, and the watch that ends the leader with them."""

    def __init__(self, cfg: TargetConfig, device: torch.device):
        self.cfg, self.device, self.size = cfg, device, cfg.tensor_parallel
        self.ranks: list[subprocess.Popen] = []
        self._closing = threading.Event()
        self._rendezvous: Path | None = None
        self._started: list[float] = []  # each rank's spawn time (wall clock, as a beat file's mtime)
        self._waiting: tuple[str, float] | None = None  # what the leader waits on the ranks for, and since when

    @classmethod
    def start(cls, cfg: TargetConfig, device: torch.device) -> TensorGroup:
        """Check the group, start ranks 1..N-1, and join the group as rank 0 (returns once all have joined)."""
        check_group(cfg, device)
        group = cls(cfg, device)
        # One host: the collectives' sockets on the loopback only (gloo's and NCCL's bootstrap would otherwise bind
        # the host's interface), as the store is; the ranks inherit it.
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(name, "lo")
        # The rendezvous is a file in a directory only this user can enter (mkdtemp: 0700), not a port: another local
        # user can neither join the group nor disturb its start. A fresh one per start: a FileStore left by a killed
        # group would hand its stale keys to the next.
        group._rendezvous = Path(tempfile.mkdtemp(prefix="dflash-ring-tp-"))
        store_file = group._rendezvous / "store"
        store = dist.FileStore(str(store_file), group.size)
        store.set_timeout(JOIN_TIMEOUT)
        spec = json.dumps(asdict(cfg))
        for rank in range(1, group.size):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(group.size),
                "LOCAL_RANK": str(rank_device(device, rank).index or 0),
            }
            group.ranks.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "dflash_ring.producer.tensor_rank",
                        "--store-file",
                        str(store_file),
                        "--rank",
                        str(rank),
                        "--device",
                        str(rank_device(device, rank)),
                        "--leader",
                        str(os.getpid()),
                        "--beat-file",
                        str(beat_path(group._rendezvous, rank)),
                        "--target",
                        spec,
                    ],
                    env=env,
                )
            )
            group._started.append(time.time())
        for rank, proc in enumerate(group.ranks, start=1):
            threading.Thread(target=group._watch, args=(rank, proc), name=f"rank-{rank}", daemon=True).start()
        threading.Thread(target=group._watch_beats, name="rank-beats", daemon=True).start()
        os.environ.update(RANK="0", WORLD_SIZE=str(group.size), LOCAL_RANK=str(device.index or 0))
        with group.waiting("to join the group"):
            dist.init_process_group(
                backend_for(device), store=store, rank=0, world_size=group.size, timeout=JOIN_TIMEOUT
            )
        group._store = store  # kept for the group's lifetime (the ranks' keys live in it)
        log.info(
            "tensor-parallel group of %d ranks (%s) joined: ranks %s",
            group.size,
            backend_for(device),
            [p.pid for p in group.ranks],
        )
        return group

    @classmethod
    @contextmanager
    def held(
        cls, cfg: TargetConfig, device: torch.device, interruptible: Callable[[], AbstractContextManager[None]]
    ) -> Iterator[TensorGroup | None]:
        """The group for a producer's lifetime (None when target.tensor_parallel = 1): started in an interruptible
        phase (its ranks load for minutes), stopped in order on a clean exit, its ranks killed on any other."""
        if cfg.tensor_parallel == 1:
            yield None
            return
        with interruptible():
            group = cls.start(cfg, device)
        try:
            yield group
        except BaseException:
            group.kill()
            raise
        group.close()

    def kill(self) -> None:
        """The ranks SIGKILLed (the leader is going down anyway: no collective may wait on them)."""
        self._closing.set()
        for proc in self.ranks:
            proc.kill()
            proc.wait()
        self._remove_rendezvous()

    def _remove_rendezvous(self) -> None:
        if self._rendezvous is not None:
            shutil.rmtree(self._rendezvous, ignore_errors=True)

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if self._closing.is_set():
            return
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"
        log.error(
            "tensor-parallel rank %d (pid %d) exited with %s: the group goes down to restart as one",
            rank,
            proc.pid,
            how,
        )
        logging.shutdown()
        os._exit(1)  # a producer's death to the ring: its slot and cursor are undone by whoever takes the row

    @contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """Marks the leader as waiting on its ranks (`what`, for the beat watch's warnings) while the block runs."""
        self._waiting = (what, time.monotonic())
        try:
            yield
        finally:
            self._waiting = None

    def _watch_beats(self) -> None:
        """Name each rank whose beat is older than STALL_AFTER (before its first beat: than START_GRACE, since its
        spawn), again every STALL_REPEAT while it lasts, and once when it beats again. Logs only: the collectives'
        timeout is what ends a group that never answers."""
        stalled: dict[int, tuple[float, float]] = {}  # rank -> (the stall's start, when it was last named)
        while not self._closing.wait(BEAT_EVERY):
            now = time.time()
            for rank, proc in enumerate(self.ranks, start=1):
                try:
                    last, limit = beat_path(self._rendezvous, rank).stat().st_mtime, STALL_AFTER
                except FileNotFoundError:  # not beating yet: still starting
                    last, limit = self._started[rank - 1], START_GRACE
                if now - last <= limit:
                    if rank in stalled:
                        log.warning(
                            "tensor-parallel rank %d (pid %d) answers again after %.1f s",
                            rank,
                            proc.pid,
                            now - stalled.pop(rank)[0],
                        )
                    continue
                since, named = stalled.get(rank, (last, 0.0))
                if now - named < STALL_REPEAT:
                    continue
                stalled[rank] = (since, now)
                waiting = self._waiting
                log.warning(
                    "tensor-parallel rank %d (pid %d) has not answered for %.1f s: the leader %s (the group's "
                    "timeout, %s, still holds)",
                    rank,
                    proc.pid,
                    now - since,
                    "is not waiting on it yet"
                    if waiting is None
                    else f"has waited on it {waiting[0]} for {time.monotonic() - waiting[1]:.1f} s",
                    JOIN_TIMEOUT,
                )

    def compile(self) -> None:
        with self.waiting("to compile its layers"):
            _send([COMPILE], [], self.device)

    def close(self) -> None:
        """Tell the ranks to stop, wait for them, leave the group."""
        self._closing.set()
        try:
            _send([STOP], [], self.device)
        except Exception as e:  # noqa: BLE001 - a rank already gone: the others still get the kill below
            log.warning("stopping the ranks: %s", e)
        for proc in self.ranks:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        dist.destroy_process_group()
        self._remove_rendezvous()


def rank_target_config(spec: str) -> TargetConfig:
    return TargetConfig(**json.loads(spec))
