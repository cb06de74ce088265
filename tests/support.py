"""What the tests share, in one place: runs of real processes, run configs, tiny targets and data.

conftest.py holds only fixtures and hooks; the helpers live here so a test module imports them by
name (`from support import ...`) instead of reaching into conftest or another test module.

- Runs: `Run` (one test's run: config, ledgers, processes), `wait_exit`, `wait_for`, `free_port_base`.
- Run configs: `run_config` builds a `Config` through `load_config` from `section.key=value` overrides;
  `write_config` writes it with the one writer (`dump_toml`) and checks that the file reads back equal;
  `pipeline_settings` is the pipeline tests' recipe (a tiny target and a one-layer drafter on the CPU).
- Targets: `build_target` (any family, with the tiny tokenizer), `save_tiny_qwen3` / `tiny_qwen3_config`
  (the small Qwen3 the drafter tests use), reference features and `assert_same_features`.
- Eval: the eval tests' shared module fixtures (`one_thread`, `target_dir`, `target`, `data`, `micro_target`),
  the one place fixtures live outside conftest.py, and `plain_greedy`, `exact_joint`, `pearson`, `chi2_bound`.
- Data: `write_chat_rows`, `cyclic_rows` (learnable replies), `packed_batch`, `anchors_from_local`,
  `synthetic` / `mixture` (tokenized sources whose tokens say where they came from);
  `curves` reads a drafter's loss and accuracy from its log.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import re
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from dflash_ring.bench.target_shapes import FAMILIES, model_class, tiny_config
from dflash_ring.common.config.dump import dump_toml
from dflash_ring.common.config.load import load_config
from dflash_ring.common.config.schema import Config
from dflash_ring.consumer.modeling.model import Anchors, FrozenTargetHead, cu_seqlens_from_lengths
from dflash_ring.embedded.tiny_tokenizer import tiny_chat_tokenizer
from dflash_ring.producer.batching import Batch, Cursor
from dflash_ring.producer.conformance import relative_error
from dflash_ring.producer.pretokenized import SourceData, TokenizedData

WORKER = Path(__file__).with_name("ring_worker.py")


# --- runs of real processes ------------------------------------------------------------------------


class Run:
    """One test's run: its config file, ledgers, and every process it started."""

    def __init__(self, tmp: Path, name: str):
        self.tmp = tmp
        self.name = name
        self.lock_dir = tmp / "locks"
        self.config = tmp / "run.toml"
        self.procs: list[subprocess.Popen] = []
        self.metrics_base = free_port_base()

    def settings(self, producers: int, consumers: int, slots: int = 4, slot_bytes: int = 1 << 20) -> dict:
        """The run's own settings: its name and lock dir, a small ring, quick timeouts, free metrics ports."""
        return {
            "run": {"name": self.name, "run_dir": str(self.lock_dir), "attach_timeout_s": 30},
            "ring": {"slots": slots, "slot_bytes": slot_bytes, "slot_header_bytes": 4096, "wait_s": 0.1},
            "topology": {"producers": producers, "consumers": consumers},
            "supervisor": {"reap_interval_s": 0.1, "exit_timeout_s": 30},
            # Every process serves /metrics: a free base per run, so runs side by side never collide.
            "metrics": {"port_base": self.metrics_base},
            # Where the default (relative to the processes' directory, this run's) puts them, written out: it is in
            # the ring's fingerprint as an absolute path, and a test attaches from another directory.
            "train": {"checkpoint_dir": str(self.tmp / "runs" / "default" / "checkpoints")},
        }

    def write_config(
        self, producers: int, consumers: int, slots: int = 4, slot_bytes: int = 1 << 20, **sections: Mapping[str, Any]
    ) -> Config:
        """Write run.toml: the run's settings with `sections` ({"train": {"lr": 1e-3}, ...}) over them."""
        return write_config(self.config, merged(self.settings(producers, consumers, slots, slot_bytes), sections))

    def ledger(self, role: str, index: int) -> Path:
        return self.tmp / f"{role}-{index}.ledger"

    def spawn(self, *args: str, stdout=None) -> subprocess.Popen:
        """A process whose stderr goes to a file, read back through `proc.stderr`: a pipe read only at exit
        blocks a process that logs more than the pipe holds (64 KiB), and the test then sees a hang."""
        path = self.tmp / f"proc-{len(self.procs)}.stderr"
        with open(path, "w") as sink:
            proc = subprocess.Popen([sys.executable, *args], cwd=self.tmp, stdout=stdout, stderr=sink, text=True)
        proc.stderr = open(path)  # noqa: SIM115 (read by the test, closed with the process list)
        self.procs.append(proc)
        return proc

    def role(self, role: str, index: int, *extra: str) -> subprocess.Popen:
        """`dflash-ring target|drafter --config run.toml --index i`."""
        return self.spawn("-m", "dflash_ring", role, "--config", str(self.config), "--index", str(index), *extra)

    def supervisor(self, *extra: str) -> subprocess.Popen:
        return self.spawn("-m", "dflash_ring", "supervisor", "--config", str(self.config), *extra)

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run(
            [sys.executable, "-m", "dflash_ring", *args], cwd=self.tmp, capture_output=True, text=True, timeout=120
        )
        if check and out.returncode != 0:
            raise AssertionError(f"dflash-ring {' '.join(args)} exited {out.returncode}: {out.stderr}")
        return out

    def worker(self, role: str, index: int, *extra: str) -> subprocess.Popen:
        return self.spawn(
            str(WORKER),
            role,
            "--config",
            str(self.config),
            "--index",
            str(index),
            "--ledger",
            str(self.ledger(role, index)),
            *extra,
        )

    def wait_joined(self, role: str, indices: range | list[int], timeout: float = 120.0) -> None:
        """Until each of these processes holds its lock (joined the run): a process still importing on a loaded
        box must not find the work, or the run, already over."""
        wait_for(
            lambda: all((self.lock_dir / f"{role}-{i}.lock").exists() for i in indices),
            timeout=timeout,
            what=f"{role}(s) {list(indices)} to join",
        )

    def ledger_lines(self, kind: str) -> list[list[str]]:
        lines = []
        for p in sorted(self.tmp.glob("*.ledger")):
            lines += [ln.split() for ln in p.read_text().splitlines() if ln.startswith(kind + " ")]
        return lines

    def leftovers(self) -> list[str]:
        found = [n for n in os.listdir("/dev/shm") if n.startswith(f"dflash-ring.{self.name}")]
        found += [str(p) for p in self.lock_dir.glob("*")] if self.lock_dir.exists() else []
        return found


def free_port_base(span: int = 8) -> int:
    """A metrics port base whose first ports (supervisor, targets) and drafter ports are all free."""
    for _ in range(200):
        base = random.randrange(10000, 32000)  # below Linux's ephemeral range (32768-60999)
        try:
            for port in [*range(base, base + span), *range(base + 100, base + 100 + span)]:
                with socket.create_server(("127.0.0.1", port)):
                    pass
        except OSError:
            continue
        return base
    raise RuntimeError("no free metrics port base found on 127.0.0.1")


def wait_exit(proc: subprocess.Popen, timeout: float = 60.0) -> int:
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"process {proc.args} did not exit within {timeout}s")
    return rc


def wait_for(cond, timeout: float = 120.0, what: str = "condition"):
    """Until `cond()` is true (its value returned). The timeout is a hang guard, not a speed bound: many waits span
    a process's start-up (torch's imports), which on a loaded 2-core box beside another xdist worker takes a minute."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


# --- run configs -----------------------------------------------------------------------------------


def merged(base: Mapping[str, Mapping[str, Any]], *changes: Mapping[str, Mapping[str, Any]]) -> dict:
    """Sections of settings, later keys over earlier ones, section by section."""
    out = {section: dict(keys) for section, keys in base.items()}
    for change in changes:
        for section, keys in change.items():
            out.setdefault(section, {}).update(keys)
    return out


def override(section: str, key: str, value: Any) -> str:
    """`section.key=value` as `--set` takes it (the value in TOML: strings quoted, lists bracketed, tables inline)."""
    return f"{section}.{key}={toml_value(value)}"


def toml_value(value: Any) -> str:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, Mapping):  # [[data.sources]] entries, as inline tables
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML string too
    return "true" if value is True else "false" if value is False else repr(value)


def run_config(sections: Mapping[str, Mapping[str, Any]]) -> Config:
    """The `Config` these settings make, read as `--set section.key=value` overrides over the defaults."""
    return load_config(None, [override(s, k, v) for s, keys in sections.items() for k, v in keys.items()])


def write_config(path: Path, sections: Mapping[str, Mapping[str, Any]]) -> Config:
    """The settings' `Config`, written by the one writer (`dump_toml`); the file reads back equal."""
    cfg = run_config(sections)
    path.write_text(dump_toml(cfg))
    assert load_config(path) == cfg, f"{path} does not read back as the config it was written from"
    return cfg


def pipeline_settings(tmp: Path, target: Path, data: Path) -> dict:
    """The pipeline tests' common ground: a tiny target on the CPU feeding one-layer drafters of block 4,
    every step logged, with big slot headers (a batch of many rows carries many cursors)."""
    return {
        "ring": {"slot_header_bytes": 65536},
        "data": {"path": str(data), "max_length": 128, "max_tokens_per_batch": 512, "cache_dir": str(tmp / "cache")},
        "target": {
            "path": str(target),
            "mask_token_id": len(load_tokenizer(target)),
            "state_dir": str(tmp / "state"),
            "device": "cpu",
        },
        "drafter": {"num_hidden_layers": 1, "block_size": 4, "loss_gamma": 2.0, "num_anchors": 16},
        "train": {"device": "cpu", "checkpoint_dir": str(tmp / "ckpt"), "log_every_steps": 1},
    }


# A schedule fast enough for the tiny drafter to learn `cyclic_rows` within a test.
LEARNS = {"train": {"lr": 3e-3, "warmup_ratio": 0.1}}
# tests/test_pipeline.py's run, also under Prometheus and across hosts: twelve epochs of cyclic rows,
# replicas averaging every 2 steps and checkpointing every 5.
PIPELINE_RUN = merged(
    LEARNS, {"data": {"epochs": 12}, "train": {"average_every_steps": 2, "checkpoint_every_steps": 5}}
)


def pipeline_config(
    run: Run,
    target: Path,
    data: Path,
    *layers: Mapping[str, Mapping[str, Any]],
    consumers: int = 2,
    slots: int = 8,
    slot_bytes: int = 4 << 20,
) -> Config:
    """run.toml for a supervisor, one target and `consumers` drafters: `pipeline_settings`, then `layers` over it."""
    return run.write_config(
        1, consumers, slots, slot_bytes, **merged(pipeline_settings(run.tmp, target, data), *layers)
    )


STEP = re.compile(r"step (\d+)/\d+ loss ([\d.]+) acc@1 ([\d.]+)")


def curves(stderr: str) -> tuple[list[float], list[float]]:
    """A drafter's logged loss and top-1 accuracy, step by step."""
    steps = list(STEP.finditer(stderr))
    return [float(m.group(2)) for m in steps], [float(m.group(3)) for m in steps]


# --- targets ---------------------------------------------------------------------------------------


# Mamba2 mixers (Mamba1 in jamba and zamba) among attention layers: tests/test_target_families.py checks their leak.
HYBRID_MAMBA = ("nemotron_h", "falcon_h1", "bamba", "granitemoehybrid", "zamba2", "jamba", "zamba")
# Linear-attention mixers beyond Qwen3.5's (Gated DeltaNet in olmo_hybrid, Kimi Delta Attention in kimi_linear and
# bailing_hybrid), each among full-attention layers and starting the tiny stack.
LINEAR_RECURRENT = ("olmo_hybrid", "kimi_linear", "bailing_hybrid")
ARCHS = tuple(FAMILIES)
WORDS = (
    "the quick brown fox jumps over the lazy dog drafter target hidden state ring shared memory "
    "capital France Paris explain speculative decoding numbers hello world thanks sure okay"
).split()


# Packed (or padded) against per-sequence features in float32: the largest relative RMS error of a
# sequence allowed (the probe's measure). A CPU GEMM rounds a row differently depending on how many
# rows share the call (measured on the tiny targets: up to ~2e-7 here; ~1e-7 to 1e-5 on other
# processors and BLAS builds), while a leak across sequences, a dropped attention sink or a missed
# window gives 1e-2 and more.
FEATURE_TOLERANCE = 1e-4


def assert_same_features(got: list[torch.Tensor], want: list[torch.Tensor], tolerance: float = FEATURE_TOLERANCE):
    errors = [relative_error(g, w) for g, w in zip(got, want, strict=True)]
    bad = [i for i, e in enumerate(errors) if not e <= tolerance]
    assert not bad, f"sequences {bad} differ from their own forward: errors {[f'{errors[i]:.1e}' for i in bad]}"


def build_target(
    path: Path,
    arch: str,
    layers: int = 6,
    hidden: int = 64,
    seed: int = 0,
    init: Callable[[torch.nn.Module], None] | None = None,
    **extra,
) -> Path:
    """A random-weight target with the tiny tokenizer beside it, as `save_pretrained` writes a real one;
    `init` may change the weights before saving (e.g. make a mechanism's effect large)."""
    tokenizer = tiny_chat_tokenizer(path)
    config = tiny_config(
        arch,
        vocab_size=len(tokenizer) + 8,  # spare rows, like Qwen3's: the first one can be the mask token
        hidden_size=hidden,
        num_hidden_layers=layers,
        pad_token_id=tokenizer.pad_token_id,
        **extra,
    )
    torch.manual_seed(seed)
    model = model_class(arch)(config)
    if init is not None:
        with torch.no_grad():
            init(model)
    model.save_pretrained(path)
    return path


def write_chat_rows(path: Path, rows: int, seed: int = 0) -> Path:
    """Chat rows of varied length (a few dozen to ~150 tokens), some multi-turn, one per line."""
    rng = random.Random(seed)

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    out = []
    for i in range(rows):
        messages = [{"role": "user", "content": text(3, 30)}, {"role": "assistant", "content": text(3, 60)}]
        if i % 4 == 0:
            messages += [{"role": "user", "content": text(2, 10)}, {"role": "assistant", "content": text(2, 20)}]
        out.append({"messages": messages})
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    return path


def reference_features(model_dir: Path, sequences: list[torch.Tensor], layer_ids: list[int]) -> list[torch.Tensor]:
    """Each sequence alone through a plain HF forward with output_hidden_states: concat of hidden_states[l + 1].
    No cache: a Mamba-only stack's cannot even count its tokens, and features need none."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for ids in sequences:
            hs = model(ids.long()[None], output_hidden_states=True, use_cache=False).hidden_states
            out.append(torch.cat([hs[i + 1][0] for i in layer_ids], dim=-1))
    return out


def reference_final_hidden(model_dir: Path, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model.model(ids.long()[None]).last_hidden_state[0] for ids in sequences]


def load_tokenizer(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir)


def tiny_qwen3_config(**overrides) -> Qwen3Config:
    """The drafter tests' small Qwen3: 4 layers of width 64, 4 heads (2 for K/V) of 16, MLP 128, 256 tokens."""
    base = dict(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=256,
        max_position_embeddings=512,
    )
    return Qwen3Config(**{**base, **overrides})


def save_tiny_qwen3(
    path: Path, seed: int = 0, init: Callable[[torch.nn.Module], None] | None = None, sharded: bool = False, **overrides
) -> Qwen3ForCausalLM:
    """A random `tiny_qwen3_config` target (seeded) saved as an HF model directory (no tokenizer);
    `init` may change the weights before saving, `sharded` saves it in many small shards."""
    config = tiny_qwen3_config(**overrides)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    if init is not None:
        with torch.no_grad():
            init(model)
    model.save_pretrained(path, **({"max_shard_size": "40KB"} if sharded else {}))
    return model


def save_eval_target(path: Path, vocab_size: int) -> Path:
    """The eval tests' target: a tiny random Qwen3 with the tiny chat tokenizer and a sharper lm_head than the default
    init, so greedy argmaxes are not near-ties (a decode compared token by token would otherwise flip on rounding)."""
    tokenizer = tiny_chat_tokenizer(path)
    save_tiny_qwen3(
        path,
        init=lambda target: target.lm_head.weight.mul_(20),
        vocab_size=vocab_size,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
    )
    return path


# --- the eval tests --------------------------------------------------------------------------------
# The module fixtures that test_dspark_eval, test_dflash2_eval and test_eval_baselines share, imported by name (in
# conftest.py they would be every module's), and the statistics of their lossless-sampling checks.

EVAL_VOCAB = 448  # the eval target's vocabulary
MICRO_VOCAB = 3  # micro_target's


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Decoding is many small forwards: one thread, as the eval runs them (more only contend on a shared host)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_eval_target(tmp_path_factory.mktemp("target"), EVAL_VOCAB)


@pytest.fixture(scope="module")
def target(target_dir):
    return Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Held-out rows in both layouts: a chat with its reply, and a prompt with its response."""
    path = tmp_path_factory.mktemp("data") / "heldout.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "Count from 3 to 7."}, {"role": "assistant", "content": "3 4"}]},
        {"prompt": "Repeat: red cat.", "response": "red cat"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def micro_target():
    """A target of three tokens: the first four generated tokens have 81 outcomes, each likely enough to count."""
    config = tiny_qwen3_config(
        vocab_size=MICRO_VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4)
    return model


def head_of(target: Qwen3ForCausalLM) -> FrozenTargetHead:
    return FrozenTargetHead(target.get_input_embeddings().weight, target.get_output_embeddings().weight)


@torch.no_grad()
def plain_greedy(target, prompt: list[int], n: int) -> list[int]:
    """Reference decoding: the whole sequence re-run for every token, no cache, no drafts."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(target(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@torch.no_grad()
def exact_joint(target, prompt, n):
    """The target's exact probability of every n-token continuation of prompt (temperature 1)."""
    prefixes = list(itertools.product(range(target.config.vocab_size), repeat=n - 1))
    log_p = torch.log_softmax(target(input_ids=torch.tensor([prompt + list(t) for t in prefixes])).logits.double(), -1)
    log_p = log_p[:, len(prompt) - 1 :]
    return {
        (*t, last): float(sum(log_p[i, k, (*t, last)[k]] for k in range(n)).exp())
        for i, t in enumerate(prefixes)
        for last in range(target.config.vocab_size)
    }


def chi2_bound(df: int, z: float = 3.09) -> float:
    """The chi-square distribution's upper quantile at the normal z (3.09: p = 0.001), by Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def pearson(counts: Counter, exact: dict, n: int) -> tuple[float, int]:
    """Pearson's chi-square of counts over n draws against exact probabilities, cells expecting < 5 pooled."""
    big = [k for k, p in exact.items() if n * p >= 5]
    rest = [k for k in exact if n * exact[k] < 5]
    observed = [counts[k] for k in big] + [sum(counts[k] for k in rest)]
    expected = [n * exact[k] for k in big] + [n * sum(exact[k] for k in rest)]
    observed, expected = (observed, expected) if rest else (observed[:-1], expected[:-1])
    assert sum(observed) == n
    return sum((o - e) ** 2 / e for o, e in zip(observed, expected)), len(observed) - 1


# --- data ------------------------------------------------------------------------------------------


def cyclic_rows(path: Path, rows: int, seed: int = 0) -> Path:
    """Replies that walk a fixed word cycle: each token determines the next, so a drafter can learn them."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            start = rng.randrange(len(WORDS))
            reply = " ".join(WORDS[(start + i) % len(WORDS)] for i in range(24))
            f.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": f"continue from {WORDS[start]}"},
                            {"role": "assistant", "content": reply},
                        ]
                    }
                )
                + "\n"
            )
    return path


def synthetic(source: int, lengths, name: str = "") -> TokenizedData:
    """Token values encode (source, sample, position), so a gather from the wrong source or row shows."""
    lengths = np.asarray(lengths, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    sample_of = np.repeat(np.arange(len(lengths)), lengths)
    tokens = (source * 10_000_000 + sample_of * 1000 + np.arange(offsets[-1]) - offsets[sample_of]).astype(np.int32)
    return TokenizedData(
        tokens=tokens,
        loss_mask=((tokens + source) % 2).astype(np.uint8),
        offsets=offsets,
        row_ids=np.arange(len(lengths), dtype=np.int64) * 2,  # skipped rows leave gaps
        num_rows=2 * len(lengths),
        bad_rows=(),
        directory=Path(f"/c/tokenized-{name or source}"),
        from_cache=False,
    )


def mixture(*specs: tuple[str, int, float, bool]) -> list[SourceData]:
    """(name, rows, weight, repeat) per source; lengths 1..60, different per source."""
    out = []
    for k, (name, rows, weight, repeat) in enumerate(specs):
        lengths = np.random.default_rng(k).integers(1, 60, rows)
        out.append(SourceData(name, f"/d/{name}.jsonl", weight, repeat, synthetic(k, lengths, name)))
    return out


def packed_batch(lengths: Iterable[int], seed: int = 0, vocab: int = 400) -> Batch:
    """Random token ids for sequences of these lengths, packed into one batch as the producer builds it."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, dtype=np.int32)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return Batch(
        input_ids=rng.integers(0, vocab, cu[-1]).astype(np.int32),
        loss_mask=np.ones(cu[-1], np.uint8),
        lengths=lengths,
        cu_seqlens=cu,
        sample_ids=np.arange(len(lengths), dtype=np.int64),
        source_ids=np.zeros(len(lengths), dtype=np.int32),
        epoch=0,
        position=0,
        cursor=Cursor(0, 1),
        padding_fraction=0.0,
    )


def anchors_from_local(lengths: list[int], local: list[list[int]]) -> Anchors:
    """Anchors given as positions within each sequence of a packed batch of these lengths."""
    cu = cu_seqlens_from_lengths(lengths)
    positions = torch.tensor([cu[i].item() + a for i, seq in enumerate(local) for a in seq], dtype=torch.long)
    counts = torch.tensor([len(seq) for seq in local])
    return Anchors(positions=positions, cu_anchors=cu_seqlens_from_lengths(counts), cu_seqlens=cu)


# --- trackers, read back with their own readers ------------------------------------------------------


def tensorboard_scalars(logdir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of one tag, as TensorBoard's own EventAccumulator reads the run (restarts' purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def tensorboard_text(logdir: Path, tag: str) -> str:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    acc.Reload()
    return acc.Tensors(f"{tag}/text_summary")[0].tensor_proto.string_val[0].decode()  # add_text's tag


def foreign_tokenizer(path: Path) -> tuple[Path, list[str]]:
    """A chat tokenizer of ~600 ids (a tiny target has ~410 rows) trained on made-up words, and those words: a
    tokenizer that is not the target's, whose ids for them lie past the target's embedding."""
    rng = random.Random(7)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(6)) for _ in range(3000)]
    tiny_chat_tokenizer(path, vocab_size=3000, corpus=[" ".join(words[i : i + 50]) for i in range(0, 3000, 50)])
    return path, words[-100:]
