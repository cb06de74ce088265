"""A run that has gone bad stops and says so (issue 46, goal 5), instead of training on to exit 0.

The conformance probe fails on features that are not finite; a loss or gradient that is not finite for
train.max_nonfinite_steps optimizer steps in a row ends the drafter with one line and EXIT_DIVERGED (its updates
skipped meanwhile, so AdamW's moments are not poisoned), a code nothing restarts; no checkpoint or export holds
weights that are not finite; an objective with every loss weight 0 is refused at config load; record-file lines
out of their ranges are dropped, named; a head cache whose values were changed with its digest recomputed is
caught by the target's own outputs the probe recorded.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.common.config.load import load_config
from dflash_ring.common.config.schema import ConfigError
from dflash_ring.common.config.target import TargetConfig, TargetConfigError
from dflash_ring.common.config.train import TrainConfig
from dflash_ring.common.damaged_file import SUFFIX
from dflash_ring.common.lifecycle.diverged import EXIT_DIVERGED, Diverged
from dflash_ring.common.refusal import Refusal
from support import build_target, save_tiny_qwen3

# --- the conformance probe ---------------------------------------------------------------------------------------


def test_a_probe_report_with_an_error_that_is_not_finite_fails_and_names_it():
    """max() drops a NaN when it is not first, and `error <= allowed` holds against an infinite allowance (a padded
    forward that was not finite): neither may read as a pass. Cached reports are read back through the same rule."""
    from dflash_ring.producer.conformance import LayerCheck, ProbeReport

    def report(*layers: LayerCheck) -> ProbeReport:
        return ProbeReport("qwen3", "Qwen3ForCausalLM", "sdpa", "float32", "cpu", [3, 5], 1e-4, list(layers))

    good = LayerCheck(0, "full_attention", 1e-6, 1e-7, 1e-4)
    nan_error = report(good, LayerCheck(1, "full_attention", math.nan, 1e-7, 1e-4))
    assert not nan_error.passed and math.isnan(nan_error.max_error) and math.isnan(nan_error.to_json()["max_error"])
    assert "figures at layer 1 (full_attention) are not finite: error nan" in nan_error.summary()
    infinite_floor = report(good, LayerCheck(1, "full_attention", 0.5, math.inf, math.inf))
    assert not infinite_floor.passed and infinite_floor.first_bad.layer == 1
    assert "not finite" in infinite_floor.summary()
    assert report(good).passed and report(good).max_error == 1e-6


def test_a_target_whose_padded_forward_is_not_finite_is_refused_not_given_an_infinite_allowance(tmp_path):
    """Its own padded forward (the noise floor, and the batches "auto" falls back to) gives NaN from layer 1 on: the
    allowance became inf, and any packed error passed."""
    from dflash_ring.producer.conformance import choose_packing
    from dflash_ring.producer.target import TargetModel

    save_tiny_qwen3(tmp_path, num_hidden_layers=4)
    target = TargetModel.load(TargetConfig(path=str(tmp_path), layer_ids=[1, 2]), torch.device("cpu"), packed=False)

    def poison(module, args, out):  # the padded call is the only one with more than one row
        hidden = out[0] if isinstance(out, tuple) else out
        if hidden.shape[0] > 1:
            hidden = hidden * math.nan
        return (hidden, *out[1:]) if isinstance(out, tuple) else hidden

    target.decoder.layers[0].register_forward_hook(poison)
    for mode in ("auto", "packed"):
        with pytest.raises(TargetConfigError, match=r"padded forward gives non-finite hidden states .* at layer 1 "):
            choose_packing(target, mode)


# --- a loss or gradient that is not finite -----------------------------------------------------------------------


def test_max_nonfinite_steps_defaults_to_3_and_is_held_to_its_range():
    assert TrainConfig().max_nonfinite_steps == 3
    assert load_config(None, ["train.max_nonfinite_steps=7"]).train.max_nonfinite_steps == 7
    with pytest.raises(ConfigError, match=r"train.max_nonfinite_steps = 0: must be an integer >= 1"):
        load_config(None, ["train.max_nonfinite_steps=0"])


def _drafter_parts(tmp_path: Path, **train):
    """The drafter's Trainer as the drafter process builds it (consumer/process.build), on a tiny target."""
    from dflash_ring.consumer.training.process import build

    target = tmp_path / "target"
    save_tiny_qwen3(target, vocab_size=96, max_position_embeddings=256, tie_word_embeddings=False)
    drafter = DrafterConfig(num_hidden_layers=1, block_size=4, num_anchors=8, mask_token_id=95, loss_gamma=2.0)
    settings = TrainConfig(lr=1e-3, total_steps=20, compile=False, **train)
    built = build(
        drafter, TargetConfig(path=str(target)), settings, (), str(tmp_path / "cc"), torch.device("cpu"), tmp_path / "h"
    )
    return built


def _batch(seed: int, poisoned: bool = False):
    from dflash_ring.consumer.training.trainer import DeviceBatch

    g = torch.Generator().manual_seed(seed)
    features = torch.randn(32, 64 * 1, generator=g)
    if poisoned:
        features[:, 5] = math.nan  # a target whose features are not finite
    return DeviceBatch(
        features=features,
        input_ids=torch.randint(0, 90, (32,), generator=g),
        loss_mask=torch.ones(32, dtype=torch.bool),
        cu_seqlens=torch.tensor([0, 20, 32]),
        meta={"producer": 0, "epoch": 0, "position": seed},
    )


def test_a_step_whose_gradient_is_not_finite_updates_neither_the_weights_nor_adamws_moments(tmp_path):
    trainer = _drafter_parts(tmp_path, weight_decay=0.1).trainer
    trainer.train_step(_batch(0), 20)
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    moments = {(i, k): v.clone() for i, s in trainer.optimizer.state_dict()["state"].items() for k, v in s.items()}
    m = trainer.train_step(_batch(1, poisoned=True), 20)
    assert math.isnan(m.loss) and not math.isfinite(m.grad_norm)
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, weights[k]), k  # not even weight decay: the step is skipped whole
    for i, s in trainer.optimizer.state_dict()["state"].items():
        for k, v in s.items():
            assert torch.equal(v, moments[i, k]), (i, k)
    assert all(p.grad is None for p in trainer.model.parameters())  # nothing carried into the next step
    after = trainer.train_step(_batch(2), 20)
    assert math.isfinite(after.loss) and math.isfinite(after.grad_norm)
    assert any(not torch.equal(v, weights[k]) for k, v in trainer.model.state_dict().items())


def _loop(max_nonfinite_steps: int, figures: list[tuple[float, float]]):
    """DrafterLoop around a trainer whose optimizer steps report `figures` (loss, grad_norm), one per item."""
    from dflash_ring.consumer.training.process import DrafterLoop

    steps = iter(figures)

    class FakeTrainer:
        cfg = TrainConfig(lr=1e30, max_nonfinite_steps=max_nonfinite_steps)
        step, micro_batches, accumulated = 0, 0, 0

        def train_step(self, batch, total):
            self.step += 1
            self.micro_batches += 1
            loss, grad_norm = next(steps)
            return SimpleNamespace(step=self.step, loss=loss, grad_norm=grad_norm)

    saved: list[int] = []
    nothing = SimpleNamespace(settle=lambda *a, **k: None, trained=lambda *a, **k: None, after_step=lambda s: None)
    checkpoints = SimpleNamespace(after_step=saved.append)
    schedule = SimpleNamespace(total=lambda: 100)
    loop = DrafterLoop(FakeTrainer(), nothing, nothing, nothing, checkpoints, schedule)
    return loop, saved


def test_a_loss_that_is_not_finite_for_n_steps_in_a_row_ends_the_drafter_in_one_line():
    nan, inf = math.nan, math.inf
    loop, saved = _loop(3, [(1.0, 0.5), (nan, nan), (2.0, inf), (1.0, 0.4), (nan, 0.3), (inf, nan), (nan, nan)])
    item = (SimpleNamespace(is_eval=False), None)
    for _ in range(6):
        loop.take(item)  # two in a row, then a finite one starts the count again
    with pytest.raises(Diverged) as e:
        loop.take(item)
    message = str(e.value)
    assert "\n" not in message and "train.max_nonfinite_steps = 3" in message
    assert "steps 5 to 7" in message and "loss nan, grad_norm nan" in message
    assert "train.lr (now 1e+30)" in message and "the data and the target" in message
    assert saved == [1, 2, 3, 4, 5, 6]  # the last one neither checkpoints nor averages


def test_the_drafter_that_diverged_exits_with_its_own_code_and_one_line(monkeypatch, capsys):
    import dflash_ring.cli as cli

    def diverge(args):
        raise Diverged("drafter 0: loss nan for 3 optimizer steps in a row")

    monkeypatch.setattr(cli, "cmd_drafter", diverge)
    assert EXIT_DIVERGED not in (0, 1, 2, 3)  # success, failure, a refusal, the supervisor's end after a fence
    assert cli.main(["drafter", "--index", "0"]) == EXIT_DIVERGED
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["dflash-ring drafter: error: drafter 0: loss nan for 3 optimizer steps in a row"]


def test_chaos_restarts_a_failed_drafter_but_not_one_that_diverged(tmp_path):
    import random

    from dflash_ring.tools.restarter import Restarter

    r = Restarter(tmp_path / "c.toml", [], tmp_path / "logs", {}, random.Random(0), (100.0, 100.0))
    r.procs = {
        n: SimpleNamespace(returncode=None, poll=lambda rc=rc: rc)
        for n, rc in {"drafter-0": EXIT_DIVERGED, "standby-0": EXIT_DIVERGED, "drafter-1": 1, "target-0": 2}.items()
    }
    assert r.poll(restart=True) == {
        "drafter-0": EXIT_DIVERGED,
        "standby-0": EXIT_DIVERGED,
        "drafter-1": 1,
        "target-0": 2,
    }
    assert sorted(r.pending) == ["drafter-1", "target-0"]


def test_systemd_restarts_a_failed_drafter_or_standby_but_not_one_that_diverged():
    units = Path(__file__).resolve().parents[1] / "deploy" / "systemd"
    for name in ("dflash-ring-drafter@.service", "dflash-ring-drafter-standby@.service"):
        lines = [line.strip() for line in (units / name).read_text().splitlines()]
        assert "Restart=on-failure" in lines and f"RestartPreventExitStatus={EXIT_DIVERGED}" in lines, name


# --- checkpoints and exports -------------------------------------------------------------------------------------


def _poisoned(tmp_path: Path):
    built = _drafter_parts(tmp_path)
    trainer = built.trainer
    trainer.train_step(_batch(0), 20)
    with torch.no_grad():
        next(trainer.model.parameters()).view(-1)[0] = math.inf  # what train.weight_decay = 1e30 does in two steps
    return built


def test_no_checkpoint_of_weights_that_are_not_finite_is_written_in_the_step_or_in_the_background(tmp_path):
    from dflash_ring.consumer.training.async_checkpoint import BackgroundWriter, HostSnapshot
    from dflash_ring.consumer.training.checkpoint import CheckpointStore

    trainer = _poisoned(tmp_path).trainer
    name = next(n for n, _ in trainer.model.named_parameters())
    store = CheckpointStore(tmp_path / "ckpt")
    with pytest.raises(Diverged, match=rf"refusing to write checkpoint step-00000001 .*: {name} holds inf"):
        store.save(trainer.state({}), keep=2)
    writer = BackgroundWriter(store, keep=2)
    writer.start(HostSnapshot().take(trainer.state({})), None, lambda path: None)
    with pytest.raises(Diverged, match=r"^refusing to write checkpoint step-00000001 ") as e:
        writer.wait()
    assert "\n" not in str(e.value) and "free space" not in str(e.value)
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


def test_no_export_of_weights_that_are_not_finite(tmp_path):
    from dflash_ring.consumer.layouts.export import export_drafter

    built = _poisoned(tmp_path)
    name = next(n for n, _ in built.trainer.model.named_parameters())
    with pytest.raises(Refusal, match=rf"{name} holds inf"):
        export_drafter(built.trainer.model, built.drafter_cfg, built.target_config, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --- an objective that learns nothing ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "drafter",
    [
        {"ce_weight": 0.0},
        {"recipe": "dspark", "ce_weight": 0.0, "tv_weight": 0.0, "confidence_weight": 0.0},
        {"arch": "dflash2", "ce_weight": 0.0, "selector_weight": 0.0},
    ],
)
def test_an_objective_whose_loss_weights_are_all_zero_is_refused_at_load(drafter):
    with pytest.raises(ConfigError, match=r"every loss weight is 0 .*learns nothing") as e:
        load_config(None, [f"drafter.{k}={json.dumps(v)}" for k, v in drafter.items()])
    assert "\n" not in str(e.value)
    assert ("confidence_weight" in str(e.value)) == ("recipe" in drafter)  # only the family's own weights named
    load_config(None, [f"drafter.{k}={json.dumps(v)}" for k, v in {**drafter, "kl_weight": 0.1}.items()])


# --- record files ------------------------------------------------------------------------------------------------

HEADER = {"series": "config", "run": "r", "drafter": 0, "fingerprint": "ab", "config": ""}


def _record_file(path: Path, *extra: dict) -> None:
    lines = [HEADER, *({"step": s, "series": "train", "time": 1.0, "loss": 1.0} for s in range(1, 6)), *extra]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_a_record_line_whose_step_is_out_of_range_is_dropped_and_named(tmp_path, caplog):
    """Step 1e12 made a successor log nothing after it; 10**30 crash-looped it with TensorBoard on."""
    from dflash_ring.consumer.reporting.tracking import RecordFile

    path = tmp_path / "drafter-0.jsonl"
    _record_file(path, {"step": 10**12, "series": "train", "loss": 1.0}, {"step": 10**30, "series": "eval"})
    with caplog.at_level(logging.WARNING):
        f = RecordFile(path, HEADER)
    f.close()
    assert [r["step"] for r in f.logged] == [1, 2, 3, 4, 5] and f.last == {"train": 5}
    assert "line 7: step 1000000000000 is out of range (0 to 1_000_000_000)" in caplog.text
    assert len(list(tmp_path.glob(f"drafter-0.jsonl{SUFFIX}*"))) == 1


def test_the_report_refuses_a_record_line_whose_step_is_out_of_range(tmp_path):
    from dflash_ring.tools.report import ReportError, checked_records

    path = tmp_path / "drafter-0.jsonl"
    _record_file(path, {"step": 10**30, "series": "train", "loss": 1.0})
    with pytest.raises(ReportError, match=r"line 7: step 10{30} is out of range \(0 to 1_000_000_000\)"):
        checked_records(path)


# --- the head cache ----------------------------------------------------------------------------------------------


def _forged(cache: Path, **head) -> None:
    """The issue's edit: values changed and the digest recomputed, as anyone can from head_cache's source."""
    from dflash_ring.consumer.modeling.head_cache import _digest

    record = json.loads(cache.read_text())
    record["head"].update(head)
    record["digest"] = _digest(record["key"], record["head"])
    cache.write_text(json.dumps(record))


@pytest.mark.parametrize(
    "head", [{"embed_scale": 2.0}, {"logit_softcap": 1e-30}, {"logit_multiplier": -1.0}, {"logit_softcap": None}]
)
def test_a_head_cache_whose_values_were_changed_and_redigested_is_caught_by_the_targets_own_outputs(
    tmp_path, head, caplog
):
    from dflash_ring.consumer.modeling.head_loader import load_target_head

    target = build_target(tmp_path / "target", "gemma2", layers=1, hidden=32)  # an embedding scale and a softcap
    cache = tmp_path / "drafter-0" / "target-head.json"
    probed = load_target_head(target, cache=cache).spec
    assert probed.embed_scale and probed.logit_softcap
    assert load_target_head(target, cache=cache).spec == probed and not list(cache.parent.glob(f"*{SUFFIX}*"))
    _forged(cache, **head)
    with caplog.at_level(logging.WARNING):
        assert load_target_head(target, cache=cache).spec == probed
    assert "do not reproduce the target's own outputs" in caplog.text
    assert len(list(cache.parent.glob(f"*{SUFFIX}*"))) == 1  # kept aside, and the probe's result written again
    assert load_target_head(target, cache=cache).spec == probed and len(list(cache.parent.glob(f"*{SUFFIX}*"))) == 1
