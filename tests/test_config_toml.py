"""dump_toml is the one writer of run configs: what it writes, load_config reads back equal."""

from __future__ import annotations

import dataclasses
import tomllib
import typing

from dflash_ring.common.config.dump import dump_toml
from dflash_ring.common.config.load import load_config
from dflash_ring.common.config.schema import Config


def _changed(value: typing.Any, hint: typing.Any) -> typing.Any:
    """A value of the field's type that differs from its default (strings that need escaping)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if args and typing.get_origin(hint) not in (list, typing.Literal):  # X | None: a value of X
        hint = args[0]
        args = list(typing.get_args(hint))
    if typing.get_origin(hint) is typing.Literal:
        return next(a for a in args if a != value)
    if hint is bool:
        return not value
    if hint is int:
        return (value or 0) + 1_234_567
    if hint is float:
        return 0.1 + (value or 0) / 3
    if hint is str:
        return 'a "b" \\c\td\né\x7f'
    (item,) = typing.get_args(hint)
    if dataclasses.is_dataclass(item):  # a list of tables ([[data.sources]]): every field of each changed
        hints = typing.get_type_hints(item)
        return [
            item(
                **{f.name: _changed(getattr(item(path=path), f.name), hints[f.name]) for f in dataclasses.fields(item)}
                | {"path": path}
            )
            for path in ("a.jsonl", "b/c d.jsonl")
        ]
    if typing.get_origin(item) is typing.Literal:  # a list of choices (tracking.backends): two of them
        return list(typing.get_args(item))[:2]
    return [item(1), item(2)] if item is not str else ["x", 'y"']


def test_every_field_round_trips_through_toml():
    cfg, expected = Config(), {}
    for section in dataclasses.fields(Config):
        value = getattr(cfg, section.name)
        hints = typing.get_type_hints(type(value))
        for f in dataclasses.fields(value):
            object.__setattr__(value, f.name, _changed(getattr(value, f.name), hints[f.name]))
        expected[section.name] = dataclasses.asdict(value)
    text = dump_toml(cfg, full=True)
    assert tomllib.loads(text) == expected
    assert tomllib.loads(dump_toml(cfg)) == expected  # nothing is a default any more


def test_a_run_config_round_trips_and_writes_only_what_differs(tmp_path):
    cfg = load_config(
        None,
        [
            "run.name=tiny",
            f"run.run_dir={tmp_path / 'locks'}",
            "ring.slots=4",
            "ring.slot_bytes=8388608",
            "topology.consumers=2",
            "target.layer_ids=[1, 2]",
            "target.mask_token_id=642",
            "train.lr=3e-3",
            "data.path=/data/a b.jsonl",
        ],
    )
    text = dump_toml(cfg, header="written by a test\ncopy me", comments={"metrics": "ports", "train.lr": "peak"})
    path = tmp_path / "run.toml"
    path.write_text(text)
    assert load_config(path) == cfg
    assert text.startswith("# written by a test\n# copy me\n")
    assert "[supervisor]" not in text and "[metrics]" not in text  # all defaults: no section
    assert "consumers" not in text  # 2 is the default
    assert "slot_bytes = 8_388_608" in text and "# peak\nlr = 0.003" in text
    full = tmp_path / "full.toml"
    full.write_text(dump_toml(cfg, full=True))
    assert load_config(full) == cfg
    assert "[supervisor]" in full.read_text() and "mask_token_id = 642" in full.read_text()


def test_defaults_write_an_empty_config(tmp_path):
    assert dump_toml(Config()) == "\n"
    (tmp_path / "c.toml").write_text(dump_toml(Config()))
    assert load_config(tmp_path / "c.toml") == Config()


def test_derived_fields_are_left_out(tmp_path):
    """drafter.layer_types follows num_hidden_layers: written, it would contradict an edited layer count."""
    cfg = load_config(None, ["drafter.num_hidden_layers=3"])
    text = dump_toml(cfg)
    assert "layer_types" not in text and "num_hidden_layers = 3" in text
    (tmp_path / "c.toml").write_text(text.replace("= 3", "= 4"))
    assert load_config(tmp_path / "c.toml").drafter.layer_types == ["full_attention"] * 4
    assert "layer_types" in dump_toml(
        load_config(
            None,
            [
                "drafter.num_hidden_layers=2",
                'drafter.layer_types=["sliding_attention", "full_attention"]',
                "drafter.sliding_window=64",
            ],
        )
    )
