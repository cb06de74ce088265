"""Bad invocations get one line on stderr that says what is wrong, no traceback, exit 2 (issue 14 item 12)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from dflash_ring.common.config.load import load_config
from dflash_ring.common.ring import Ring
from dflash_ring.common.ring_spec import ring_spec

NO_METRICS = ["--set", "metrics.enabled=false"]
PROGRESS_BAR = re.compile(r"^\s*$|examples/s\]$")  # the data set reader's progress bars: not messages


def _foreign_ring(tmp: Path, name: str) -> list[str]:
    """A ring of this run name whose segment belongs to another user."""
    Ring.create(
        ring_spec(
            load_config(
                None, [f"run.name={name}", "ring.slots=1", "ring.slot_bytes=8192", "ring.slot_header_bytes=4096"]
            )
        )
    ).close()
    os.chown(f"/dev/shm/dflash-ring.{name}", 65534, 65534)
    return []


def _model_dir_without_weights(tmp: Path, name: str) -> list[str]:
    d = tmp / "model"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen3",
                "hidden_size": 64,
                "num_hidden_layers": 6,
                "vocab_size": 100,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "intermediate_size": 128,
                "head_dim": 32,
            }
        )
    )
    return [
        "--set",
        f'target.path="{d}"',
        "--set",
        "target.mask_token_id=95",
    ]  # a mask: the drafter gets to the weights


def _huge_config(tmp: Path, name: str) -> list[str]:
    """A valid TOML file of 5 MB (comments): no config is that large, so it is not read whole."""
    (tmp / "huge.toml").write_text("# padding\n" * 500_000)
    return []


def _a_file(tmp: Path, name: str) -> list[str]:
    (tmp / "afile").write_text("x")
    return []


def _checkpoints(tmp: Path, layers: int = 1) -> tuple[Path, Path]:
    """A tiny target and two real checkpoints of a `layers`-layer drafter trained on it."""
    from dataclasses import asdict

    from dflash_ring.consumer.training.checkpoint import CheckpointStore
    from test_trainer_checkpoint import batch, make_trainer

    trainer, _ = make_trainer(tmp)
    store = CheckpointStore(tmp / "ckpt" / "drafter-0")
    for step in range(2):
        trainer.train_step(batch(step), 20)
        store.save(trainer.state({"drafter": asdict(trainer.drafter), "target_config": {}}), keep=3)
    return tmp / "target", store.root


def _corrupted_checkpoint(tmp: Path, name: str) -> list[str]:
    from test_trainer_checkpoint import flip_a_tensor_byte

    _, root = _checkpoints(tmp)
    flip_a_tensor_byte(root / "step-00000002" / "model.safetensors")
    return []


def _every_checkpoint_corrupted(tmp: Path, name: str) -> list[str]:
    """Both checkpoints of drafter 0 damaged: resumed from none, its training so far would be in no model."""
    from test_trainer_checkpoint import flip_a_tensor_byte

    target, root = _checkpoints(tmp)
    for step in ("step-00000001", "step-00000002"):
        flip_a_tensor_byte(root / step / "model.safetensors")
    sets = [f'target.path="{target}"', "target.mask_token_id=95", f'train.checkpoint_dir="{tmp / "ckpt"}"']
    return [a for s in sets for a in ("--set", s)]


def _checkpoint_of_one_layer(tmp: Path, name: str) -> list[str]:
    target, _ = _checkpoints(tmp)
    return [
        "--set",
        f'target.path="{target}"',
        "--set",
        "target.mask_token_id=95",
        "--set",
        f'train.checkpoint_dir="{tmp / "ckpt"}"',
        "--set",
        "drafter.num_hidden_layers=2",
    ]


def _ring_for_target(
    tmp: Path, name: str, data: Path, tokenizer: Path | None = None, slot_bytes: int = 8192
) -> list[str]:
    """A tiny target, `data`, and a live ring for them, so `dflash-ring target` gets as far as its data."""
    from support import build_target

    sets = [
        f'target.path="{build_target(tmp / "model", "qwen3", layers=4)}"',
        f'data.path="{data}"',
        f'data.cache_dir="{tmp / "cache"}"',
        f'train.checkpoint_dir="{tmp / "ckpt"}"',  # in the ring's fingerprint: as the test and the process resolve it
        "ring.slots=1",
        f"ring.slot_bytes={slot_bytes}",
        "ring.slot_header_bytes=4096",
    ]
    if tokenizer is not None:
        sets.append(f'target.tokenizer="{tokenizer}"')
    Ring.create(ring_spec(load_config(None, [*sets, f"run.name={name}"]))).close()
    return [a for s in sets for a in ("--set", s)]


def _missing_data(tmp: Path, name: str) -> list[str]:
    return _ring_for_target(tmp, name, tmp / "nope.jsonl")


def _empty_data(tmp: Path, name: str) -> list[str]:
    (tmp / "empty.jsonl").write_text("")
    return _ring_for_target(tmp, name, tmp / "empty.jsonl")


def _malformed_data(tmp: Path, name: str) -> list[str]:
    (tmp / "bad.jsonl").write_text('{"messages": "not a list"}\n{"prompt": ""}\n[1, 2]\n')
    return _ring_for_target(tmp, name, tmp / "bad.jsonl")


def _tokenizer_without_chat_template(tmp: Path, name: str) -> list[str]:
    from dflash_ring.embedded.tiny_tokenizer import tiny_chat_tokenizer
    from support import write_chat_rows

    tiny_chat_tokenizer(tmp / "plain-tokenizer", chat_template="")
    return _ring_for_target(tmp, name, write_chat_rows(tmp / "chat.jsonl", 4), tokenizer=tmp / "plain-tokenizer")


def _ring_with_data(tmp: Path, name: str) -> list[str]:
    """A tiny target, usable chat rows and a ring with room for a batch: a target that accepts its config gets as
    far as planning its epochs."""
    from support import write_chat_rows

    sets = _ring_for_target(tmp, name, write_chat_rows(tmp / "chat.jsonl", 4), slot_bytes=1 << 20)
    return sets + ["--set", "data.max_length=256", "--set", "data.max_tokens_per_batch=2048"]


def _mix(body: str) -> typing.Callable[[Path, str], list[str]]:
    """A setup writing {tmp}/mix.toml: `body` after a [data] section, {tmp} in it replaced."""

    def setup(tmp: Path, name: str) -> list[str]:
        (tmp / "mix.toml").write_text(f'[data]\ncache_dir = "{tmp / "cache"}"\n' + body.replace("{tmp}", str(tmp)))
        return []

    return setup


def _mix_with_a_bad_source(tmp: Path, name: str) -> list[str]:
    from dflash_ring.embedded.tiny_tokenizer import tiny_chat_tokenizer
    from support import write_chat_rows

    tiny_chat_tokenizer(tmp / "tok")
    write_chat_rows(tmp / "good.jsonl", 4)
    (tmp / "bad.jsonl").write_text('{"prompt": "no reply"}\n')
    return _mix(
        '[[data.sources]]\npath = "{tmp}/bad.jsonl"\n[[data.sources]]\npath = "{tmp}/good.jsonl"\n'
        '[target]\ntokenizer = "{tmp}/tok"\n'
    )(tmp, name)


DATA_STATS = ["data", "stats", "--config", "{tmp}/mix.toml"]


def _regenerate(
    tmp: Path, name: str = "", *, data: Path | None = None, tokenizer: Path | None = None, weights: bool = True
) -> list[str]:
    """A tiny target (or a model directory without weights), chat rows (or `data`), and an output directory:
    `dflash-ring regenerate` gets as far as its input allows."""
    from support import build_target, write_chat_rows

    if weights:
        sets = [f'target.path="{build_target(tmp / "model", "qwen3", layers=2)}"']
    else:
        sets = _model_dir_without_weights(tmp, name)[1::2]
    sets += [
        f'data.path="{data or write_chat_rows(tmp / "chat.jsonl", 3)}"',
        f'data.cache_dir="{tmp / "cache"}"',
        f'regenerate.output="{tmp / "out"}"',
        "regenerate.max_new_tokens=2",
    ]
    if tokenizer is not None:
        sets.append(f'target.tokenizer="{tokenizer}"')
    return [a for s in sets for a in ("--set", s)]


def _regenerate_missing_data(tmp: Path, name: str) -> list[str]:
    return _regenerate(tmp, data=tmp / "nope.jsonl")


def _regenerate_malformed_data(tmp: Path, name: str) -> list[str]:
    (tmp / "bad.jsonl").write_text('{"messages": "not a list"}\n{"prompt": ""}\n[1, 2]\n')
    return _regenerate(tmp, data=tmp / "bad.jsonl")


def _regenerate_without_weights(tmp: Path, name: str) -> list[str]:
    return _regenerate(tmp, weights=False)


def _regenerate_tokenizer_without_chat_template(tmp: Path, name: str) -> list[str]:
    from dflash_ring.embedded.tiny_tokenizer import tiny_chat_tokenizer

    tiny_chat_tokenizer(tmp / "plain-tokenizer", chat_template="")
    return _regenerate(tmp, tokenizer=tmp / "plain-tokenizer")


def _regenerated_once(tmp: Path, name: str) -> list[str]:
    """A finished regenerate job (greedy) in the output directory."""
    from dflash_ring.producer.regenerate import regenerate

    args = _regenerate(tmp)
    cfg = load_config(None, args[1::2])
    regenerate(cfg.regenerate, cfg.data, cfg.target)
    return args


def _truncate_weights(model: Path) -> None:
    """model.safetensors cut to half its size, as an interrupted copy leaves it."""
    weights = model / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)


def _truncated_target(tmp: Path, name: str) -> list[str]:
    from support import build_target

    model = build_target(tmp / "model", "qwen3", layers=4)
    _truncate_weights(model)
    return ["--set", f'target.path="{model}"', "--set", "target.mask_token_id=95"]


def _regenerate_truncated_weights(tmp: Path, name: str) -> list[str]:
    args = _regenerate(tmp)
    _truncate_weights(tmp / "model")
    return args


def _regenerate_every_prompt_fails(tmp: Path, name: str) -> list[str]:
    """A chat template that refuses every prompt: the engine fails each row, and the job must not pass for done."""
    from dflash_ring.embedded.tiny_tokenizer import tiny_chat_tokenizer

    tiny_chat_tokenizer(tmp / "tok", chat_template="{{ raise_exception('this template renders nothing') }}")
    return _regenerate(tmp, tokenizer=tmp / "tok")


def _damaged_cursor_file(tmp: Path, name: str) -> list[str]:
    """A producer of a live ring whose cursor file (its resume point once a ring is gone) is not JSON."""
    from support import build_target, write_chat_rows

    sets = [
        f'target.path="{build_target(tmp / "model", "qwen3", layers=4)}"',
        'target.device="cpu"',
        f'target.state_dir="{tmp / "state"}"',
        f'data.path="{write_chat_rows(tmp / "chat.jsonl", 4)}"',
        f'data.cache_dir="{tmp / "cache"}"',
        "data.max_length=128",
        "data.max_tokens_per_batch=256",
        f'train.checkpoint_dir="{tmp / "ckpt"}"',  # in the ring's fingerprint: as the test and the process resolve it
        "ring.slots=2",
        f"ring.slot_bytes={1 << 20}",
        "ring.slot_header_bytes=65536",
    ]
    Ring.create(ring_spec(load_config(None, [*sets, f"run.name={name}"]))).close()
    (tmp / "state" / name).mkdir(parents=True)
    (tmp / "state" / name / "producer-0.json").write_text('{"epoch": 1, "posit')
    return [a for s in sets for a in ("--set", s)]


def _target_with(field: str, raw: str) -> typing.Callable[[Path, str], list[str]]:
    """A tiny target whose config.json writes `field` as the JSON text `raw` (a value of the wrong type: [64],
    1e400, NaN), with a mask token: what transformers' strict config classes refuse (issue 34 item 1)."""

    def setup(tmp: Path, name: str) -> list[str]:
        from support import build_target

        model = build_target(tmp / "model", "qwen3", layers=4)
        text = (model / "config.json").read_text()
        value = json.loads(text)[field]
        (model / "config.json").write_text(text.replace(f'"{field}": {value}', f'"{field}": {raw}', 1))
        return ["--set", f'target.path="{model}"', "--set", "target.mask_token_id=95"]

    return setup


def _target_without_mask(tmp: Path, name: str) -> list[str]:
    from support import build_target

    return ["--set", f'target.path="{build_target(tmp / "model", "qwen3", layers=4)}"']


def _eval_files(tmp: Path, name: str) -> list[str]:
    """A tiny target and chat rows for `dflash-ring eval` (the drafter directory is never reached)."""
    from support import build_target, write_chat_rows

    build_target(tmp / "model", "qwen3", layers=4)
    write_chat_rows(tmp / "chat.jsonl", 2)
    return []


def _eval_target_with(field: str, raw: str) -> typing.Callable[[Path, str], list[str]]:
    def setup(tmp: Path, name: str) -> list[str]:
        from support import write_chat_rows

        _target_with(field, raw)(tmp, name)
        write_chat_rows(tmp / "chat.jsonl", 2)
        return []

    return setup


def _target_file(change: typing.Callable[[Path], object]) -> typing.Callable[[Path, str], list[str]]:
    """A tiny target (with a mask token) whose directory `change` damages: a weights file, the index, a tokenizer."""

    def setup(tmp: Path, name: str) -> list[str]:
        from support import build_target

        model = build_target(tmp / "model", "qwen3", layers=4)
        change(model)
        return ["--set", f'target.path="{model}"', "--set", "target.mask_token_id=95"]

    return setup


def _int8_weights(model: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    state = load_file(model / "model.safetensors")
    save_file({k: v.to(torch.int8) for k, v in state.items()}, model / "model.safetensors")


def _index_mapping_to_a_number(model: Path) -> None:
    header = json.loads((model / "model.safetensors").read_bytes()[8:].split(b"}}", 1)[0] + b"}}")
    weight_map = {k: 1 for k in header if k != "__metadata__"}
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _truncated_parquet(tmp: Path, name: str) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_ring.embedded.tiny_tokenizer import tiny_chat_tokenizer

    tiny_chat_tokenizer(tmp / "tok")
    pq.write_table(pa.table({"prompt": ["q"] * 8, "response": ["a"] * 8}), tmp / "rows.parquet")
    raw = (tmp / "rows.parquet").read_bytes()
    (tmp / "rows.parquet").write_bytes(raw[: len(raw) // 2])
    return _mix('path = "{tmp}/rows.parquet"\n[target]\ntokenizer = "{tmp}/tok"\n')(tmp, name)


def _tokenizer_not_json(tmp: Path, name: str) -> list[str]:
    from dflash_ring.embedded.tiny_tokenizer import tiny_chat_tokenizer
    from support import write_chat_rows

    tiny_chat_tokenizer(tmp / "tok")
    (tmp / "tok" / "tokenizer.json").write_text("not json")
    write_chat_rows(tmp / "chat.jsonl", 2)
    return _mix('path = "{tmp}/chat.jsonl"\n[target]\ntokenizer = "{tmp}/tok"\n')(tmp, name)


def _tokenizer_of_another_model(tmp: Path, name: str) -> list[str]:
    """A ring, a tiny target and data tokenized with another model's tokenizer (ids past the target's rows)."""
    from support import foreign_tokenizer

    tokenizer, words = foreign_tokenizer(tmp / "other")
    rows = [
        {"messages": [{"role": "user", "content": " ".join(words[i : i + 20])}, {"role": "assistant", "content": "x"}]}
        for i in range(0, 80, 20)
    ]
    (tmp / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = _ring_for_target(tmp, name, tmp / "chat.jsonl", tokenizer=tokenizer, slot_bytes=1 << 20)
    return sets + ["--set", "data.max_length=256", "--set", "data.max_tokens_per_batch=2048"]


def _records(*lines: str) -> typing.Callable[[Path, str], list[str]]:
    """RUN_DIR/tracking/drafter-0.jsonl holding these lines (a header first)."""

    def setup(tmp: Path, name: str) -> list[str]:
        (tmp / "tracking").mkdir()
        (tmp / "tracking" / "drafter-0.jsonl").write_text(
            '{"series": "config", "run": "r", "fingerprint": "abc"}\n' + "".join(f"{x}\n" for x in lines)
        )
        return []

    return setup


EVAL = ["eval", "--drafter", "{tmp}/nodrafter", "--target", "{tmp}/model", "--data", "{tmp}/chat.jsonl"]


# (id, setup(tmp, run) -> extra args, argv with {run} and {tmp}, what the line must say)
CASES = [
    ("status-invalid-name", None, ["status", ".."], "is not allowed"),
    ("clean-invalid-name", None, ["clean", "a/../b"], "is not allowed"),
    ("stop-missing-run", None, ["stop", "{run}", "--timeout", "1"], "no ring for run"),
    ("status-foreign-run", _foreign_ring, ["status", "{run}"], "belongs to uid 65534"),
    ("clean-foreign-run", _foreign_ring, ["clean", "{run}"], "belongs to uid 65534"),
    ("missing-config", None, ["status", "--config", "{tmp}/nope.toml"], "does not exist"),
    (
        "config-too-large",
        _huge_config,
        ["status", "--config", "{tmp}/huge.toml"],
        "config file {tmp}/huge.toml is larger than 4 MiB",
    ),
    ("export-unwritable", _a_file, ["export", "{tmp}/ckpt", "{tmp}/afile/out"], "is not a directory"),
    ("export-no-checkpoint", None, ["export", "{tmp}/ckpt", "{tmp}/out"], "{tmp}/ckpt does not exist: give a"),
    ("target-index-out-of-range", None, ["target", "--index", "3", *NO_METRICS], "--index 3 is out of range"),
    ("drafter-index-out-of-range", None, ["drafter", "--index", "3", *NO_METRICS], "--index 3 is out of range"),
    ("drafter-no-target", None, ["drafter", "--index", "0", *NO_METRICS], "target.path is empty"),
    (
        "drafter-tracking-dir-a-file",
        _a_file,
        ["drafter", "--index", "0", *NO_METRICS, "--set", 'tracking.dir="{tmp}/afile/x"'],
        "tracking.dir: output directory {tmp}/afile/x: {tmp}/afile is not a directory",
    ),
    (  # every role checks the directories it may write into by key before it starts (as check-config does)
        "target-state-dir-a-file",
        _a_file,
        ["target", "--index", "0", *NO_METRICS, "--set", 'target.state_dir="{tmp}/afile/x"'],
        "target.state_dir: output directory {tmp}/afile/x: {tmp}/afile is not a directory",
    ),
    ("report-no-records", None, ["report", "{tmp}"], "no drafter record files (drafter-<j>.jsonl) in {tmp}/tracking"),
    (
        "drafter-model-without-weights",
        _model_dir_without_weights,
        ["drafter", "--index", "0", *NO_METRICS],
        "no model.safetensors",
    ),
    (
        "export-corrupted-latest",
        _corrupted_checkpoint,
        ["export", "{tmp}/ckpt/drafter-0", "{tmp}/out"],
        "step-00000002/model.safetensors does not match the sha256 in its manifest.json",
    ),
    (
        "export-corrupted-step",
        _corrupted_checkpoint,
        ["export", "{tmp}/ckpt/drafter-0/step-00000002", "{tmp}/out"],
        "step-00000002/model.safetensors does not match the sha256 in its manifest.json",
    ),
    (
        "drafter-every-checkpoint-refused",
        _every_checkpoint_corrupted,
        ["drafter", "--index", "0", *NO_METRICS],
        "every checkpoint under {tmp}/ckpt/drafter-0 is refused (step-00000002, step-00000001; step-00000002: ",
    ),
    (
        "drafter-resume-other-layer-count",
        _checkpoint_of_one_layer,
        ["drafter", "--index", "0", *NO_METRICS],
        "drafter.num_hidden_layers = 1 there, 2 here",
    ),
    ("target-missing-data", _missing_data, ["target", "--index", "0", *NO_METRICS], "nope.jsonl does not exist"),
    ("target-empty-data", _empty_data, ["target", "--index", "0", *NO_METRICS], "has no rows"),
    ("target-all-malformed-data", _malformed_data, ["target", "--index", "0", *NO_METRICS], "no usable row"),
    (
        "target-tokenizer-without-chat-template",
        _tokenizer_without_chat_template,
        ["target", "--index", "0", *NO_METRICS],
        "has no chat template",
    ),
    (
        "mix-path-and-sources",
        _mix('path = "{tmp}/a.jsonl"\n[[data.sources]]\npath = "{tmp}/b.jsonl"\n'),
        DATA_STATS,
        "data.path = '{tmp}/a.jsonl' and [[data.sources]] are both set",
    ),
    (
        "mix-bad-weight",
        _mix('[[data.sources]]\npath = "a.jsonl"\n[[data.sources]]\npath = "b.jsonl"\nweight = 0\n'),
        DATA_STATS,
        "data.sources[1].weight = 0.0: must be a finite number > 0",
    ),
    (
        "mix-duplicate-name",
        _mix('[[data.sources]]\npath = "x/a.jsonl"\n[[data.sources]]\npath = "b.jsonl"\nname = "a"\n'),
        DATA_STATS,
        "data.sources[0] and data.sources[1] are both named 'a'",
    ),
    (
        "mix-unknown-key",
        _mix('[[data.sources]]\npath = "a.jsonl"\nrepeats = true\n'),
        DATA_STATS,
        "unknown config key 'repeats' in [data.sources[0]]",
    ),
    ("mix-source-without-usable-rows", _mix_with_a_bad_source, DATA_STATS, "no usable row in {tmp}/bad.jsonl"),
    ("regenerate-no-output", None, ["regenerate", *NO_METRICS], "regenerate.output is empty"),
    (
        "regenerate-bad-setting",
        None,
        ["regenerate", "--set", "regenerate.shard_rows=0"],
        "regenerate.shard_rows = 0: must be an integer >= 1",
    ),
    (
        "regenerate-bad-engine",
        None,
        ["regenerate", "--set", "regenerate.engine=vllm"],
        "regenerate.engine = 'vllm': expected one of 'hf', 'openai'",
    ),
    ("regenerate-no-target", None, ["regenerate", "--set", "regenerate.output=out", *NO_METRICS], "set target.path"),
    ("regenerate-missing-data", _regenerate_missing_data, ["regenerate", *NO_METRICS], "nope.jsonl does not exist"),
    ("regenerate-all-rows-bad", _regenerate_malformed_data, ["regenerate", *NO_METRICS], "no usable row"),
    (
        "regenerate-model-without-weights",
        _regenerate_without_weights,
        ["regenerate", *NO_METRICS],
        "no model.safetensors or model.safetensors.index.json",
    ),
    (
        "regenerate-tokenizer-without-chat-template",
        _regenerate_tokenizer_without_chat_template,
        ["regenerate", *NO_METRICS],
        "has no chat template",
    ),
    (
        "regenerate-resume-other-settings",
        _regenerated_once,
        ["regenerate", "--set", "regenerate.temperature=0.5", *NO_METRICS],
        "regenerate.temperature = 0.0 there, 0.5 here",
    ),
    (
        "regenerate-a-mixture",
        _mix('[[data.sources]]\npath = "a.jsonl"\n'),
        ["regenerate", "--config", "{tmp}/mix.toml", "--set", "regenerate.output=out", *NO_METRICS],
        "regenerate reads one data set, data.path, and [[data.sources]] is set",
    ),
    (
        "check-target-truncated-weights",
        _truncated_target,
        ["check-target"],
        "{tmp}/model/model.safetensors is not a readable safetensors file",
    ),
    (
        "drafter-truncated-weights",
        _truncated_target,
        ["drafter", "--index", "0", *NO_METRICS],
        "{tmp}/model/model.safetensors is not a readable safetensors file",
    ),
    (
        "regenerate-truncated-weights",
        _regenerate_truncated_weights,
        ["regenerate", *NO_METRICS],
        "{tmp}/model/model.safetensors is not a readable safetensors file",
    ),
    (
        "regenerate-metrics-port-past-65535",
        _regenerate,
        ["regenerate", "--set", "metrics.port_base=65400"],
        "past 65535",
    ),
    # Issue 23 item 5: numbers out of range were accepted (NaN passes `lr <= 0`), crashed later (a negative sleep:
    # a traceback) or planned work without end (a producer planning a trillion epochs, deaf to SIGTERM).
    (
        "lr-nan",
        None,
        ["status", "--set", "run.name={run}", "--set", "train.lr=nan"],
        "train.lr = nan: must be a finite number > 0",
    ),
    (
        "kl-weight-nan",
        None,
        ["status", "--set", "run.name={run}", "--set", "drafter.kl_weight=nan"],
        "drafter.kl_weight = nan: must be a finite number >= 0",
    ),
    (
        "supervisor-negative-reap-interval",
        None,
        [
            "supervisor",
            "--set",
            "run.name={run}",
            "--set",
            'run.run_dir="{tmp}/locks"',
            *NO_METRICS,
            "--set",
            "supervisor.reap_interval_s=-1",
        ],
        "supervisor.reap_interval_s = -1.0: must be a finite number > 0",
    ),
    (
        "target-a-trillion-epochs",
        _ring_with_data,
        ["target", "--index", "0", *NO_METRICS, "--set", "data.epochs=1_000_000_000_000"],
        "data.epochs = 1_000_000_000_000: must be an integer >= 1 and <= 10000",
    ),
    (
        "chaos-unknown-stop-mode",
        None,
        ["chaos", "--stop-modes", "stall-stop-now,pause", "--workdir", "{tmp}/c"],
        "--stop-modes pause: not a whole-run stop; choose among stop-now, sigterm-all, sigkill-all, stall-stop-now",
    ),
    # Issue 30: the 27B's ddtree step at 4 x 3072 died of CUDA OOM minutes in; the estimate refuses it first.
    (
        "bench-drafter-does-not-fit",
        None,
        [
            "bench",
            "drafter",
            "--shape",
            "qwen3.6-27b",
            "--recipe",
            "ddtree",
            "--seqs",
            "4",
            "--seq-len",
            "3072",
            "--gpu-memory-gib",
            "140",
        ],
        "--seqs 4 --seq-len 3072 does not fit",
    ),
    # Issue 34: inputs that ended in a traceback. A target config.json field transformers' strict config classes
    # refuse is one TargetConfigError at the one loading point (common/target_loading.load_target_hf_config).
    (
        "check-target-hidden-size-a-list",
        _target_with("hidden_size", "[64]"),
        ["check-target"],
        "{tmp}/model/config.json: transformers refuses it (Validation error for field 'hidden_size'",
    ),
    (
        "check-config-hidden-size-inf",
        _target_with("hidden_size", "1e400"),
        ["check-config"],
        "{tmp}/model/config.json: transformers refuses it (Validation error for field 'hidden_size'",
    ),
    (
        "drafter-layers-nan",
        _target_with("num_hidden_layers", "NaN"),
        ["drafter", "--index", "0", *NO_METRICS],
        "Validation error for field 'num_hidden_layers'",
    ),
    (
        "eval-hidden-size-a-list",
        _eval_target_with("hidden_size", "[64]"),
        EVAL,
        "{tmp}/model/config.json: transformers refuses it (Validation error for field 'hidden_size'",
    ),
    (
        "drafter-no-mask-token",
        _target_without_mask,
        ["drafter", "--index", "0", *NO_METRICS],
        "target.mask_token_id is unset",
    ),
    ("check-config-no-mask-token", _target_without_mask, ["check-config"], "target.mask_token_id is unset"),
    ("eval-no-cuda", _eval_files, [*EVAL, "--device", "cuda:0"], "device 'cuda:0': no CUDA device here"),
    (
        "report-record-not-an-object",
        _records("[1, 2]"),
        ["report", "{tmp}"],
        "record file {tmp}/tracking/drafter-0.jsonl, line 2: expected a JSON object, got list",
    ),
    (
        "report-record-without-step",
        _records('{"series": "train", "loss": 1.0}'),
        ["report", "{tmp}"],
        'line 2: a logged step needs an integer "step", got None',
    ),
    (
        "report-record-string-loss",
        _records('{"step": 1, "series": "train", "loss": "low"}'),
        ["report", "{tmp}"],
        "line 2: 'loss' = 'low': expected a number",
    ),
    (
        "report-record-without-series",
        _records('{"step": 1, "loss": 1.0}'),
        ["report", "{tmp}"],
        'line 2: a logged step needs a string "series"',
    ),
    (
        "chaos-stops-without-kills",
        None,
        ["chaos", "--kills", "0", "--whole-run-stops", "3", "--workdir", "{tmp}/c"],
        "--whole-run-stops 3 with --kills 0",
    ),
    (
        "supervisor-hidden-size-a-list",
        _target_with("hidden_size", "[64]"),
        ["supervisor", "--set", "run.name={run}", "--set", 'run.run_dir="{tmp}/locks"', *NO_METRICS],
        "{tmp}/model/config.json: transformers refuses it (Validation error for field 'hidden_size'",
    ),
    (
        "check-target-zero-heads",
        _target_with("num_attention_heads", "0"),
        ["check-target"],
        "{tmp}/model: transformers cannot build the model its config.json describes (ZeroDivisionError",
    ),
    (
        "check-config-zero-heads",
        _target_with("num_attention_heads", "0"),
        ["check-config"],
        "{tmp}/model: transformers cannot build the model its config.json describes (ZeroDivisionError",
    ),
    (
        "check-config-width-not-the-weights",
        _target_with("hidden_size", "65"),
        ["check-config"],
        "config.json makes lm_head.weight of shape [410, 65], its weights hold [410, 64]",
    ),
    (
        "check-config-tracking-dir-a-file",
        _a_file,
        ["check-config", "--set", 'tracking.dir="{tmp}/afile/x"'],
        "tracking.dir: output directory {tmp}/afile/x: {tmp}/afile is not a directory",
    ),
    (
        "report-out-not-png",
        _records('{"step": 1, "series": "train", "loss": 1.0}'),
        ["report", "{tmp}", "--out", "{tmp}/x.jpgx"],
        "--out {tmp}/x.jpgx: the report is a PNG",
    ),
    # Issue 34 goal 4 for data and model directories: inputs that were tracebacks (a parquet file cut short, a
    # tokenizer.json that is not JSON, an index mapping tensors to a number) or loaded in silence (int8 weights).
    (
        "data-stats-truncated-parquet",
        _truncated_parquet,
        DATA_STATS,
        "data set {tmp}/rows.parquet cannot be read as format 'parquet'",
    ),
    ("data-stats-tokenizer-not-json", _tokenizer_not_json, DATA_STATS, "target tokenizer {tmp}/tok: transformers"),
    (
        "check-target-int8-weights",
        _target_file(_int8_weights),
        ["check-target"],
        "its weights hold lm_head.weight as I8, not a floating type",
    ),
    (
        "check-config-index-maps-a-number",
        _target_file(_index_mapping_to_a_number),
        ["check-config"],
        "model.safetensors.index.json maps tensors to 1, not the file name of a shard",
    ),
    (
        "bench-regenerate-no-cuda",
        None,
        ["bench", "regenerate", "--shape", "tiny", "--device", "cuda:0"],
        "device 'cuda:0': no CUDA device here",
    ),
]


@pytest.mark.processes
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_invocation_is_one_line_exit_2(tmp_path, case):
    ident, setup, argv, says = case
    if setup is _foreign_ring and os.geteuid() != 0:
        pytest.skip("needs root to hand a segment to another uid")
    if ident in ("eval-no-cuda", "bench-regenerate-no-cuda"):
        import torch

        if torch.cuda.is_available():
            pytest.skip("this host has a CUDA device")
    name = f"e{os.getpid()}-{ident[:20]}"
    try:
        extra = setup(tmp_path, name) if setup else []
        args = [a.format(run=name, tmp=tmp_path) for a in argv] + extra
        if args[0] in ("target", "drafter"):
            args += ["--set", f"run.name={name}", "--set", "run.attach_timeout_s=0"]
        out = subprocess.run(
            [sys.executable, "-m", "dflash_ring", *args], cwd=tmp_path, capture_output=True, text=True, timeout=120
        )
    finally:
        for p in Path("/dev/shm").glob(f"*dflash-ring.{name}*"):
            p.unlink()
    lines = [ln for ln in out.stderr.strip().splitlines() if not PROGRESS_BAR.search(ln)]
    assert out.returncode == 2 and "Traceback" not in out.stderr and len(lines) == 1, (out.returncode, out.stderr)
    assert lines[0].startswith(f"dflash-ring {args[0]}: error: ") and says.format(tmp=tmp_path, run=name) in lines[0], (
        lines[0]
    )


@pytest.mark.processes
def test_help_imports_neither_torch_nor_transformers():
    """`dflash-ring --help` answers at once: parsing must not wait for torch or transformers."""
    code = (
        "import sys\nfrom dflash_ring.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


# Errors after the process has started its work (loaded its model, logged what it does): its last line is the
# one error line, with no traceback, and it exits 2.
LATE_CASES = [
    (
        "regenerate-every-prompt-fails",
        _regenerate_every_prompt_fails,
        ["regenerate", *NO_METRICS],
        "the engine failed on every prompt it was given (3 rows of 1 shards; row 0: chat template failed",
    ),
    (
        "target-tokenizer-of-another-model",
        _tokenizer_of_another_model,
        ["target", "--index", "0", *NO_METRICS],
        "past the 410 embedding rows of the target",
    ),
    (
        "target-damaged-cursor-file",
        _damaged_cursor_file,
        ["target", "--index", "0", *NO_METRICS],
        "cursor file {tmp}/state/{run}/producer-0.json cannot be read",
    ),
]


@pytest.mark.processes
@pytest.mark.parametrize("case", LATE_CASES, ids=[c[0] for c in LATE_CASES])
def test_a_late_error_ends_in_one_line_exit_2(tmp_path, case):
    ident, setup, argv, says = case
    name = f"e{os.getpid()}-{ident[:20]}"
    try:
        args = [*argv, *setup(tmp_path, name)]
        if args[0] == "target":
            args += ["--set", f"run.name={name}", "--set", "run.attach_timeout_s=0"]
        out = subprocess.run(
            [sys.executable, "-m", "dflash_ring", *args], cwd=tmp_path, capture_output=True, text=True, timeout=300
        )
    finally:
        for p in Path("/dev/shm").glob(f"*dflash-ring.{name}*"):
            p.unlink()
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 2 and "Traceback" not in out.stderr, (out.returncode, out.stderr)
    assert last.startswith(f"dflash-ring {args[0]}: error: ") and says.format(tmp=tmp_path, run=name) in last, last
    if args[0] == "regenerate":
        assert not list((tmp_path / "out" / ".regenerate").glob("shard-*.json")), "a failed shard was recorded"


def test_report_prints_the_file_it_writes(tmp_path, capsys):
    """`report --out X` writes X.png (matplotlib adds the suffix): the line names X.png, which exists."""
    from dflash_ring.cli import main

    _records(
        '{"step": 1, "series": "train", "loss": 2.0, "accept_len": 1.5}',
        '{"step": 2, "series": "train", "loss": 1.0, "accept_len": 2.0}',
    )(tmp_path, "")
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "X")]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"{tmp_path / 'X.png'}: ") and (tmp_path / "X.png").is_file(), printed


# Refused by argparse itself (its usage lines, then the error line, exit 2), before anything loads.
ARGPARSE_CASES = [
    (["--limit", "0"], "argument --limit: must be at least 1, got 0"),
    (["--limit", "-1"], "argument --limit: must be at least 1, got -1"),
    (["--tree-budget", "16,1000000000"], "a tree budget is at most 4096 draft nodes, got [1000000000]"),
    (["--max-new-tokens", "0"], "argument --max-new-tokens: must be at least 1, got 0"),
]


@pytest.mark.parametrize(
    "extra,says", ARGPARSE_CASES, ids=["limit-0", "limit-negative", "tree-budget-huge", "max-new-tokens-0"]
)
def test_eval_argument_refused_exit_2(capsys, extra, says):
    from dflash_ring.cli import main

    with pytest.raises(SystemExit) as e:
        main(["eval", "--drafter", "d", "--target", "t", "--data", "x.jsonl", *extra])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and last.startswith("dflash-ring eval: error: ") and says in last, last


@pytest.mark.parametrize("bench", ["drafter", "precision", "topology"])
def test_a_bench_recipe_is_one_of_the_recipes_and_its_help_lists_them(capsys, bench):
    """An unknown --recipe was the drafter config's ValueError (a traceback) after the bench had loaded torch; now
    argparse refuses it, and the help lists RECIPES (it had left dflash2 out)."""
    from dflash_ring.cli import main
    from dflash_ring.common.config.drafter import RECIPES

    with pytest.raises(SystemExit) as e:
        main(["bench", bench, "--recipe", "bogus"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and last.startswith(f"dflash-ring bench {bench}: error: argument --recipe"), last
    with pytest.raises(SystemExit):
        main(["bench", bench, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(recipe in text for recipe in RECIPES), text


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    """Every command's parser (subcommands within subcommands) and every bench's own (its add_arguments)."""
    import importlib

    from dflash_ring.cli import BENCHES, _parser

    found, todo = [], [("dflash-ring", _parser())]
    while todo:
        name, parser = todo.pop()
        found.append((name, parser))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += [(f"{name} {sub}", p) for sub, p in action.choices.items() if not name.endswith("bench")]
    for bench in BENCHES:
        parser = argparse.ArgumentParser()
        importlib.import_module(f"dflash_ring.bench.{bench}").add_arguments(parser)
        found.append((f"dflash-ring bench {bench}", parser))
    return found


# Options whose range is checked where they are read, by a test of their own (eval's temperature: test_eval_*).
CHECKED_ELSEWHERE = {("dflash-ring eval", "--temperature")}


def test_every_numeric_option_declares_its_range():
    """The rule of common/arguments.py: a bare int or float took -1, 0, nan or inf (a traceback later, a wait
    without end: stop --timeout nan, or nothing done silently); each numeric option has a checked type instead."""
    bare = [
        f"{name} {action.option_strings[0]}"
        for name, parser in _parsers()
        for action in parser._actions
        if action.type in (int, float) and (name, action.option_strings[0]) not in CHECKED_ELSEWHERE
    ]
    assert not bare, f"numeric options without a range (use a type of common/arguments.py): {bare}"


EVAL = ["eval", "--drafter", "d", "--target", "t", "--data", "x.jsonl"]


@pytest.mark.parametrize(
    "argv,says",
    [
        (["stop", "--timeout", "nan", "r"], "argument --timeout: must be a finite number > 0, got nan"),
        (["stop", "--timeout", "-1", "r"], "argument --timeout: must be a finite number > 0, got -1"),
        (["chaos", "--seconds", "1e400"], "argument --seconds: must be a finite number > 0"),
        (["chaos", "--seconds", "-1"], "argument --seconds: must be a finite number > 0, got -1"),
        (["chaos", "--kills", "x"], "argument --kills: expected an integer, got 'x'"),
        (["drafter", "--index", "-1"], "argument --index: must be 0 or more, got -1"),
        ([*EVAL, "--threads", "-1"], "argument --threads: must be 0 or more, got -1"),  # was torch's, after loading
        ([*EVAL, "--seed", "-1"], "argument --seed: a seed is 0..4294967295, got -1"),
        (["regenerate", "--threads", "-2"], "argument --threads: must be 0 or more, got -2"),
        (["bench", "loader", "--samples", "-1"], "argument --samples: must be at least 1, got -1"),  # numpy's error
        (["bench", "pipeline", "--port-base", "70000"], "argument --port-base: a TCP port is 1..65535, got 70000"),
        (["bench", "pipeline", "--seconds", "nan"], "argument --seconds: must be a finite number > 0, got nan"),
        (["bench", "target", "--peak-tflops", "0"], "argument --peak-tflops: must be a finite number > 0, got 0"),
    ],
)
def test_a_numeric_option_out_of_its_range_is_argparse_s_refusal(capsys, argv, says):
    from dflash_ring.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and says in last, last


@pytest.mark.parametrize(
    "argv",
    [["run", "--workdir"], ["chaos", "--workdir"], ["bench", "recipes", "--workdir"], ["bench", "checkpoint", "--dir"]],
    ids=["run", "chaos", "bench-recipes", "bench-checkpoint"],
)
def test_a_work_directory_option_that_is_a_file_is_argparse_s_refusal(tmp_path, capsys, argv):
    """run --workdir FILE printed the embedded default's banner, then `[Errno 17] File exists` naming no option."""
    from dflash_ring.cli import main

    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit) as e:
        main([*argv, str(tmp_path / "afile" / "w")])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    says = f"argument {argv[-1]}: output directory {tmp_path}/afile/w: {tmp_path}/afile is not a directory"
    assert e.value.code == 2 and says in last, last


@pytest.mark.parametrize("command", ["run", "chaos"])
def test_home_that_is_a_file_is_one_line_naming_home(tmp_path, capsys, monkeypatch, command):
    """The embedded default's cache lives under $HOME: with HOME a file, run printed its banner and then '[Errno 20]
    Not a directory' from deep inside the tiny target's build; now one line naming HOME and what to do."""
    from dflash_ring.cli import main

    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("HOME", str(tmp_path / "afile"))
    assert main([command, "--workdir", str(tmp_path / "w")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"dflash-ring {command}: error: the embedded default's cache ~/.cache/dflash_ring"), line
    assert line.endswith("set HOME to a directory you can write to"), line


@pytest.mark.parametrize(
    "argv,says",
    [
        (["run", "--set", "ring.slots=abc"], "ring.slots = 'abc': expected int, got str"),
        (["run", "--set", "ring.nope=1"], "unknown config key 'nope' in [ring]"),
        (["run", "--set", "rnig.slots=1"], "unknown config key 'rnig' in the top level"),
        (["chaos", "--no-baseline", "--set", "train.lr=-1"], "train.lr = -1.0: must be a finite number > 0"),
        (["chaos", "--set", 'data.path="a'], "is not a valid TOML value"),
    ],
    ids=["run-type", "run-key", "run-section", "chaos-range", "chaos-quote"],
)
def test_a_bad_override_of_the_embedded_default_is_refused_before_anything_is_built(tmp_path, capsys, argv, says):
    """run and chaos write their config late (the embedded default, after building the tiny target): a bad --set was
    refused only then, after the banner and the build's lines (8 stderr lines for run)."""
    from dflash_ring.cli import main

    assert main([*argv, "--workdir", str(tmp_path / "w")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"dflash-ring {argv[0]}: error: ") and says in line, line
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("command", ["status", "stop", "clean"])
def test_a_directory_under_a_ring_s_name_in_dev_shm_is_one_line(capsys, command):
    """posix_ipc answers a directory at /dev/shm/dflash-ring.RUN with a bare ValueError ('Invalid parameter(s)'): a
    traceback from status, stop, clean and every role; now a ForeignObjectError naming it (not ours to remove)."""
    from dflash_ring.cli import main

    name = f"shmdir{os.getpid()}"
    taken = Path("/dev/shm") / f"dflash-ring.{name}"
    taken.mkdir()
    try:
        assert main([command, name]) == 2
    finally:
        taken.rmdir()
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"dflash-ring {command}: error: {taken} is a directory, not a shared-memory object"), line


@pytest.mark.parametrize("columns,width", [("abc", 200), ("-5", 200), ("", 200), ("0", 200), ("120", 120)])
def test_columns_that_is_no_width_is_ignored(monkeypatch, columns, width):
    """COLUMNS is the terminal's hint for the launcher's console (run, regenerate, bench recipes): one that is not a
    positive integer was int()'s ValueError, a traceback; now ignored, as shutil and rich ignore it."""
    from dflash_ring.tools.launcher import console

    monkeypatch.setenv("COLUMNS", columns)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert console().width == width


def test_export_of_a_path_that_holds_no_checkpoint_says_what_to_give(tmp_path, capsys):
    """A file or FIFO was `[Errno 20] Not a directory: .../latest`; a directory without a checkpoint named no fix."""
    from dflash_ring.cli import main

    (tmp_path / "afile").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "empty").mkdir()
    for bad, says in (
        ("afile", "is not a directory"),
        ("fifo", "is not a directory"),
        ("missing", "does not exist"),
        ("empty", "no complete checkpoint under"),
    ):
        assert main(["export", str(tmp_path / bad), str(tmp_path / "out")]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and says in lines[0] and "train.checkpoint_dir/drafter-N" in lines[0], lines
