"""Target producers as real processes (`dflash-ring target`) feeding the ring, read back in the test process."""

from __future__ import annotations

import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dflash_ring.common.config.load import load_config
from dflash_ring.common.config.schema import Config
from dflash_ring.common.layout import Counter, Role, RowStatus
from dflash_ring.common.lifecycle.membership import Membership
from dflash_ring.common.ring import ConfigMismatchError, Ring
from dflash_ring.common.ring_spec import ring_spec
from dflash_ring.producer.batching import ShardBatcher
from dflash_ring.producer.pretokenized import TokenizedData, load_tokenized
from support import (
    assert_same_features,
    build_target,
    load_tokenizer,
    reference_features,
    reference_final_hidden,
    wait_exit,
    wait_for,
    write_chat_rows,
)

ROWS = 48


@dataclass
class World:
    targets: dict[str, Path]
    data: Path
    cache: Path


@dataclass
class Item:
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    def sequences(self, name: str) -> list[torch.Tensor]:
        cu = self.tensors["cu_seqlens"].tolist()
        return [self.tensors[name][a:b] for a, b in zip(cu[:-1], cu[1:])]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    root = tmp_path_factory.mktemp("world")
    targets = {arch: build_target(root / arch, arch) for arch in ("qwen3", "llama")}
    targets["narrow"] = build_target(root / "narrow", "qwen3", hidden=32)
    return World(targets, write_chat_rows(root / "chat.jsonl", ROWS), root / "cache")


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """Producers and the reference forward use one BLAS thread each: 2 CI cores, several processes."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def configure(
    run,
    world: World,
    arch: str = "qwen3",
    *,
    producers: int = 1,
    epochs: int = 1,
    slots: int = 4,
    max_tokens: int = 512,
    **target: Any,
) -> Config:
    """A run of `producers` targets of `arch` over the world's chat rows (`target`: more [target] settings)."""
    return run.write_config(
        producers,
        1,
        slots=slots,
        data={
            "path": str(world.data),
            "cache_dir": str(world.cache),
            "max_length": 256,
            "max_tokens_per_batch": max_tokens,
            "epochs": epochs,
            "seed": 3,
        },
        target={"path": str(world.targets[arch]), "num_draft_layers": 2, "state_dir": str(run.tmp / "state"), **target},
    )


def tokenized(cfg: Config) -> TokenizedData:
    """Tokenized here first, so producers find the cache, and the test knows every sample."""
    return load_tokenized(cfg.data, load_tokenizer(Path(cfg.target.path)))


def consume(cfg: Config, after_each=None) -> list[Item]:
    """Everything the producers publish, until the supervisor's shutdown; `after_each(n)` after the n-th."""
    items = []
    with Ring.attach(ring_spec(cfg)) as ring:
        me = Membership.join(ring, cfg.run, Role.CONSUMER, 0, journal_dir=cfg.train.checkpoint_dir)
        port = ring.consumer(me.row)
        while (r := port.claim(timeout_s=60)) is not None:
            items.append(Item(dict(r.meta), {k: v.clone() for k, v in r.tensors.items()}))
            port.release(r)
            del r
            if after_each is not None:
                after_each(len(items))
        me.leave()
    return items


def finish(run, procs) -> None:
    for p in procs:
        assert wait_exit(p, 60) == 0, p.stderr.read()


def samples_of(data: TokenizedData) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Source row -> (tokens, loss mask)."""
    return {
        int(row): (
            data.tokens[data.offsets[i] : data.offsets[i + 1]],
            data.loss_mask[data.offsets[i] : data.offsets[i + 1]],
        )
        for i, row in enumerate(data.row_ids)
    }


@pytest.mark.parametrize("arch,final", [("qwen3", False), ("llama", True)])
def test_features_from_the_ring_equal_a_plain_forward_of_each_sequence_alone(run, world, arch, final):
    cfg = configure(run, world, arch, **({"ship_final_hidden": True} if final else {}))
    data = tokenized(cfg)
    sup, prod = run.supervisor(), run.role("target", 0)
    items = consume(cfg)
    finish(run, [prod, sup])
    assert items and all(
        set(i.meta) == {"producer", "epoch", "position", "num_tokens", "num_sequences", "sources", "eval"}
        for i in items
    )
    names = {"input_ids", "loss_mask", "cu_seqlens", "sample_ids", "source_ids", "features"} | (
        {"final_hidden"} if final else set()
    )
    first = items[0].tensors
    assert set(first) == names
    assert (
        first["input_ids"].dtype,
        first["loss_mask"].dtype,
        first["cu_seqlens"].dtype,
        first["sample_ids"].dtype,
        first["features"].dtype,
    ) == (torch.int32, torch.uint8, torch.int32, torch.int64, torch.float32)
    rows = torch.cat([i.tensors["sample_ids"] for i in items]).tolist()
    assert sorted(rows) == data.row_ids.tolist()  # every sample exactly once
    samples = samples_of(data)
    ids, features, finals = [], [], []
    for item in items:
        t = item.tensors
        assert item.meta["num_tokens"] == len(t["input_ids"]) == t["features"].shape[0] == int(t["cu_seqlens"][-1])
        assert t["features"].shape[1] == 2 * 64
        for row, seq, mask in zip(t["sample_ids"].tolist(), item.sequences("input_ids"), item.sequences("loss_mask")):
            assert np.array_equal(seq.numpy(), samples[row][0]) and np.array_equal(mask.numpy(), samples[row][1])
        ids += item.sequences("input_ids")
        features += item.sequences("features")
        finals += item.sequences("final_hidden") if final else []
    expected = reference_features(world.targets[arch], ids, [1, 3])
    assert_same_features(features, expected)
    if final:
        assert_same_features(finals, reference_final_hidden(world.targets[arch], ids))
    assert run.leftovers() == []


def test_three_producers_cover_the_data_exactly_once_per_epoch(run, world):
    cfg = configure(run, world, producers=3, epochs=2, max_tokens=384)
    data = tokenized(cfg)
    sup = run.supervisor()
    procs = [run.role("target", i) for i in range(3)]
    items = consume(cfg)
    finish(run, procs + [sup])
    for epoch in (0, 1):
        rows = [r for i in items if i.meta["epoch"] == epoch for r in i.tensors["sample_ids"].tolist()]
        assert sorted(rows) == data.row_ids.tolist(), f"epoch {epoch}"
        for p in range(3):
            plan = ShardBatcher.from_config(data, cfg.data, rank=p, world_size=3).epoch_plan(epoch)
            positions = sorted(
                i.meta["position"] for i in items if i.meta["epoch"] == epoch and i.meta["producer"] == p
            )
            assert positions == list(range(len(plan))), f"producer {p} epoch {epoch}"
    assert run.leftovers() == []


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_interrupted_producer_restarts_with_exactly_the_remaining_batches(run, world, sig):
    cfg = configure(run, world, epochs=2, slots=2, max_tokens=256)
    data = tokenized(cfg)
    plan = [
        (b.epoch, b.position, b.sample_ids.tolist())
        for b in ShardBatcher.from_config(data, cfg.data, rank=0, world_size=1).batches()
    ]
    sup = run.supervisor()
    incarnations = [run.role("target", 0)]

    def interrupt(n: int) -> None:
        if n == 3:  # the ring is full behind this slow reader, so the producer is mid-run
            incarnations[0].send_signal(sig)
            assert wait_exit(incarnations[0]) == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
            incarnations.append(run.role("target", 0))
        time.sleep(0.05)

    items = consume(cfg, after_each=interrupt)
    finish(run, [incarnations[-1], sup])
    assert len(incarnations) == 2 and len(plan) > 10
    got = [(i.meta["epoch"], i.meta["position"], i.tensors["sample_ids"].tolist()) for i in items]
    assert got == plan  # nothing skipped, nothing repeated, in order
    if sig == signal.SIGTERM:
        assert "stopped before the end of the shard" in incarnations[0].stderr.read()
    resumed = re.search(r"resuming at epoch (\d+) position (\d+) \(from the ring\)", incarnations[1].stderr.read())
    assert resumed and (0, 3) <= (int(resumed[1]), int(resumed[2])) < (1, 0)
    assert not (run.tmp / "state" / run.name / "producer-0.json").exists()  # shard done: no stale cursor
    assert run.leftovers() == []


def test_a_drafter_built_for_another_target_geometry_is_refused_by_name(run, world):
    cfg = configure(run, world)
    sup = run.supervisor()
    with Ring.attach(ring_spec(cfg)) as ring:  # the producers' own config attaches
        ring.check(ring_spec(cfg))
    other_layers = load_config(run.config, ["target.num_draft_layers=1"])
    with pytest.raises(ConfigMismatchError, match=r"target\.layer_ids: ring has \[1, 3\], this process has \[3\]"):
        Ring.attach(ring_spec(other_layers), timeout_s=5)
    narrow = load_config(run.config, [f'target.path="{world.targets["narrow"]}"'])
    with pytest.raises(ConfigMismatchError, match=r"target\.hidden_size: ring has 64, this process has 32"):
        Ring.attach(ring_spec(narrow), timeout_s=5)
    out = run.cli(
        "target", "--config", str(run.config), "--index", "0", "--set", "target.ship_final_hidden=true", check=False
    )
    assert out.returncode == 2 and "target.ship_final_hidden" in out.stderr
    sup.send_signal(signal.SIGTERM)
    assert wait_exit(sup) == 0


def test_a_drained_run_started_again_does_not_redo_a_finished_shard(run, world):
    """Found by `dflash-ring chaos`: a run drained (supervisor SIGTERM or `stop`) after one producer had
    finished its shard, then started again, had that producer redo its whole shard: its cursor file was
    removed at shard end and the ring holding its final cursor was gone. Each such batch was trained twice."""
    cfg = configure(run, world, producers=2, epochs=1, max_tokens=256)
    data = tokenized(cfg)
    shard = [len(ShardBatcher.from_config(data, cfg.data, rank=p, world_size=2).epoch_plan(0)) for p in (0, 1)]
    sup = run.supervisor()
    p0 = run.role("target", 0)

    def drain_once_shard_0_is_done(n: int) -> None:
        if n == shard[0]:  # producer 1 has not started: the drain ends the run with its shard untouched
            with Ring.open(run.name) as ring:  # done, it stays for replays until the run ends: the drain ends it
                wait_for(
                    lambda: ring.row_status(ring.row_of(Role.PRODUCER, 0)) == RowStatus.DONE,
                    timeout=60,
                    what="producer 0's shard done",
                )
            run.spawn("-m", "dflash_ring", "stop", "--config", str(run.config))

    first = consume(cfg, after_each=drain_once_shard_0_is_done)
    finish(run, [p0, sup])
    assert len(first) == shard[0] and {i.meta["producer"] for i in first} == {0}
    sup = run.supervisor()  # the run started again, as a whole
    procs = [run.role("target", 0), run.role("target", 1)]
    second = consume(cfg)
    finish(run, procs + [sup])
    assert [i.meta["producer"] for i in second].count(0) == 0  # nothing of the finished shard again
    assert sorted(i.meta["position"] for i in second) == list(range(shard[1]))
    assert list((run.tmp / "state" / run.name).glob("producer-*.json")) == []  # run complete: no resume points
    assert run.leftovers() == []


def test_a_producer_restarted_with_other_data_refuses_the_old_plans_ring_cursor(run, world):
    """Issue 14 item 4: a producer restarted with another data set resumed from the ring row's cursor of the
    old plan (the ring's record was trusted unconditionally, the cursor file was checked), published the
    rest of the other data from the wrong position, and the run "finished". It must refuse, naming both."""
    cfg = configure(run, world, slots=2, max_tokens=256)
    other = write_chat_rows(run.tmp / "other.jsonl", ROWS, seed=1)
    sup = run.supervisor()
    first = run.role("target", 0)
    with Ring.attach(ring_spec(cfg)) as ring:
        row = ring.row_of(Role.PRODUCER, 0)
        wait_for(
            lambda: ring.committed_cursor(row) is not None and ring.counter(Counter.PRODUCED) == 2,
            timeout=120,
            what="a full ring",
        )  # nobody consumed yet: the producer waits, its cursor set
        first.send_signal(signal.SIGKILL)
        assert wait_exit(first) == -signal.SIGKILL
        me = Membership.join(ring, cfg.run, Role.CONSUMER, 0, journal_dir=cfg.train.checkpoint_dir)
        port = ring.consumer(me.row)
        again = run.spawn(
            "-m", "dflash_ring", "target", "--config", str(run.config), "--index", "0", "--set", f'data.path="{other}"'
        )
        consumed, deadline = 0, time.monotonic() + 120
        while again.poll() is None and time.monotonic() < deadline:  # before the fix it ran to "shard done"
            if (r := port.claim(timeout_s=0.2)) is not None:
                port.release(r)
                consumed += 1
                del r
        me.leave()
    err = again.stderr.read()
    lines = err.strip().splitlines()
    assert wait_exit(again) == 2 and "Traceback" not in err and "shard done" not in err, err[-3000:]
    assert lines[-1].startswith("dflash-ring target: error: "), lines[-1]
    assert f"data {world.data} (tokenized" in lines[-1] and f"data {other} (tokenized" in lines[-1], lines[-1]
    assert f"dflash-ring stop {run.name}" in lines[-1], lines[-1]
    assert consumed == 2  # the old plan's two items, nothing of the other data
    assert run.cli("stop", "--config", str(run.config), "--now", "--timeout", "60").returncode == 0
    wait_exit(sup)
