"""`dflash-ring data stats` and the producer's composition log (issue 15 item 3), against hand-counted fixtures.

Replies are digit strings: the tiny tokenizer (Qwen's split) makes every digit one token, so a reply of n
digits trains n + 2 tokens (the digits, <|im_end|> and the newline the template closes a turn with).
Whole-row token counts come from the tokenizer and the template directly, not from the code under test.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from prometheus_client.parser import text_string_to_metric_families

from dflash_ring.common.config.load import load_config
from dflash_ring.common.config.data import DataError
from dflash_ring.common.layout import Counter, Role
from dflash_ring.common.lifecycle.membership import Membership
from dflash_ring.common.ring import Ring
from dflash_ring.common.ring_spec import ring_spec
from dflash_ring.embedded.tiny_tokenizer import tiny_chat_tokenizer
from dflash_ring.producer.data_stats import HISTOGRAM_EDGES, bucket_labels, data_stats, histogram, log_lines
from dflash_ring.producer.batching import ShardBatcher
from dflash_ring.producer.pretokenized import load_sources
from support import build_target, load_tokenizer, wait_exit, wait_for, write_chat_rows, write_config

CODE = [
    {"prompt": "write it", "response": "1" * 5},
    {"prompt": "again", "response": "2" * 20},
    {"prompt": "more", "response": "3" * 40},
    {"prompt": "no reply"},
]  # the last is bad: skipped
CHAT = [
    {"prompt": "hi", "response": "4" * 100},
    {"prompt": "long", "response": "5" * 300},
    {
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "6" * 10},
            {"role": "user", "content": "b"},
            {"role": "assistant", "content": "7" * 4},
        ]
    },
]
# Trained tokens per usable row, by hand: digits + 2 per reply.
CODE_TRAINED = [7, 22, 42]
CHAT_TRAINED = [102, 302, 12 + 6]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("stats")
    tiny_chat_tokenizer(root / "tok")
    for name, rows in (("code", CODE), ("chat", CHAT)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_config(
        root / "mix.toml",
        {
            "data": {
                "cache_dir": root / "cache",
                "max_length": 4096,
                "sources": [{"path": root / "code.jsonl", "weight": 3}, {"path": root / "chat.jsonl", "name": "talk"}],
            },
            "target": {"tokenizer": root / "tok"},
        },
    )
    return root


def row_tokens(tokenizer, row: dict) -> int:
    messages = row.get("messages") or [
        {"role": "user", "content": row["prompt"]},
        {"role": "assistant", "content": row["response"]},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, enable_thinking=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def bucket(n: int) -> int:
    return next((i for i, edge in enumerate(HISTOGRAM_EDGES) if n <= edge), len(HISTOGRAM_EDGES))


def expected(world: Path) -> dict:
    """The report by hand: code (3 usable rows) limits the epoch at weight 3 of 4, so an epoch is 4 rows,
    3 of code and 1 of talk (expected trained tokens: the mean of talk's rows)."""
    tok = tiny_chat_tokenizer(world / "tok-check")
    code_tokens, chat_tokens = sum(row_tokens(tok, r) for r in CODE[:3]), sum(row_tokens(tok, r) for r in CHAT)
    epoch_trained = [sum(CODE_TRAINED), round(sum(CHAT_TRAINED) / 3)]
    hist = [[0] * (len(HISTOGRAM_EDGES) + 1) for _ in range(2)]
    for k, trained in enumerate((CODE_TRAINED, CHAT_TRAINED)):
        for n in trained:
            hist[k][bucket(n)] += 1
    return {
        "code": dict(
            rows=4,
            bad_rows=1,
            tokens=code_tokens,
            trained_tokens=sum(CODE_TRAINED),
            histogram=hist[0],
            epoch_rows=3,
            epoch_trained_tokens=epoch_trained[0],
            epoch_row_share=0.75,
            epoch_trained_share=epoch_trained[0] / sum(epoch_trained),
            weight=3.0,
            repeat=False,
        ),
        "talk": dict(
            rows=3,
            bad_rows=0,
            tokens=chat_tokens,
            trained_tokens=sum(CHAT_TRAINED),
            histogram=hist[1],
            epoch_rows=1,
            epoch_trained_tokens=epoch_trained[1],
            epoch_row_share=0.25,
            epoch_trained_share=epoch_trained[1] / sum(epoch_trained),
            weight=1.0,
            repeat=False,
        ),
    }


def check(report: dict, want: dict) -> None:
    for s in report["sources"]:
        shares = ("epoch_row_share", "epoch_trained_share")
        assert {k: s[k] for k in want[s["name"]] if k not in shares} == {
            k: v for k, v in want[s["name"]].items() if k not in shares
        }, s["name"]
        assert [s[k] for k in shares] == pytest.approx([want[s["name"]][k] for k in shares]), s["name"]
    total = report["total"]
    for k in ("rows", "bad_rows", "tokens", "trained_tokens", "epoch_rows", "epoch_trained_tokens"):
        assert total[k] == sum(w[k] for w in want.values()), k
    assert total["histogram"] == [a + b for a, b in zip(*(w["histogram"] for w in want.values()))]


def test_stats_match_the_hand_counts(world):
    cfg = load_config(world / "mix.toml")
    stats = data_stats(load_sources(cfg.data, tiny_chat_tokenizer(world / "tok")))
    report = json.loads(stats.to_json())
    assert [s["name"] for s in report["sources"]] == ["code", "talk"]
    assert report["histogram_edges"] == list(HISTOGRAM_EDGES)
    check(report, expected(world))
    lines = log_lines(stats)
    assert len(lines) == 2 and lines[0].startswith(f"data source code ({world / 'code.jsonl'}): 4 rows, 1 bad skipped")
    assert "3 rows per epoch (75.0% of rows" in lines[0] and "weight 1: 1 rows per epoch (25.0% of rows" in lines[1]


def test_buckets_are_fixed_and_cover_every_length():
    labels = bucket_labels()
    assert labels[0] == "1-16" and labels[1] == "17-32" and labels[-1] == ">4096"
    assert len(labels) == len(HISTOGRAM_EDGES) + 1
    # An edge belongs to the bucket below it: 16 trained tokens is "1-16", 17 is "17-32".
    assert histogram(np.array([1, 16, 17, 4096, 4097, 10**6])) == (2, 1, 0, 0, 0, 0, 0, 0, 1, 2)


def test_a_source_without_a_usable_row_is_an_error(world, tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n{"messages": []}\n')
    cfg = load_config(
        world / "mix.toml", [f'data.sources=[{{path="{world / "code.jsonl"}"}}, {{path="{tmp_path / "bad.jsonl"}"}}]']
    )
    with pytest.raises(DataError, match="no usable row in .*bad.jsonl"):
        load_sources(cfg.data, tiny_chat_tokenizer(world / "tok"))


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_row_far_over_max_length_is_skipped_unread_and_the_rest_keep_their_rows(world, tmp_path, fmt):
    """One row of ~600 KB among small ones, with max_length 128 (a bound of 256 x 128 bytes): it is skipped with
    its size as the reason, before it is parsed or tokenized (a 50 MB line took `data stats` past 13 GB), and the
    rows after it keep their row ids."""
    import datasets

    rows = [CHAT[0], {"prompt": "huge", "response": "word " * 120_000}, CHAT[2], CODE[1]]
    if fmt == "jsonl":
        data = tmp_path / "big.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        data = tmp_path / "big.parquet"
        datasets.Dataset.from_list(
            [{"prompt": r.get("prompt", "p"), "response": r.get("response", "r")} for r in rows]
        ).to_parquet(str(data))
    cfg = load_config(
        None,
        [
            f'data.path="{data}"',
            f'data.cache_dir="{tmp_path / "cache"}"',
            "data.max_length=128",
            "data.max_tokens_per_batch=256",
        ],
    )
    [source] = load_sources(cfg.data, tiny_chat_tokenizer(world / "tok"))
    assert source.data.num_rows == 4 and source.data.row_ids.tolist() == [0, 2, 3]
    [(index, why)] = source.data.bad_rows
    assert index == 1 and "over the 32768-byte bound" in why, why


@pytest.mark.processes
def test_the_cli_prints_json_and_a_table(world):
    def cli(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "dflash_ring", "data", "stats", "--config", str(world / "mix.toml"), *extra],
            capture_output=True,
            text=True,
            timeout=300,
        )

    out = cli("--json")
    assert out.returncode == 0, out.stderr
    check(json.loads(out.stdout), expected(world))
    table = cli("--set", "data.max_length=4096")
    assert table.returncode == 0, table.stderr
    for word in ("code", "talk", "total", "% trained", "1-16", ">4096", "75.0", "25.0"):
        assert word in table.stdout, word


def scrape(port: int, name: str) -> dict[str, float]:
    """One labelled counter of a process's /metrics page, by its `source` label."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        families = text_string_to_metric_families(r.read().decode())
    return {
        s.labels["source"]: s.value
        for f in families
        if f.name == name.removesuffix("_total")
        for s in f.samples
        if s.name == name
    }


@pytest.mark.processes
def serves(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def test_producers_of_a_mixture_log_its_composition_and_publish_exactly_its_plan(run, tmp_path, monkeypatch):
    """Two real producers over a 3:1 mix (the small source repeating): each logs one line per source before it
    publishes, the items are the batcher's plan (every drawn sample once across both), and the per-source
    trained-token counter matches what was published."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # two producers on a small box
    target = build_target(tmp_path / "model", "qwen3", layers=4)
    code, chat = write_chat_rows(tmp_path / "code.jsonl", 40), write_chat_rows(tmp_path / "chat.jsonl", 12, seed=1)
    cfg = run.write_config(
        2,
        1,
        slots=4,
        data={
            "sources": [{"path": str(code), "weight": 3.0}, {"path": str(chat), "weight": 1.0, "repeat": True}],
            "cache_dir": str(tmp_path / "cache"),
            "max_length": 256,
            "max_tokens_per_batch": 512,
            "seed": 3,
        },
        target={"path": str(target), "num_draft_layers": 2, "state_dir": str(tmp_path / "state"), "device": "cpu"},
    )
    sources = load_sources(cfg.data, load_tokenizer(target))  # tokenized here: the producers find the cache
    batchers = [ShardBatcher.from_config(sources, cfg.data, rank=p, world_size=2) for p in (0, 1)]
    sup, producers = run.supervisor(), [run.role("target", p) for p in (0, 1)]
    items = []
    with Ring.attach(ring_spec(cfg)) as ring:
        wait_for(lambda: ring.counter(Counter.PRODUCED) == 4, timeout=180, what="a full ring")
        # A producer still starting (it may not have published yet) serves its metrics only once its port is up.
        wait_for(
            lambda: all(serves(cfg.metrics.port_base + 1 + p) for p in (0, 1)),
            timeout=120,
            what="both producers' metrics",
        )
        published = [scrape(cfg.metrics.port_base + 1 + p, "dflash_ring_target_trained_tokens_total") for p in (0, 1)]
        me = Membership.join(ring, cfg.run, Role.CONSUMER, 0, journal_dir=cfg.train.checkpoint_dir)
        port = ring.consumer(me.row)
        while (r := port.claim(timeout_s=60)) is not None:
            items.append((dict(r.meta), r.tensors["sample_ids"].tolist(), r.tensors["loss_mask"].sum().item()))
            port.release(r)
            del r
        me.leave()
    for p in producers:
        assert wait_exit(p, 60) == 0
    assert wait_exit(sup, 60) == 0
    plan = {(p, 0, i): b for p, batcher in enumerate(batchers) for i, b in enumerate(batcher.batches())}
    assert sorted((m["producer"], m["epoch"], m["position"]) for m, _, _ in items) == sorted(plan)
    for m, rows, trained in items:
        batch = plan[m["producer"], m["epoch"], m["position"]]
        assert rows == batch.sample_ids.tolist() and trained == int(batch.loss_mask.sum())
    # The first four items were in the ring when the counters were read: their trained tokens by source.
    first = [plan[m["producer"], m["epoch"], m["position"]] for m, _, _ in items[:4]]
    by_source = sum(b.trained_by_source(2) for b in first)
    assert {k: sum(p.get(k, 0) for p in published) for k in ("code", "chat")} == dict(
        zip(("code", "chat"), by_source.tolist())
    )
    assert batchers[0].counts == [40, 13]  # code sets the epoch (40 rows = 3/4), chat's 12 rows give 13 (1/4)
    for p in producers:
        err = p.stderr.read()
        lines = [ln for ln in err.splitlines() if "data source " in ln or "resuming at epoch" in ln]
        assert "data source code (" in lines[0] and "data source chat (" in lines[1], err[-3000:]
        assert "resuming at epoch" in lines[2] and len(lines) == 3, err[-3000:]
