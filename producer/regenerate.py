"""`dflash-ring regenerate`: the target's own replies to a data set's prompts, written as a data set.

The output directory (regenerate.output) is what `data.path` reads, as a directory of jsonl:

    shard-00000.jsonl           {"messages": [...prompt turns..., {"role": "assistant", "content": reply}]}
    ...
    .regenerate/job.json        the source and settings the job started with; a resume must match them
    .regenerate/shard-00000.json  a finished shard's record: counts, skipped rows and why, the file's sha256
    .regenerate/lock            flock: one job per output directory

Shard k answers source rows [k * shard_rows, (k + 1) * shard_rows), in source order. A shard counts as
finished once its record exists: its file is written whole (temporary name, fsync, rename, fsync of the
directory), and only then its record, the same way. A crash leaves at most one shard file without a
record, which the next start writes again whole; so a restart after a crash at any moment ends with
exactly one reply per usable prompt. The engine (producer/generation.py) knows nothing of this.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_ring.common.bounded_read import RECORD_BYTES, read_text
from dflash_ring.common.chat_encoding import BadRow, conversation_of, decode_json_row, prompt_of
from dflash_ring.common.crash_points import crash_point
from dflash_ring.common.config.data import DataConfig, DataError
from dflash_ring.common.durable import fsync
from dflash_ring.common.metrics import RegenerateMetrics
from dflash_ring.common.output_dir import check_output_dir
from dflash_ring.common.config.regenerate import RegenerateConfig, RegenerateConfigError
from dflash_ring.common.refusal import Refusal
from dflash_ring.common.config.target import TargetConfig

from .data_source import DataFiles, batch_rows, check_row_size, locate, max_row_bytes, open_dataset
from .generation import Engine, GenerationSettings, Prompt, Reply

log = logging.getLogger(__name__)

JOB_VERSION = 1  # bump when the output layout or what a setting means changes: old jobs are then refused
STATE_DIR = ".regenerate"
_WARN_ROWS = 100  # skipped rows warned about one by one; all are in the shard records

Progress = Callable[[int, int], None]
"""(source rows finished, source rows in all): called as rows finish, including those of earlier starts."""


class RegenerateError(RuntimeError):
    """The job cannot go on; the message says why and what to do."""


@dataclass
class ShardRecord:
    """What one finished shard holds and what it skipped, by source row index (and why)."""

    shard: int
    first_row: int
    rows: int  # source rows of the shard: written + dropped + unusable + errors + bad rows + too long
    written: int
    complete: int  # replies that ended on their own (EOS)
    truncated_kept: int  # replies that hit max_new_tokens, written (keep_truncated)
    prompt_tokens: int
    completion_tokens: int
    sha256: str  # of the shard file; "" when nothing was written (no file)
    truncated_dropped: list[int] = field(default_factory=list)
    unusable: list[list[Any]] = field(default_factory=list)  # [row, why]: replies the data loader would refuse
    errors: list[list[Any]] = field(default_factory=list)  # [row, why]: prompts the engine failed
    bad_rows: list[list[Any]] = field(default_factory=list)  # [row, why]: rows that hold no usable prompt
    # [row, why]: prompts over regenerate.max_prompt_tokens (a record written before the setting has none)
    too_long: list[list[Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        """Each field of the type it is declared as (a record read back from disk may hold anything): TypeError
        naming the first that is not, which the reader refuses naming the file."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "int":
                ok = type(value) is int and value >= 0  # noqa: E721 (a bool is no count)
            elif f.type == "str":
                ok = isinstance(value, str)
            elif f.type == "list[int]":
                ok = isinstance(value, list) and all(type(v) is int for v in value)  # noqa: E721
            else:  # [row, why] pairs
                ok = isinstance(value, list) and all(
                    isinstance(v, list) and len(v) == 2 and type(v[0]) is int
                    for v in value  # noqa: E721
                )
            if not ok:
                raise TypeError(f"{f.name} = {json.dumps(value)[:80]} is not {f.type}")


@dataclass(frozen=True)
class RegenerateSummary:
    output: str
    source: str
    rows: int
    shards: int
    shards_resumed: int  # finished by earlier starts
    written: int
    complete: int
    truncated_kept: int
    truncated_dropped: int
    unusable: int
    errors: int
    bad_rows: int
    too_long: int  # prompts over regenerate.max_prompt_tokens
    prompt_tokens: int
    completion_tokens: int
    rows_this_start: int
    seconds: float  # this start, engine loading included

    @property
    def rows_per_s(self) -> float:
        return self.rows_this_start / self.seconds if self.seconds > 0 else 0.0


def generation_settings(r: RegenerateConfig, data_cfg: DataConfig) -> GenerationSettings:
    return GenerationSettings(
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        seed=r.seed,
        enable_thinking=data_cfg.enable_thinking,
    )


def job_settings(
    r: RegenerateConfig, data_cfg: DataConfig, target: TargetConfig, data: DataFiles, rows: int
) -> dict[str, Any]:
    """What the output depends on: a resume must match all of it. Throughput settings (batch sizes,
    concurrency, URLs, timeouts) are left out, so a resume may change them. `rows` is the source's, whatever
    regenerate.max_rows answers of it; the limits (max_rows, max_prompt_tokens) are named only when set, so a job
    started before they existed, which had none, resumes as it was."""
    job: dict[str, Any] = {
        "version": JOB_VERSION,
        "data.path": str(data.root),
        "data.format": data.format,
        "data.split": data_cfg.split,
        "data.rows": rows,
        "data.files": data.fingerprint,  # paths, sizes and modification times
        "data.enable_thinking": data_cfg.enable_thinking,
        **{
            f"regenerate.{k}": getattr(r, k)
            for k in ("engine", "max_new_tokens", "temperature", "top_p", "seed", "keep_truncated", "shard_rows")
        },
        **{f"regenerate.{k}": getattr(r, k) for k in ("max_rows", "max_prompt_tokens") if getattr(r, k)},
    }
    if r.engine == "hf":
        job |= {
            "target.path": os.path.abspath(os.path.expanduser(target.path)),
            "target.tokenizer": target.tokenizer,
            "target.dtype": target.dtype,
        }
    else:
        job |= {"regenerate.model": r.model}
    return job


def open_engine(
    r: RegenerateConfig, target: TargetConfig, device: str | None, on_batch: Callable[[], None] | None = None
) -> Engine:
    """The configured engine, loaded (the hf engine loads the target here); `on_batch`: called by the hf engine
    after each batch (the openai engine answers prompt by prompt and has none)."""
    if r.engine == "hf":
        from .hf_engine import HfEngine

        return HfEngine.load(
            target,
            device or target.device,
            batch_tokens=r.batch_tokens,
            batch_size=r.batch_size,
            on_batch=on_batch,
        )
    from .openai_engine import OpenAIEngine

    return OpenAIEngine(r)


def check_settings(r: RegenerateConfig, data_cfg: DataConfig, target: TargetConfig) -> None:
    """What can be refused before anything is opened or loaded."""
    if not r.output:
        raise RegenerateConfigError("regenerate.output is empty: set it to the directory the replies are written to")
    if data_cfg.sources:
        raise RegenerateConfigError(
            "regenerate reads one data set, data.path, and [[data.sources]] is set: "
            "regenerate each source into its own regenerate.output, then list those "
            "outputs in [[data.sources]]"
        )
    if r.engine == "openai" and not r.base_urls:
        raise RegenerateConfigError(
            'regenerate.engine = "openai" needs regenerate.base_urls, e.g. '
            '["http://127.0.0.1:8000/v1"] (the server\'s OpenAI-compatible API)'
        )
    if r.engine == "hf" and not target.path:
        raise RegenerateConfigError(
            'regenerate.engine = "hf" runs the target in this process: set target.path to its local model directory'
        )
    if r.max_prompt_tokens and not (target.path or target.tokenizer):
        raise RegenerateConfigError(
            f"regenerate.max_prompt_tokens = {r.max_prompt_tokens} counts each prompt's tokens with the target's "
            "tokenizer and chat template: set target.tokenizer (or target.path) to its local directory, or set "
            "regenerate.max_prompt_tokens = 0"
        )


def regenerate(
    r: RegenerateConfig,
    data_cfg: DataConfig,
    target: TargetConfig,
    *,
    device: str | None = None,
    metrics: RegenerateMetrics | None = None,
    progress: Progress | None = None,
) -> RegenerateSummary:
    """Answer every usable prompt of the data set (data.path) once, resuming where an earlier start stopped."""
    started = time.monotonic()
    check_settings(r, data_cfg, target)
    metrics = metrics or RegenerateMetrics()
    out = check_output_dir(r.output)
    data = locate(data_cfg)
    if out == data.root or data.root.is_relative_to(out):
        raise RegenerateConfigError(
            f"regenerate.output = {out} holds the source data ({data.root}): write the "
            "replies to a directory of their own"
        )
    ds, json_rows = open_dataset(data, data_cfg)
    source_rows = len(ds)
    if source_rows == 0:
        raise DataError(f"data set {data.root} has no rows")
    rows = min(source_rows, r.max_rows) if r.max_rows else source_rows  # the job's rows: the first `rows` of the source
    shards = -(-rows // r.shard_rows)
    settings = generation_settings(r, data_cfg)
    with OutputDir(out, job_settings(r, data_cfg, target, data, source_rows), shards) as output:
        resumed = len(output.records)
        done = before = sum(rec.rows for rec in output.records.values())
        metrics.rows_total.set(rows)
        metrics.rows_done.set(done)
        if progress:
            progress(done, rows)
        if rows < source_rows:
            log.info("answering the first %d of the %d rows of %s (regenerate.max_rows)", rows, source_rows, data.root)
        if resumed:
            log.info("resuming %s: %d of %d shards finished (%d of %d rows)", out, resumed, shards, done, rows)
        meter = ProgressMeter(done, rows, per_batch=r.engine == "hf")
        count_tokens: Callable[[Prompt], int] | None = None
        warned = sum(len(rec.bad_rows) for rec in output.records.values())
        # Bad rows are warned about once the source is known to hold a usable row: a source of nothing but
        # bad rows gets one error line with examples instead of a warning per row before it.
        usable = any(rec.rows > len(rec.bad_rows) for rec in output.records.values())
        unwarned: list[list[Any]] = []
        # Until one prompt of the job is answered, a shard whose every prompt failed is held back, not recorded:
        # a job that fails on every row (a broken template, a server refusing each request) records nothing.
        answered = any(rec.rows > len(rec.bad_rows) + len(rec.errors) for rec in output.records.values())
        held: list[ShardRecord] = []
        engine: Engine | None = None
        try:
            for k in range(shards):
                if k in output.records:
                    continue
                first, last = k * r.shard_rows, min(rows, (k + 1) * r.shard_rows)
                prompts, bad = shard_prompts(
                    batch_rows(ds[first:last], json_rows), json_rows, first, max_row_bytes(data_cfg.max_length)
                )
                unwarned += bad
                usable = usable or bool(prompts)
                if usable:
                    for index, why in unwarned[: max(0, _WARN_ROWS - warned)]:
                        log.warning("skipping row %d of %s: %s", index, data.root, why)
                    warned += len(unwarned)
                    unwarned = []
                replies: dict[int, Reply] = {}
                too_long: list[list[Any]] = []
                if prompts and engine is None:
                    engine = _opened(r, target, device, len(output.records), meter.batch_done)
                    meter.begin()
                if prompts and r.max_prompt_tokens:
                    count_tokens = count_tokens or _token_counter(engine, target, settings.enable_thinking)
                    prompts, too_long = within_limit(prompts, count_tokens, r.max_prompt_tokens)
                skipped = len(bad) + len(too_long)
                meter.skipped(skipped)
                if prompts:
                    on_reply = (lambda n: progress(done + skipped + n, rows)) if progress else None
                    replies = _answer(
                        engine,
                        prompts,
                        settings,
                        metrics,
                        meter,
                        on_reply,
                        f"shard {k} (rows {first}-{last - 1})",
                        len(output.records),
                    )
                record, lines = shard_output(k, first, last - first, prompts, replies, bad, r.keep_truncated, too_long)
                if prompts and not answered and len(record.errors) == len(prompts):
                    held.append(record)
                    continue
                answered = answered or bool(prompts)
                for earlier in held:  # the job works after all: those shards' errors are rows' errors
                    output.commit(earlier, [])
                    _count(metrics, earlier)
                    done += earlier.rows
                held = []
                output.commit(record, lines)
                _count(metrics, record)
                done += record.rows
                metrics.rows_done.set(done)
                if progress:
                    progress(done, rows)
                if usable:  # a source of only bad rows: one error line at the end, no progress lines before
                    log.info(
                        "shard %d/%d written: %d replies of %d rows (%d truncated dropped, %d unusable, "
                        "%d errors, %d bad rows, %d too long); %d/%d rows, %s",
                        k + 1,
                        shards,
                        record.written,
                        record.rows,
                        len(record.truncated_dropped),
                        len(record.unusable),
                        len(record.errors),
                        len(record.bad_rows),
                        len(record.too_long),
                        done,
                        rows,
                        _rate_text(done - before, time.monotonic() - started, rows - done),
                    )
        finally:
            if engine is not None:
                engine.close()
        if held:
            raise _all_failed(held, len(output.records))
        summary = _summary(output, data, rows, shards, resumed, done - before, time.monotonic() - started)
    if summary.bad_rows == rows:
        bad = [b for k in sorted(output.records) for b in output.records[k].bad_rows]
        examples = "; ".join(f"row {i}: {why}" for i, why in bad[:3])
        raise DataError(
            f"no usable row in {data.root}: all {rows} rows were skipped ({examples}; all listed in "
            f"{out / STATE_DIR}). Each row needs 'messages' (a list of {{role, content}} whose reply "
            "follows a user turn) or a non-empty 'prompt'"
        )
    if warned > _WARN_ROWS:
        log.warning("... and %d more bad rows (all listed in %s)", warned - _WARN_ROWS, out / STATE_DIR)
    return summary


def _all_failed(held: list[ShardRecord], finished: int) -> RegenerateError:
    """Every prompt the engine was given failed: one line with the first reasons, nothing recorded as done."""
    errors = [e for rec in held for e in rec.errors]
    examples = "; ".join(f"row {i}: {why}" for i, why in errors[:2])
    return RegenerateError(
        f"the engine failed on every prompt it was given ({len(errors)} rows of {len(held)} "
        f"shards; {examples}): none of them is recorded as done ({finished} shards finished "
        "before); fix the cause and run the same command again"
    )


def shard_prompts(
    rows: Sequence[Any], json_rows: bool, first: int, cap: int | None = None
) -> tuple[list[Prompt], list[list[Any]]]:
    """The prompts of consecutive source rows starting at row `first`, and the rows that hold none ([row, why]);
    a row over `cap` (`max_row_bytes`) is one of those, unparsed."""
    prompts, bad = [], []
    for index, raw in enumerate(rows, start=first):
        try:
            if cap is not None:
                check_row_size(raw, cap)
            prompts.append(Prompt(index, tuple(prompt_of(decode_json_row(raw) if json_rows else raw))))
        except BadRow as e:
            bad.append([index, str(e)])
    return prompts, bad


def within_limit(
    prompts: Sequence[Prompt], count_tokens: Callable[[Prompt], int], limit: int
) -> tuple[list[Prompt], list[list[Any]]]:
    """The prompts of at most `limit` rendered tokens, and the others as [row, why] (regenerate.max_prompt_tokens):
    skipped whole and recorded, never cut, since a cut prompt asks another question. A prompt that cannot be
    rendered here stays: the engine fails it with its own reason, as it would without a limit."""
    kept, too_long = [], []
    for prompt in prompts:
        try:
            tokens = count_tokens(prompt)
        except Exception:  # templates raise anything (jinja errors, raise_exception(...)): the engine's to report
            log.debug("cannot count the tokens of row %d", prompt.index, exc_info=True)
            kept.append(prompt)
            continue
        if tokens > limit:
            too_long.append(
                [prompt.index, f"the prompt is {tokens} tokens, over regenerate.max_prompt_tokens = {limit}"]
            )
        else:
            kept.append(prompt)
    return kept, too_long


def _token_counter(engine: Engine | None, target: TargetConfig, enable_thinking: bool) -> Callable[[Prompt], int]:
    """A prompt's rendered length by the target's tokenizer and chat template: the hf engine's own, already loaded;
    for a server, the same files read here (check_settings made sure they are named)."""
    from .hf_engine import HfEngine, chat_tokenizer, rendered_ids

    tokenizer = engine.tokenizer if isinstance(engine, HfEngine) else chat_tokenizer(target)
    return lambda prompt: len(rendered_ids(tokenizer, prompt, enable_thinking))


def _opened(
    r: RegenerateConfig, target: TargetConfig, device: str | None, finished: int, on_batch: Callable[[], None]
) -> Engine:
    """The engine, or a one-line error: a failure to load it ends the job with finished shards kept."""
    try:
        return open_engine(r, target, device, on_batch)
    except (Refusal, OSError):  # already one clear line
        raise
    except Exception as e:
        log.debug("engine failure", exc_info=True)
        raise RegenerateError(
            f"cannot start the {r.engine} engine: {type(e).__name__}: {e}. The "
            f"{finished} finished shards are kept: run the same command again to resume"
        ) from e


def _answer(
    engine: Engine,
    prompts: list[Prompt],
    settings: GenerationSettings,
    metrics: RegenerateMetrics,
    meter: ProgressMeter,
    on_reply: Callable[[int], None] | None,
    where: str,
    finished: int,
) -> dict[int, Reply]:
    """One reply per prompt, or RegenerateError: an engine failure ends the job with finished shards kept."""
    wanted = {p.index for p in prompts}
    replies: dict[int, Reply] = {}
    try:
        for reply in engine.generate(prompts, settings):
            if reply.index not in wanted or reply.index in replies:
                raise RegenerateError(
                    f"the engine answered row {reply.index} of {where} "
                    f"{'twice' if reply.index in replies else 'without being asked'}"
                )
            replies[reply.index] = reply
            metrics.prompt_tokens.inc(reply.prompt_tokens)
            metrics.generated_tokens.inc(reply.completion_tokens)
            if reply.finish_reason == "error":
                metrics.errors.labels("reply").inc()
            meter.reply(reply)
            if on_reply:
                on_reply(len(replies))
    except RegenerateError:
        metrics.errors.labels("abort").inc()
        raise
    except Exception as e:  # the engine's own failure (a server gone after its retries, out of memory, ...)
        metrics.errors.labels("abort").inc()
        log.debug("engine failure", exc_info=True)
        raise RegenerateError(
            f"the engine failed on {where}: {type(e).__name__}: {e}. The {finished} finished "
            "shards are kept: run the same command again to resume"
        ) from e
    if missing := sorted(wanted - replies.keys()):
        metrics.errors.labels("abort").inc()
        raise RegenerateError(f"the engine gave no reply to {len(missing)} rows of {where} (first: row {missing[0]})")
    return replies


def shard_output(
    shard: int,
    first: int,
    rows: int,
    prompts: Sequence[Prompt],
    replies: dict[int, Reply],
    bad: list[list[Any]],
    keep_truncated: bool,
    too_long: list[list[Any]] | None = None,
) -> tuple[ShardRecord, list[str]]:
    """The shard's jsonl lines, in source order, and its record; `prompts` are those the engine answered, `bad` and
    `too_long` the rows skipped before it."""
    record = ShardRecord(
        shard=shard,
        first_row=first,
        rows=rows,
        written=0,
        complete=0,
        truncated_kept=0,
        prompt_tokens=0,
        completion_tokens=0,
        sha256="",
        bad_rows=bad,
        too_long=too_long or [],
    )
    lines = []
    for prompt in prompts:
        reply = replies[prompt.index]
        record.prompt_tokens += reply.prompt_tokens
        record.completion_tokens += reply.completion_tokens
        if reply.finish_reason == "error":
            record.errors.append([prompt.index, reply.error or "the engine gave no reason"])
            continue
        truncated = reply.finish_reason == "length"
        if truncated and not keep_truncated:
            record.truncated_dropped.append(prompt.index)
            continue
        row = {"messages": [*prompt.messages, {"role": "assistant", "content": reply.text}]}
        try:
            conversation_of(row)  # the data loader's own check: an empty or undecodable reply would be skipped there
        except BadRow as e:
            record.unusable.append([prompt.index, str(e)])
            continue
        lines.append(json.dumps(row) + "\n")  # ASCII-escaped: no U+2028 and the like to split a line
        record.written += 1
        record.truncated_kept += truncated
        record.complete += not truncated
    return record, lines


class OutputDir:
    """The job's output directory, held (flock) while the job runs: its settings, records and shard files."""

    def __init__(self, root: Path, job: dict[str, Any], shards: int):
        self.root = root
        self.state = root / STATE_DIR
        self.job = job
        self.shards = shards
        self.records: dict[int, ShardRecord] = {}
        self._lock_fd = -1

    def __enter__(self) -> OutputDir:
        self.state.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.state / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise RegenerateError(
                f"another regenerate job is writing to {self.root} (it holds "
                f"{self.state / 'lock'}): wait for it, or set another regenerate.output"
            ) from None
        try:
            for leftover in [*self.root.glob(".*.tmp"), *self.state.glob(".*.tmp")]:
                leftover.unlink()  # a crashed start's half-written file; nobody else writes here now
            self._check_job()
            self._read_records()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # drops the lock
            self._lock_fd = -1

    def commit(self, record: ShardRecord, lines: list[str]) -> None:
        """The shard file, then its record: the record is what makes the shard finished."""
        path = self.root / shard_name(record.shard)
        if lines:
            data = "".join(lines).encode()
            record.sha256 = hashlib.sha256(data).hexdigest()
            _write_durably(path, data)
            crash_point("regenerate.shard_renamed")
        elif path.exists():  # written by a start that crashed before its record; this time nothing is kept
            path.unlink()
            fsync(self.root)
        _write_durably(
            self.state / f"{Path(shard_name(record.shard)).stem}.json", json.dumps(dataclasses.asdict(record)).encode()
        )
        self.records[record.shard] = record

    def _check_job(self) -> None:
        job_file = self.state / "job.json"
        if not job_file.exists():
            others = sorted(p.name for p in self.root.iterdir() if p.name != STATE_DIR)
            theirs = sorted(p.name for p in self.state.iterdir() if p.name != "lock")
            if others or theirs:
                raise RegenerateError(
                    f"regenerate.output = {self.root} already holds {(others or theirs)[0]!r} "
                    f"and no job record ({job_file}): choose a new or empty directory"
                )
            _write_durably(job_file, json.dumps(self.job, indent=1, sort_keys=True).encode())
            return
        try:
            there = json.loads(read_text(job_file, RECORD_BYTES, RegenerateError, "job record"))
            if not isinstance(there, dict):
                raise ValueError(f"a JSON {type(there).__name__}, not an object")
        except (OSError, ValueError, RecursionError) as e:
            raise RegenerateError(f"{job_file} cannot be read ({e}): choose a new regenerate.output") from None
        if there != self.job:
            changed = [
                f"{k} = {_shown(k, there.get(k))} there, {_shown(k, self.job.get(k))} here"
                for k in sorted(there.keys() | self.job.keys())
                if there.get(k) != self.job.get(k)
            ]
            raise RegenerateError(
                f"regenerate.output = {self.root} holds a job started from another source or with "
                f"other settings ({'; '.join(changed)}): run with the settings of {job_file}, "
                "or set a new regenerate.output"
            )

    def _read_records(self) -> None:
        for path in sorted(self.state.glob("shard-*.json")):
            try:
                record = ShardRecord(**json.loads(read_text(path, RECORD_BYTES, RegenerateError, "shard record")))
            except (OSError, ValueError, TypeError, RecursionError) as e:
                raise RegenerateError(
                    f"shard record {path} cannot be read ({e}): delete it and "
                    f"{self.root / (path.stem + '.jsonl')} to write that shard again"
                ) from None
            shard_file = self.root / shard_name(record.shard)
            if record.shard >= self.shards or path.name != f"{shard_file.stem}.json":
                raise RegenerateError(f"shard record {path} names shard {record.shard} of a {self.shards}-shard job")
            if record.written and (
                not shard_file.is_file() or hashlib.sha256(shard_file.read_bytes()).hexdigest() != record.sha256
            ):
                raise RegenerateError(
                    f"{shard_file} is missing or differs from what its record {path} says was "
                    "written: delete both to write that shard again"
                )
            self.records[record.shard] = record
        # Every *.jsonl file here is read as the output data set: one this job did not name is refused.
        if foreign := [p.name for p in sorted(self.root.glob("*.jsonl")) if not _SHARD_FILE.fullmatch(p.name)]:
            raise RegenerateError(
                f"regenerate.output = {self.root} holds {foreign[0]!r}, which is not a shard of this job but would "
                "be read with the replies as their data set: move it out"
            )
        unrecorded = [
            p.name
            for p in sorted(self.root.glob("shard-*.jsonl"))
            if int(p.stem.removeprefix("shard-")) not in self.records
        ]
        if unrecorded:
            log.info("%s: %s written without a record before a crash; written again", self.root, ", ".join(unrecorded))


_SHARD_FILE = re.compile(r"shard-\d{5,}\.jsonl")


def shard_name(shard: int) -> str:
    return f"shard-{shard:05d}.jsonl"


def _write_durably(path: Path, data: bytes) -> None:
    """Whole or not at all, and durable once this returns: temporary name (not *.jsonl, so the data loader
    never reads it), fsync, rename, fsync of the directory."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    if path.suffix == ".jsonl":
        crash_point("regenerate.shard_written")
    tmp.rename(path)
    fsync(path.parent)


def _shown(key: str, value: Any) -> str:
    if key == "data.files" and value is not None:
        return f"files {value[:12]}"  # a digest of paths, sizes and modification times
    return "(unset)" if value is None else repr(value)


def _count(metrics: RegenerateMetrics, record: ShardRecord) -> None:
    for outcome, n in (
        ("complete", record.complete),
        ("truncated_kept", record.truncated_kept),
        ("truncated_dropped", len(record.truncated_dropped)),
        ("unusable", len(record.unusable)),
        ("error", len(record.errors)),
        ("bad_row", len(record.bad_rows)),
        ("too_long", len(record.too_long)),
    ):
        metrics.prompts.labels(outcome).inc(n)


class ProgressMeter:
    """The job's progress line on this module's logger (INFO): rows done of the job's rows, new tokens/s and an ETA.

    A batch of the hf engine runs for minutes before its first reply, and a shard holds several batches: without
    this line a working job looked hung (a user killed one after 357 s of silence). The line comes after each
    engine batch (the hf engine calls `batch_done`: only it knows where its batches end) or, for an engine that
    answers prompt by prompt (openai), at most every `every_s` seconds as replies come. Rates are over this start
    since its engine was ready: loading it, and rows finished by earlier starts, would skew them. The `Progress`
    callback and the per-shard line are apart from this and unchanged."""

    def __init__(self, done: int, total: int, *, per_batch: bool, every_s: float = 10.0):
        self.done = done  # source rows answered or skipped, earlier starts included
        self.total = total
        self.per_batch = per_batch
        self.every_s = every_s
        self.rows = 0  # answered or skipped, this start
        self.replies = 0  # this start
        self.new_tokens = 0  # generated, this start
        self.started: float | None = None
        self.last_line = 0.0

    def begin(self) -> None:
        """The engine is ready: rates count from now."""
        self.started = self.last_line = time.monotonic()

    def skipped(self, rows: int) -> None:
        self.done += rows
        self.rows += rows

    def reply(self, reply: Reply) -> None:
        self.done += 1
        self.rows += 1
        self.replies += 1
        self.new_tokens += reply.completion_tokens
        if not self.per_batch and time.monotonic() - self.last_line >= self.every_s:
            self.line()

    def batch_done(self) -> None:
        self.line()

    def line(self) -> None:
        now = time.monotonic()
        self.last_line = now
        seconds = now - self.started if self.started is not None else 0.0
        log.info(
            "%d/%d rows done (%d replies this start), %s new tokens/s, %s",
            self.done,
            self.total,
            self.replies,
            f"{self.new_tokens / seconds:.1f}" if seconds > 0 else "?",
            _rate_text(self.rows, seconds, self.total - self.done),
        )


def _rate_text(rows: int, seconds: float, left: int) -> str:
    if rows <= 0 or seconds <= 0:
        return "rate not known yet"
    rate = rows / seconds
    return f"{rate:.1f} rows/s, ETA {left / rate:.0f} s"


def _summary(
    output: OutputDir, data: DataFiles, rows: int, shards: int, resumed: int, this_start: int, seconds: float
) -> RegenerateSummary:
    recs = output.records.values()
    return RegenerateSummary(
        output=str(output.root),
        source=str(data.root),
        rows=rows,
        shards=shards,
        shards_resumed=resumed,
        written=sum(r.written for r in recs),
        complete=sum(r.complete for r in recs),
        truncated_kept=sum(r.truncated_kept for r in recs),
        truncated_dropped=sum(len(r.truncated_dropped) for r in recs),
        unusable=sum(len(r.unusable) for r in recs),
        errors=sum(len(r.errors) for r in recs),
        bad_rows=sum(len(r.bad_rows) for r in recs),
        too_long=sum(len(r.too_long) for r in recs),
        prompt_tokens=sum(r.prompt_tokens for r in recs),
        completion_tokens=sum(r.completion_tokens for r in recs),
        rows_this_start=this_start,
        seconds=seconds,
    )


def format_summary(s: RegenerateSummary) -> str:
    lines = [
        f"regenerated {s.source} into {s.output}: {s.written} replies written of {s.rows} rows "
        f"({s.shards} shards, {s.shards_resumed} finished by earlier starts)",
        f"  complete {s.complete}, truncated kept {s.truncated_kept}, truncated dropped {s.truncated_dropped}, "
        f"unusable {s.unusable}, engine errors {s.errors}, bad rows {s.bad_rows}, too long {s.too_long}",
        f"  tokens: prompt {s.prompt_tokens}, generated {s.completion_tokens}",
        f"  this start: {s.rows_this_start} rows in {s.seconds:.1f} s ({s.rows_per_s:.2f} rows/s)",
    ]
    return "\n".join(lines)


def summary_json(s: RegenerateSummary) -> str:
    return json.dumps(dataclasses.asdict(s) | {"rows_per_s": round(s.rows_per_s, 3)}, indent=2)
