"""Trainer durability: bitwise checkpoint round trips, refusal of partial checkpoints, export, and checkpoints
written in the background (the same files as in the step, errors raised on the training thread)."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest
import torch

from dflash_ring.consumer.training.async_checkpoint import BackgroundWriter, HostSnapshot
from dflash_ring.common.lifecycle.trained_journal import Journal
from dflash_ring.consumer.training.checkpoint import FILES, CheckpointError, CheckpointStore, export_checkpoint
from dflash_ring.consumer.training.checkpoint_policy import Checkpoints
from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.consumer.layouts.export import load_drafter
from dflash_ring.consumer.modeling.model import load_target_head
from dflash_ring.consumer.families.build import build_drafter
from dflash_ring.common.config.train import TrainConfig
from dflash_ring.consumer.training.trainer import DeviceBatch, Trainer, lr_at
from dflash_ring.tools.reconcile import read_ledgers, reconcile
from support import build_target, cyclic_rows, pipeline_config, save_tiny_qwen3, wait_exit


def tiny_target(tmp_path):
    path = tmp_path / "target"
    save_tiny_qwen3(path, vocab_size=96, max_position_embeddings=256, tie_word_embeddings=False)
    return path, json.loads((path / "config.json").read_text())


def make_trainer(tmp_path, seed=0):
    path, target_config = tiny_target(tmp_path)
    drafter = DrafterConfig(num_hidden_layers=1, block_size=4, num_anchors=8, mask_token_id=95, loss_gamma=2.0)
    torch.manual_seed(seed)
    model = build_drafter(drafter, target_config)
    train = TrainConfig(lr=1e-3, total_steps=20, seed=seed)
    return Trainer(model, load_target_head(path), drafter, train, torch.device("cpu")), target_config


def batch(seed: int) -> DeviceBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = [20, 12]
    ids = torch.randint(0, 90, (sum(lengths),), generator=g)
    return DeviceBatch(
        features=torch.randn(sum(lengths), 64, generator=g),  # one target layer x hidden 64
        input_ids=ids,
        loss_mask=torch.ones(sum(lengths), dtype=torch.bool),
        cu_seqlens=torch.tensor([0, 20, 32]),
        meta={"producer": 0, "epoch": 0, "position": seed},
    )


def test_checkpoint_round_trip_is_bitwise_and_resume_matches_uninterrupted(tmp_path):
    trainer, target_config = make_trainer(tmp_path)
    for s in range(3):
        trainer.train_step(batch(s), 20)
    store = CheckpointStore(tmp_path / "ckpt")
    store.save(trainer.state({"drafter": {}, "target_config": target_config}), keep=2)
    uninterrupted = [trainer.train_step(batch(s), 20).loss for s in range(3, 6)]

    resumed, _ = make_trainer(tmp_path / "again", seed=1)  # different init: everything must come from the checkpoint
    ckpt = store.load_latest()
    resumed.restore(ckpt)
    for name, value in trainer.state({}).model.items():
        assert ckpt.model[name].dtype == value.dtype
    assert [resumed.train_step(batch(s), 20).loss for s in range(3, 6)] == uninterrupted
    for (n, a), b in zip(trainer.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), n


def test_truncated_checkpoint_is_refused_and_the_previous_one_used(tmp_path):
    trainer, target_config = make_trainer(tmp_path)
    store = CheckpointStore(tmp_path / "ckpt")
    trainer.train_step(batch(0), 20)
    first = store.save(trainer.state({}), keep=3)
    trainer.train_step(batch(1), 20)
    second = store.save(trainer.state({}), keep=3)
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == second.name
    weights = second / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a crash mid-write
    loaded = store.load_latest()
    assert loaded.path == first and loaded.step == 1
    # A half-written temporary directory is never a candidate.
    (tmp_path / "ckpt" / ".tmp-step-00000009-1").mkdir()
    assert store.load_latest().path == first


def test_export_from_checkpoint_loads_back_with_identical_weights(tmp_path):
    trainer, target_config = make_trainer(tmp_path)
    trainer.train_step(batch(0), 20)
    info = {
        "drafter": {"num_hidden_layers": 1, "block_size": 4, "num_anchors": 8, "mask_token_id": 95, "loss_gamma": 2.0},
        "target_config": target_config,
    }
    store = CheckpointStore(tmp_path / "ckpt")
    store.save(trainer.state(info), keep=1)
    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "export")
    reloaded = load_drafter(out, dtype=torch.float32)
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value.to(torch.bfloat16).float()), name


def test_a_precompile_changes_nothing_the_following_steps_train_on(tmp_path):
    """The standby's and the restart's precompile (Trainer.precompile: forward and backward on synthetic batches)
    leaves weights, optimizer, gradients and every RNG as they were: the steps after it are bit for bit the steps
    without it, and its synthetic batches did reach the loss (their gradient existed before it was dropped)."""
    runs = []
    for warm in (False, True):
        trainer, _ = make_trainer(tmp_path / str(warm))
        if warm:
            reached = []
            for p in trainer.model.parameters():
                p.register_hook(lambda g, reached=reached: reached.append(1) or g)
            assert trainer.precompile(max_tokens=48, max_length=20, force=True) > 0
            assert reached and all(p.grad is None for p in trainer.model.parameters())
        assert trainer.precompile(max_tokens=48, max_length=20) == 0.0  # on the CPU nothing compiles: no-op
        runs.append(
            (
                [trainer.train_step(batch(s), 20).loss for s in range(3)],
                {k: v.clone() for k, v in trainer.model.state_dict().items()},
            )
        )
    (cold_losses, cold_state), (warm_losses, warm_state) = runs
    assert cold_losses == warm_losses
    assert all(torch.equal(cold_state[k], warm_state[k]) for k in cold_state)


def test_lr_schedule_warms_up_then_decays():
    cfg = TrainConfig(lr=1.0, warmup_ratio=0.1, min_lr_ratio=0.1)
    lrs = [lr_at(s, 100, cfg) for s in range(100)]
    assert lrs[0] == 0.1 and lrs[9] == 1.0
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert abs(lrs[-1] - 0.1) < 0.01


def flip_a_tensor_byte(path) -> None:
    """One bit of the last tensor's data: safetensors still loads the file, with a wrong value in it."""
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))


def test_bit_flipped_latest_checkpoint_is_refused_with_one_line_and_the_previous_one_used(tmp_path, caplog):
    """Issue 14 item 6: checkpoints had no checksums, so flipped tensor bytes loaded (and exported) silently."""
    trainer, _ = make_trainer(tmp_path)
    store = CheckpointStore(tmp_path / "ckpt")
    trainer.train_step(batch(0), 20)
    first = store.save(trainer.state({}), keep=3)
    trainer.train_step(batch(1), 20)
    second = store.save(trainer.state({}), keep=3)
    flip_a_tensor_byte(second / "model.safetensors")
    with caplog.at_level("WARNING", logger="dflash_ring.consumer.training.checkpoint"):
        loaded = store.load_latest()
    assert loaded.path == first and loaded.step == 1
    assert [r.levelname for r in caplog.records] == ["ERROR"]
    assert str(second / "model.safetensors") in caplog.records[0].getMessage()
    assert json.loads((second / "manifest.json").read_text())["sha256_chunks"].keys() == {
        "model.safetensors",
        "optimizer.safetensors",
        "state.safetensors",
        "trainer.json",
    }


def test_chunked_digests_catch_a_flip_in_any_chunk_and_whole_file_manifests_still_verify(tmp_path, monkeypatch):
    """Chunks are hashed on all cores at load (restart time); a flip in the middle of a many-chunk file is
    refused all the same, and a manifest of whole-file digests (written by earlier versions) still verifies."""
    from dflash_ring.consumer.training import checkpoint as module

    monkeypatch.setattr(module, "CHUNK_BYTES", 4096)
    trainer, _ = make_trainer(tmp_path)
    store = CheckpointStore(tmp_path / "ckpt")
    trainer.train_step(batch(0), 20)
    path = store.save(trainer.state({}), keep=3)
    manifest = json.loads((path / "manifest.json").read_text())
    size = (path / "optimizer.safetensors").stat().st_size
    assert len(manifest["sha256_chunks"]["optimizer.safetensors"]) == -(-size // 4096) > 3
    assert store.load(path).step == 1
    whole = {"sha256": {n: module._sha256(path / n) for n in FILES}}
    (path / "manifest.json").write_text(json.dumps(whole))
    assert store.load(path).step == 1
    (path / "manifest.json").write_text(json.dumps(manifest))
    data = bytearray((path / "optimizer.safetensors").read_bytes())
    data[size // 2] ^= 0x01  # inside a middle chunk
    (path / "optimizer.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="optimizer.safetensors does not match"):
        store.load(path)
    manifest["chunk_bytes"] = 8192
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="chunk_bytes 8192"):
        store.load(path)


def test_a_checkpoint_from_before_manifests_loads_with_a_warning(tmp_path, caplog):
    trainer, _ = make_trainer(tmp_path)
    store = CheckpointStore(tmp_path / "ckpt")
    trainer.train_step(batch(0), 20)
    path = store.save(trainer.state({}), keep=1)
    (path / "manifest.json").unlink()
    with caplog.at_level("WARNING", logger="dflash_ring.consumer.training.checkpoint"):
        assert store.load_latest().path == path
    assert "no manifest.json" in caplog.text and "unverified" in caplog.text


def test_a_background_checkpoint_is_the_same_files_as_one_written_in_the_step(tmp_path):
    """The snapshot holds the step's state, consumed items included, however the drafter moves on before the
    write: the files are byte for byte those of a checkpoint written in the step at the same moment."""
    trainer, target_config = make_trainer(tmp_path)
    for s in range(3):
        trainer.train_step(batch(s), 20)
    consumed = {"0": [0, 2]}
    info = {"consumed": consumed, "items": 3, "target_config": target_config}
    in_step = CheckpointStore(tmp_path / "in-step").save(trainer.state(info), keep=1)
    snapshot, durable = HostSnapshot(), []
    host = snapshot.take(trainer.state(info))
    trainer.train_step(batch(3), 20)  # weights, moments, RNG and consumed items all move on before the write
    consumed["0"] = [0, 3]
    writer = BackgroundWriter(CheckpointStore(tmp_path / "background"), keep=1)
    writer.start(host, snapshot.copied, durable.append)
    writer.wait()
    assert [p.name for p in durable] == [in_step.name] == ["step-00000003"]
    for name in FILES:
        assert (durable[0] / name).read_bytes() == (in_step / name).read_bytes(), name
    assert CheckpointStore(tmp_path / "background").load_latest().info["consumed"] == {"0": [0, 2]}


@pytest.mark.parametrize("background", [True, False])
def test_checkpoints_one_after_another_each_hold_their_own_step(tmp_path, background):
    """In the background the snapshot buffer is reused: a checkpoint due while the previous one is written waits."""
    trainer, _ = make_trainer(tmp_path)
    store = CheckpointStore(tmp_path / "ckpt")
    checkpoints = Checkpoints(
        store,
        every=1,
        keep=10,
        state=lambda: {"items": trainer.step},
        trainer=trainer,
        journal=Journal(tmp_path / "journal", ring=0, after_step=0),
        ledger=None,
        background=background,
    )
    weights = {}
    for s in range(4):
        trainer.train_step(batch(s), 20)
        weights[trainer.step] = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        checkpoints.after_step(trainer.step)
    checkpoints.final()
    steps = sorted(int(p.name[5:]) for p in (tmp_path / "ckpt").glob("step-*"))
    assert steps == [1, 2, 3, 4]
    for step in steps:
        ckpt = store.load(tmp_path / "ckpt" / f"step-{step:08d}")
        assert ckpt.info["items"] == step
        for name, value in weights[step].items():
            assert torch.equal(ckpt.model[name], value), (step, name)


def test_a_failed_background_write_is_raised_on_the_training_thread(tmp_path):
    trainer, _ = make_trainer(tmp_path)
    root = tmp_path / "ckpt"
    root.write_text("")  # a file where the checkpoint directory should be: the write fails
    checkpoints = Checkpoints(
        CheckpointStore(root),
        every=1,
        keep=1,
        state=lambda: {"items": 1},
        trainer=trainer,
        journal=Journal(tmp_path / "journal", ring=0, after_step=0),
        ledger=None,
    )
    trainer.train_step(batch(0), 20)
    checkpoints.after_step(1)  # the step only takes the snapshot; the write fails on the writer's thread
    with pytest.raises(CheckpointError, match=f"writing checkpoint step-00000001 under {root} failed"):
        checkpoints.final()


def _one_drafter_run(run) -> Path:
    """A supervisor's config for one target and one drafter checkpointing every 3 steps over 2 epochs of a cyclic
    corpus, with a ledger: the killed-drafter tests' run. Returns the ledger directory."""
    ledger = run.tmp / "ledger"
    pipeline_config(
        run,
        build_target(run.tmp / "target", "qwen3", layers=4),
        cyclic_rows(run.tmp / "chat.jsonl", 96),
        {
            "run": {"ledger_dir": str(ledger)},
            "data": {"epochs": 2},
            "train": {"checkpoint_every_steps": 3, "average_every_steps": 0},
        },
        consumers=1,
    )
    return ledger


def test_a_drafter_killed_mid_background_write_resumes_from_the_checkpoint_before(run, monkeypatch):
    """Real processes: the drafter SIGKILLs itself from its writer thread once the second checkpoint's files are
    synced (crash point "checkpoint.written"), while its training thread goes on. The first checkpoint stays the
    one to resume from; the restarted drafter goes on from it, and its final checkpoint is durable at exit 0."""
    ledger = _one_drafter_run(run)
    procs = [run.supervisor(), run.role("target", 0)]
    monkeypatch.setenv("DFLASH_RING_CRASH_AT", "checkpoint.written@2")
    drafter = run.role("drafter", 0)
    monkeypatch.delenv("DFLASH_RING_CRASH_AT")
    assert wait_exit(drafter, 300) == -signal.SIGKILL, drafter.stderr.read()[-3000:]
    root = run.tmp / "ckpt" / "drafter-0"
    assert [p.name for p in root.glob(".tmp-step-*")] == [f".tmp-step-00000006-{drafter.pid}"]  # killed mid-write
    assert (root / "latest").read_text().strip() == "step-00000003"
    assert CheckpointStore(root).load_latest().step == 3

    again = run.role("drafter", 0)
    for p in (*procs, again):
        assert wait_exit(p, 300) == 0, p.stderr.read()[-3000:]
    log = again.stderr.read()
    assert f"resumed from {root / 'step-00000003'} (step 3)" in log, log[-3000:]
    done = int(re.search(r"drafter 0 done: (\d+) steps", log).group(1))
    assert CheckpointStore(root).load_latest().step == done > 6
    assert list(root.glob(".tmp-step-*")) == []  # the killed writer's leftovers are cleared
    rec = reconcile(read_ledgers(ledger)[0])
    assert rec["problems"] == [], rec["problems"]
    assert rec["trained_exactly_once"] == rec["planned_batches"] > 0, rec
    # What it trained after step 3's state was in no checkpoint: its journal brought it back, trained once more.
    assert rec["trained_then_lost_with_crash"] == 0 and rec["trained_then_replayed_after_crash"] >= 3, rec
    assert "that dead drafters trained after their last checkpoint" in procs[1].stderr.read()


def test_drafters_killed_as_a_checkpoint_becomes_the_one_to_resume_from_lose_nothing_and_train_nothing_twice(
    run, monkeypatch
):
    """Real processes, three kills inside a background checkpoint's publication. The first drafter dies once its first
    checkpoint (step 3) is renamed into place and before `latest` exists (crash point "checkpoint.renamed"): its
    successor loads step 3, so its journal must be sealed against step 3, not against the missing pointer (what it
    trained up to step 3 was produced again and trained twice). The second dies once `latest` names its step-6
    checkpoint and before its journal and ledger are told ("checkpoint.latest"): the ledger has no `ckpt` record
    of step 6, and only the next drafter's `start` record says what survived (CI once failed on this window). The
    third dies the same way at step 9, and a byte of that checkpoint is flipped: its successor refuses it and falls
    back to step 6, and what the third trained after step 6 (sealed from its journal by that successor, against
    the step it really resumed from) is produced again."""
    ledger = _one_drafter_run(run)
    root = run.tmp / "ckpt" / "drafter-0"
    procs = [run.supervisor(), run.role("target", 0)]
    killed = []
    for point, step in (("checkpoint.renamed", 3), ("checkpoint.latest", 6), ("checkpoint.latest", 9)):
        monkeypatch.setenv("DFLASH_RING_CRASH_AT", point)
        drafter = run.role("drafter", 0)
        monkeypatch.delenv("DFLASH_RING_CRASH_AT")
        assert wait_exit(drafter, 300) == -signal.SIGKILL, drafter.stderr.read()[-3000:]
        assert CheckpointStore(root).load_latest().step == step
        killed.append(drafter)
    assert not [r for r in read_ledgers(ledger)[0]["drafter-0"] if r["ev"] == "ckpt" and r["step"] in (6, 9)]
    weights = root / "step-00000009" / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF  # tensor data: loads as safetensors, caught by the manifest's digests
    weights.write_bytes(bytes(raw))

    last = run.role("drafter", 0)
    for p in (*procs, last):
        assert wait_exit(p, 300) == 0, p.stderr.read()[-3000:]
    assert f"resumed from {root / 'step-00000003'} (step 3)" in killed[1].stderr.read()
    assert f"resumed from {root / 'step-00000006'} (step 6)" in killed[2].stderr.read()
    log = last.stderr.read()
    assert f"refusing checkpoint {root / 'step-00000009'}" in log and "step-00000006 is used" in log, log[-3000:]
    assert f"resumed from {root / 'step-00000006'} (step 6)" in log, log[-3000:]
    rec = reconcile(read_ledgers(ledger)[0])
    assert rec["problems"] == [], rec["problems"]
    assert rec["trained_exactly_once"] == rec["planned_batches"] > 0, rec
    assert rec["trained_then_lost_with_crash"] == 0 and rec["killed_drafter_incarnations"] == 3, rec
    assert rec["trained_then_replayed_after_crash"] >= 3, rec  # at least the third's steps 7-9
