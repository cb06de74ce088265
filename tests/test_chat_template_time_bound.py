"""A chat template that loops without writing anything (nested range loops: jinja's sandbox caps one range at 100,000,
not a nest of them) rendered for hours, and RENDER_FACTOR never saw it: the producer's tokenizing never ended. Each
render is now bounded by RENDER_SECONDS (common/chat_encoding.py `_bounded`): a row past it is a bad row, a template
whose minimal chat is past it is refused at the start, and the SIGALRM handler and itimer found are put back."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from test_producer_data import MARKED_TEMPLATE, UNMARKED_TEMPLATE
from dflash_ring.common import chat_encoding
from dflash_ring.common.chat_encoding import BadRow, ChatEncoder, template_token_ids
from dflash_ring.common.config.data import DataConfig, DataError
from dflash_ring.embedded.tiny_tokenizer import tiny_chat_tokenizer
from dflash_ring.producer.pretokenized import load_tokenized

# 10^10 iterations that write nothing: hours, where the bound below ends it in half a second.
NEST = "{%- for i in range(100000) %}{%- for j in range(100000) %}{%- endfor %}{%- endfor %}"
MARKED, UNMARKED = MARKED_TEMPLATE, UNMARKED_TEMPLATE  # the ChatML the data tests use, marked and not
# Loops only on a row that asks for it: the start-up probe's minimal chat renders at once.
LOOPS_ON_ROW = "{%- for m in messages if 'loop' in m.content %}" + NEST + "{%- endfor %}" + UNMARKED
GOOD = {"prompt": "explain speculative decoding", "response": "a drafter guesses, the target checks"}
LOOPING = {"prompt": "loop for ever", "response": "never rendered"}


@pytest.fixture(autouse=True)
def bound(monkeypatch):
    monkeypatch.setattr(chat_encoding, "RENDER_SECONDS", 0.5)


@pytest.fixture
def alarm_state():
    """The test's own SIGALRM handler and itimer are cleared afterwards, whatever happened."""
    handler = signal.getsignal(signal.SIGALRM)
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, handler)


def encoder(path, template: str) -> ChatEncoder:
    return ChatEncoder(tiny_chat_tokenizer(path, chat_template=template), max_length=4096, enable_thinking=False)


def test_a_row_whose_render_loops_is_a_bad_row_naming_the_template_and_the_bound(tmp_path, caplog):
    enc = encoder(tmp_path / "tok", LOOPS_ON_ROW)
    with pytest.raises(BadRow) as e:
        enc.encode(LOOPING)
    why = str(e.value)
    assert f"the chat template of {enc.tokenizer.name_or_path} did not finish rendering it within 0.5 s" in why, why
    assert "fix the template" in why and "\n" not in why
    assert enc.encode(GOOD)[1].any()  # the next row renders as before

    # Through the producer's tokenizing: skipped and reported like any bad row, the other rows kept.
    path = tmp_path / "rows.jsonl"
    path.write_text(f"{json.dumps(GOOD)}\n{json.dumps(LOOPING)}\n")
    with caplog.at_level(logging.WARNING, logger="dflash_ring.producer.pretokenized"):
        data = load_tokenized(DataConfig(path=str(path), cache_dir=str(tmp_path / "cache")), enc.tokenizer)
    assert data.row_ids.tolist() == [0] and data.bad_rows == ((1, why),)
    assert any(r.getMessage() == f"skipping row 1 of {path}: {why}" for r in caplog.records)


def test_a_data_set_whose_every_row_loops_is_one_error(tmp_path):
    enc = encoder(tmp_path / "tok", LOOPS_ON_ROW)
    path = tmp_path / "rows.jsonl"
    path.write_text(f"{json.dumps(LOOPING)}\n")
    with pytest.raises(DataError, match="no usable row.*did not finish rendering it within 0.5 s"):
        load_tokenized(DataConfig(path=str(path), cache_dir=str(tmp_path / "cache")), enc.tokenizer)


@pytest.mark.parametrize("template", [MARKED, UNMARKED], ids=["marked", "unmarked"])
def test_a_template_whose_minimal_chat_loops_is_refused_at_the_start(tmp_path, template):
    tok = tiny_chat_tokenizer(tmp_path / "tok", chat_template=NEST + template)
    refusal = f"the chat template of {tok.name_or_path} cannot render a minimal user/assistant chat"
    with pytest.raises(DataError, match=refusal) as e:
        ChatEncoder(tok, max_length=4096, enable_thinking=False)
    assert "within 0.5 s" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(DataError, match=refusal):  # the mask-token check's render of it, before any ChatEncoder
        template_token_ids(tok)


def test_the_alarm_handler_and_itimer_found_are_put_back(tmp_path, alarm_state):
    enc = encoder(tmp_path / "tok", LOOPS_ON_ROW)
    rang: list[int] = []

    def theirs(signum, frame):
        rang.append(signum)

    signal.signal(signal.SIGALRM, theirs)
    signal.setitimer(signal.ITIMER_REAL, 100, 50)
    enc.encode(GOOD)
    with pytest.raises(BadRow):
        enc.encode(LOOPING)
    assert signal.getsignal(signal.SIGALRM) is theirs
    delay, interval = signal.getitimer(signal.ITIMER_REAL)
    assert 90 < delay <= 99.5 and interval == 50  # less the time the renders took
    assert not rang

    # One that fell due during a render rings as soon as the render is over.
    signal.setitimer(signal.ITIMER_REAL, 0.1)
    with pytest.raises(BadRow):
        enc.encode(LOOPING)
    while not rang:
        time.sleep(0.01)
    assert signal.getsignal(signal.SIGALRM) is theirs and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)

    # None found: none left.
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    enc.encode(GOOD)
    with pytest.raises(BadRow):
        enc.encode(LOOPING)
    assert signal.getsignal(signal.SIGALRM) is signal.SIG_DFL
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_stop_that_takes_sigalrm_over_during_a_render_keeps_it(tmp_path, monkeypatch, alarm_state):
    """role_process: a SIGTERM in an interruptible phase arms its own SIGALRM (to raise the stop again) and raises the
    stop wherever the main thread is: in a render, the render's bound must not put its own state back over that."""
    monkeypatch.setattr(chat_encoding, "RENDER_SECONDS", 60)
    enc = encoder(tmp_path / "tok", LOOPS_ON_ROW)

    class Stop(BaseException):
        pass

    def again(signum, frame):
        pass

    def on_stop(signum, frame):
        signal.signal(signal.SIGALRM, again)
        signal.setitimer(signal.ITIMER_REAL, 30, 30)
        raise Stop

    previous = signal.signal(signal.SIGUSR1, on_stop)
    try:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        with pytest.raises(Stop):
            enc.encode(LOOPING)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert signal.getsignal(signal.SIGALRM) is again and signal.getitimer(signal.ITIMER_REAL)[1] == 30


def test_a_normal_template_renders_as_before_on_any_thread(tmp_path):
    """Rows render the same bounded (the main thread) and unbounded (another thread, where no handler may be set),
    and no alarm is left behind."""
    enc = encoder(tmp_path / "tok", MARKED)
    rows = [GOOD, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
    before = signal.getsignal(signal.SIGALRM), signal.getitimer(signal.ITIMER_REAL)
    here = [enc.encode(row) for row in rows]
    with ThreadPoolExecutor(1) as pool:
        there = list(pool.map(enc.encode, rows))
    for (ids, mask), (ids2, mask2) in zip(here, there, strict=True):
        assert mask.any() and ids.tolist() == ids2.tolist() and mask.tolist() == mask2.tolist()
    assert (signal.getsignal(signal.SIGALRM), signal.getitimer(signal.ITIMER_REAL)) == before


def test_regenerates_and_evals_prompts_are_bounded_too(tmp_path):
    """Outside ChatEncoder a prompt is rendered by `render_chat`: regenerate's (hf engine `rendered_ids`, whose
    failure is that prompt's error reply) and eval's (`chat_prompts`, one line naming the file's line)."""
    from dflash_ring.consumer.evaluation.evaluate import EvalRefusal, chat_prompts
    from dflash_ring.producer.generation import Prompt
    from dflash_ring.producer.hf_engine import rendered_ids

    tokenizer = tiny_chat_tokenizer(tmp_path / "tok", chat_template=LOOPS_ON_ROW)
    looping = Prompt(0, ({"role": "user", "content": "loop for ever"},))
    with pytest.raises(BadRow, match="did not finish rendering it within 0.5 s"):
        rendered_ids(tokenizer, looping, enable_thinking=False)
    assert rendered_ids(tokenizer, Prompt(1, ({"role": "user", "content": "hi"},)), enable_thinking=False)
    data = tmp_path / "eval.jsonl"
    data.write_text(f"{json.dumps(GOOD)}\n{json.dumps(LOOPING)}\n")
    with pytest.raises(EvalRefusal) as e:
        chat_prompts(data, tokenizer)
    assert str(e.value).startswith(f"data {data}, line 2: the chat template of {tokenizer.name_or_path} did not"), e
