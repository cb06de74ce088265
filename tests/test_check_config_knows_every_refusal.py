"""`dflash-ring check-config` knows what every role refuses (issue 46, goal 6): it runs each role's own check of
the config and of the files the config names, so a config it passes is refused by no role at its start.

Two halves. The table (CASES): one config edit per role check, refused by the role's own function called here,
in-process, and by check-config on the same config, exit 2, in one line with the same words. The walk
(ROLE_STARTS): the calls a role makes at its start, read from the source, whose names say they check
(`check_*`, `*_refusal`, and CHECK_NAMES); each is run by check-config (RUN_BY_CHECK_CONFIG: the same function,
imported from the same module, and a case of the table), or not a check of the config (NOT_CONFIG, with why). A new
check in a role's start that check-config does not run fails here.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from dflash_ring.cli import main
from dflash_ring.common.config.load import load_config
from dflash_ring.common.refusal import Refusal
from support import build_target

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "dflash-ring check-config: error: "
CORES = os.cpu_count() or 1

# ---- the table ----------------------------------------------------------------------------------------------------


def _cfg(path: Path, edits: list[str]):
    return load_config(str(path), edits)


def _pick_device(path, edits):
    from dflash_ring.consumer.training.process import pick_device

    pick_device(_cfg(path, edits).train.device, 0)  # run_drafter: pick_device(device_name or cfg.train.device, ...)


def _resolve_device(path, edits):
    from dflash_ring.producer.target import resolve_device

    resolve_device(_cfg(path, edits).target.device)  # run_producer


def _check_precision(path, edits):
    from dflash_ring.consumer.modeling.fp8 import check_precision

    cfg = _cfg(path, edits)
    check_precision(cfg.drafter.precision, cfg.train.device)  # run_drafter


def _chaos_refusal(path, edits):
    from dflash_ring.tools.chaos import ChaosOptions

    return ChaosOptions(kills=1, seconds=30.0, seed=0, workdir=path.parent, config=str(path), overrides=edits).refusal()


def _check_num_proc(path, edits):
    from dflash_ring.common.host_bounds import check_num_proc

    check_num_proc(_cfg(path, edits).data.num_proc)  # run_producer


def _check_group(path, edits):
    from dflash_ring.producer.target import resolve_device
    from dflash_ring.producer.tensor_group import check_group

    cfg = _cfg(path, edits)
    check_group(cfg.target, resolve_device(cfg.target.device))  # run_producer


def _drafter_target_settings(path, edits):
    from dflash_ring.consumer.training.process import resolve_drafter_config

    cfg = _cfg(path, edits)
    resolve_drafter_config(cfg.drafter, cfg.target)  # the drafter's build: drafter_target_settings


def _check_mask_token(path, edits):
    from dflash_ring.producer.pretokenized import target_tokenizer
    from dflash_ring.producer.process import check_mask_token

    cfg = _cfg(path, edits)
    check_mask_token(cfg, target_tokenizer(cfg.target))  # the producer's load_data


def _check_slot_fits(path, edits):
    """As choose_layout calls it: with the numbers of the target the producer has loaded."""
    import torch

    from dflash_ring.producer.process import check_slot_fits
    from dflash_ring.producer.target import TargetModel

    cfg = _cfg(path, edits)
    target = TargetModel.load(cfg.target, torch.device("cpu"), packed=False)
    hidden = target.hidden_size if target.final_hidden else None
    check_slot_fits(cfg.ring, cfg.data.max_tokens_per_batch, target.feature_width, hidden, target.dtype)


def _check_release(path, edits):
    from dflash_ring.consumer.training.process import resolve_drafter_config, target_config_dict
    from dflash_ring.consumer.training.warm_start import check_release

    cfg = _cfg(path, edits)  # as the drafter's first start (Resumed.load -> warm_start) reads drafter.init_from
    check_release(
        resolve_drafter_config(cfg.drafter, cfg.target), target_config_dict(cfg.target.path), cfg.drafter.init_from
    )


def _check_tracking_dir(path, edits):
    from dflash_ring.consumer.reporting.tracking import check_tracking_dir

    check_tracking_dir(_cfg(path, edits).tracking_dir())  # run_drafter


def _ring_spec(path, edits):
    from dflash_ring.common.ring_spec import ring_spec

    ring_spec(_cfg(path, edits))  # the supervisor's start: the ring it creates, with the run's fingerprint


def _load_config(path, edits):
    _cfg(path, edits)  # every role's first step (cli: _role_config)


def _check_before_building(path, edits):
    from argparse import Namespace

    from dflash_ring.cli import _check_before_building

    _check_before_building(Namespace(config=str(path), set=edits))  # chaos's and run's first step


def _check_output_directories(path, edits):
    from dflash_ring.cli import _check_output_directories

    _check_output_directories(_cfg(path, edits))  # every role's start (cli: _role_config)


@dataclass(frozen=True)
class Case:
    name: str
    edits: tuple[str, ...]
    says: str  # words the role's refusal and check-config's line share
    checks: tuple[tuple[str, Callable[[Path, list[str]], str | None]], ...]  # (the check's name, the role's call)
    target_config: dict | None = None  # keys changed in the target's config.json
    base_checked: bool = True  # the role's check accepts the base config (False: it does not run on it)


def _dflash2(setting: str) -> tuple[str, ...]:
    return ('drafter.recipe="dflash2"', setting)


CASES = [
    Case(
        "train-device-meta",
        ('train.device="meta"',),
        "device 'meta': a meta device cannot run a role",
        (
            ("pick_device", _pick_device),
            ("ChaosOptions.refusal", _chaos_refusal),
        ),
    ),
    Case(
        "train-device-cpu7",
        ('train.device="cpu:7"',),
        "device 'cpu:7': there is one CPU device",
        (("pick_device", _pick_device),),
    ),
    Case(
        "target-device-meta",
        ('target.device="meta"',),
        "device 'meta': a meta device cannot run a role",
        (("resolve_device", _resolve_device),),
    ),
    Case(
        "fp8-on-cpu",
        ('drafter.precision="fp8"', 'train.device="cpu"'),
        'drafter.precision = "fp8" cannot run here',
        (("check_precision", _check_precision), ("ChaosOptions.refusal", _chaos_refusal)),
    ),
    Case(
        "num-proc-past-cores",
        (f"data.num_proc={CORES + 1}",),
        f"data.num_proc = {CORES + 1}",
        (("check_num_proc", _check_num_proc),),
    ),
    Case(
        "tensor-parallel-3",
        ("target.tensor_parallel=3",),
        "does not divide the target's num_attention_heads",
        (("check_group", _check_group),),
    ),
    Case(
        "dflash2-selector-top-k",
        _dflash2("drafter.selector_top_k=411"),
        "drafter.selector_top_k 411 exceeds the target's vocabulary of 410",
        (("drafter_target_settings", _drafter_target_settings),),
    ),
    Case(
        "dflash2-conv-group-size",
        _dflash2("drafter.conv_group_size=65536"),
        "drafter.conv_group_size 65536 does not divide the target's hidden_size 64",
        (("drafter_target_settings", _drafter_target_settings),),
    ),
    Case(
        "mask-token-the-data-uses",
        ("target.mask_token_id=5",),
        "mask token 5 ('#') is a token the data or the chat template uses",
        (("check_mask_token", _check_mask_token),),
    ),
    Case(
        "slot-too-small",
        ("ring.slot_bytes=70000",),
        "a full batch of data.max_tokens_per_batch = 32768 tokens does not fit a slot",
        (("check_slot_fits", _check_slot_fits),),
    ),
    Case(
        "init-from-nowhere",
        ('drafter.init_from="{tmp}/nowhere"',),
        "nowhere/config.json does not exist: drafter.init_from names a drafter directory",
        (("check_release", _check_release),),
        base_checked=False,  # drafter.init_from unset: no warm start
    ),
    Case(
        "init-from-not-a-drafter",
        ('drafter.init_from="{target}"',),
        "not a drafter layout we read",
        (("check_release", _check_release),),
        base_checked=False,
    ),
    Case(
        "tracking-dir-a-file",
        ('tracking.dir="{tmp}/afile/x"',),
        "tracking.dir: output directory {tmp}/afile/x: {tmp}/afile is not a directory",
        (("check_tracking_dir", _check_tracking_dir),),
    ),
    Case(
        "target-vocab-zero",
        (),
        "vocab_size = 0 as its config class Qwen3Config reads it: must be a positive integer",
        (("target_geometry", _ring_spec),),  # the supervisor's ring_spec reads the geometry as every role does
        target_config={"vocab_size": 0},
    ),
    Case(
        "rendezvous-port-0",
        ('group.rendezvous="tcp://h:0"',),
        "the port must be 1..65535",
        (("load_config", _load_config), ("_check_before_building", _check_before_building)),
    ),
    Case(
        "checkpoint-dir-a-file",
        ('train.checkpoint_dir="{tmp}/afile"',),
        "train.checkpoint_dir: output directory",
        (("_check_output_directories", _check_output_directories),),
    ),
]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return build_target(tmp_path_factory.mktemp("target") / "model", "qwen3", layers=4)  # width 64, 410 tokens


def _refusal_of(call: Callable[[], str | None]) -> str:
    """The one line a role's check refuses with ("" when it accepts): raised, or returned (chaos's options)."""
    try:
        why = call()
    except (Refusal, RuntimeError) as e:  # what cli.main prints as one line, exit 2
        why = str(e)
    return " ".join((why or "").split())


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_role_refusal_is_check_configs(case, target, tmp_path, monkeypatch, capsys):
    """The role's own check refuses the edit (and accepts the config without it); check-config refuses the same
    config in one line, exit 2, with the same words."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    path = tmp_path / "run.toml"
    path.write_text(f'[target]\npath = "{target}"\nmask_token_id = 405\n')  # 405: an unused embedding row
    capsys.readouterr()
    assert main(["check-config", "--config", str(path)]) == 0, capsys.readouterr().err  # the base passes
    for name, call in case.checks:
        assert not case.base_checked or not (why := _refusal_of(lambda: call(path, []))), f"{name}: {why}"
    if case.target_config is not None:  # the edit is the target's config.json
        target = shutil.copytree(target, tmp_path / "model")
        config = json.loads((target / "config.json").read_text())
        (target / "config.json").write_text(json.dumps(config | case.target_config))
        path.write_text(f'[target]\npath = "{target}"\nmask_token_id = 405\n')
    edits = [e.format(tmp=tmp_path, target=target) for e in case.edits]
    says = case.says.format(tmp=tmp_path, target=target)
    for name, call in case.checks:
        why = _refusal_of(lambda: call(path, edits))
        assert says in why, f"{name}: the role's own check does not refuse {edits}: {why!r}"
    capsys.readouterr()
    code = main(["check-config", "--config", str(path), *[a for e in edits for a in ("--set", e)]])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith(PREFIX), (code, err)
    assert says in err, err


# ---- the walk -----------------------------------------------------------------------------------------------------

# What each role runs before its first piece of work (a producer's first publish, a drafter's first step, the
# supervisor's ring, chaos's first process), by file: "f" a function, "C.f" a method.
ROLE_STARTS = {
    "producer/process.py": ("run_producer", "build", "load_data", "choose_layout"),
    "consumer/training/process.py": ("run_drafter", "build", "resolve_drafter_config"),
    "consumer/training/warm_start.py": ("warm_start",),
    "supervisor/supervisor.py": ("Supervisor.start",),
    "common/ring_spec.py": ("ring_spec", "run_fingerprint_fields"),
    "tools/chaos.py": ("ChaosOptions.refusal", "ChaosOptions._bounds"),
    "cli.py": ("_role_config", "cmd_target", "cmd_drafter", "cmd_supervisor", "cmd_chaos"),
}
# Called names that check besides check_* and *_refusal.
CHECK_NAMES = {"pick_device", "resolve_device", "checked_device", "drafter_target_settings", "target_geometry"}
# The checks a role runs at its start that check-config runs too: the same function, by the same name.
RUN_BY_CHECK_CONFIG = {
    "pick_device",
    "resolve_device",
    "check_precision",
    "check_num_proc",
    "check_group",
    "drafter_target_settings",
    "target_geometry",
    "check_mask_token",
    "check_slot_fits",
    "check_release",
    "_check_output_directories",
}
# A role's check that check-config runs as the function it is made of, by name: (that function, where the check is).
RUN_AS = {
    # check_output_dir and a mkdir: check-config runs it on tracking.dir (_check_output_directories), making nothing
    "check_tracking_dir": ("check_output_dir", "consumer/reporting/tracking.py"),
    # chaos's load_config of the user's config before it builds one (check_overrides without one)
    "_check_before_building": ("load_config", "cli.py"),
}
# What a role checks at its start that is not the config: the host's or the run's state at that moment, a command's
# own argument, or data only a producer's tokenization produces.
NOT_CONFIG = {
    "check_port_free": "a metrics port another process holds now: the host's state when the drafter starts",
    "check_data_token_ids": "the tokenized data's ids: known once the producer has tokenized it (data-stats' work)",
}


def _functions(path: Path) -> dict[str, ast.FunctionDef]:
    """The file's functions by name, methods as "Class.method"."""
    tree = ast.parse(path.read_text())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            found[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    found[f"{node.name}.{item.name}"] = item
    return found


def _called(node: ast.AST) -> set[str]:
    names = set()
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            if isinstance(call.func, ast.Name):
                names.add(call.func.id)
            elif isinstance(call.func, ast.Attribute):
                names.add(call.func.attr)
    return names


def _is_check(name: str) -> bool:
    return name.startswith(("check_", "_check_")) or name.endswith("_refusal") or name in CHECK_NAMES


def _imported_from(path: Path, node: ast.AST, name: str) -> str:
    """The module `name` comes from where `node` (a function of `path`) calls it: an import in the function or at
    the file's top, else the file's own module."""
    tree = ast.parse(path.read_text())
    for scope in (node, tree):
        for imp in ast.walk(scope):
            if isinstance(imp, ast.ImportFrom) and any(a.name == name and a.asname is None for a in imp.names):
                if imp.level:  # relative: from .target import ...
                    package = "dflash_ring." + ".".join(path.relative_to(ROOT).parent.parts)
                    return importlib.util.resolve_name("." * imp.level + (imp.module or ""), package)
                return imp.module
    return "dflash_ring." + ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _role_calls() -> dict[str, list[tuple[str, str]]]:
    """Each check name the roles call at their start: [(file, function), ...]."""
    found: dict[str, list[tuple[str, str]]] = {}
    for file, starts in ROLE_STARTS.items():
        functions = _functions(ROOT / file)
        for start in starts:
            assert start in functions, f"{file} has no {start}: ROLE_STARTS names what a role runs at its start"
            for name in _called(functions[start]):
                if _is_check(name):
                    found.setdefault(name, []).append((file, start))
    return found


def _check_config_calls() -> dict[str, ast.FunctionDef]:
    """What cmd_check_config calls, through cli.py's own functions it calls: {name: the cli function calling it}."""
    functions = _functions(ROOT / "cli.py")
    seen, todo, calls = set(), ["cmd_check_config"], {}
    while todo:
        name = todo.pop()
        seen.add(name)
        for called in _called(functions[name]):
            calls.setdefault(called, functions[name])
            if called in functions and called not in seen:
                todo.append(called)
    return calls


def test_every_check_a_role_runs_at_its_start_is_run_by_check_config():
    """The walk: every check the roles call at their start (ROLE_STARTS) is run by check-config, or is no check of the
    config (NOT_CONFIG); each shared one is still called on both sides, and has its case in the table."""
    role, check_config = _role_calls(), _check_config_calls()
    missed = {
        name: where
        for name, where in role.items()
        if name not in RUN_BY_CHECK_CONFIG and name not in RUN_AS and name not in NOT_CONFIG
    }
    assert not missed, f"checks a role runs at its start that check-config does not run: {missed}"
    assert not (stale := set(NOT_CONFIG) - set(role)), f"NOT_CONFIG names what no role calls at its start: {stale}"
    for name in RUN_BY_CHECK_CONFIG:
        assert name in role, f"{name}: no role calls it at its start any more (ROLE_STARTS)"
        assert name in check_config, f"{name}: a role runs it at its start, check-config does not"
    for name, (as_, file) in RUN_AS.items():
        assert name in role and as_ in check_config, name
        assert as_ in _called(_functions(ROOT / file)[name]), f"{name} no longer runs {as_}"
    # and each has its case in the table
    cased = {name for case in CASES for name, _ in case.checks}
    assert not (uncased := (RUN_BY_CHECK_CONFIG | set(RUN_AS)) - cased), uncased


def test_check_config_runs_the_roles_own_function_not_a_copy():
    """Each shared check imported by check-config from the module the role imports it from (or defines it in):
    the same function object."""
    role, check_config = _role_calls(), _check_config_calls()
    for name in sorted(RUN_BY_CHECK_CONFIG):
        assert name in check_config and name in role, f"{name}: not called by check-config, or by no role's start"
        ours = _imported_from(ROOT / "cli.py", check_config[name], name)
        for file, start in role[name]:
            theirs = _imported_from(ROOT / file, _functions(ROOT / file)[start], name)
            got, want = getattr(importlib.import_module(ours), name), getattr(importlib.import_module(theirs), name)
            assert got is want, f"{name}: check-config runs {ours}.{name}, {file} {start} runs {theirs}.{name}"
