"""The openai engine of `regenerate` against a real OpenAI-compatible server: `transformers serve`.

The server is `transformers serve` (transformers[serving], in the test extra) pinned to a small
trained Qwen3 target on disk (the embedded recipe at a size that builds in seconds, with the tiny
tokenizer's Qwen3-style chat template), bound to 127.0.0.1 on a free port, offline
(HF_HUB_OFFLINE=1), one thread. It is started once per module (readiness: GET /health, with a
timeout) and its process group is killed at the end.

What `transformers serve` does with a request (transformers 5.24, read from its source): unknown
top-level fields are refused with 422, `chat_template_kwargs` is accepted and passed to
`apply_chat_template`, `n` is accepted and ignored, a model name other than the pinned one is
refused with 400, a message without a role is a 500, and requests are generated one at a time
(`model.generate` on one thread, batch of one), decoded with `skip_special_tokens=True`.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_ring.common.config.regenerate import RegenerateConfig, RegenerateConfigError
from dflash_ring.embedded.tiny_corpus import CorpusSpec
from dflash_ring.embedded.tiny_target import TinyTargetRecipe, ensure_tiny_target
from dflash_ring.producer.generation import GenerationSettings, Prompt, Reply, prompt_seed
from dflash_ring.producer.openai_engine import (
    OpenAIEngine,
    OpenAIEngineError,
    ServerRefusedError,
    ServerUnavailableError,
    backoff_delay,
)
from support import free_port_base

# The embedded recipe, small: ~5 s on one core, and trained enough to end its replies with <|im_end|>
# (so replies finish with "stop" as well as "length").
RECIPE = TinyTargetRecipe(
    corpus=CorpusSpec(num_train=800, num_heldout=8),
    tokenizer_vocab_size=400,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=128,
    steps=150,
    batch_size=16,
    warmup_steps=10,
    generation_checks=0,
)
SERVER_START_TIMEOUT_S = 180.0  # measured ~3.5 s on an idle 2-core box; generous for a loaded one
FAST = 0.02  # backoff base in tests: 0.02 s, 0.04 s, ...
GREEDY = GenerationSettings(max_new_tokens=48, temperature=0.0, top_p=1.0, seed=0, enable_thinking=False)

CHATS = [
    [{"role": "user", "content": "What is 3 plus 4?"}],
    [{"role": "user", "content": "Count from 3 to 5."}],
    [{"role": "user", "content": "Sort these numbers: 5 2 9."}],
    [{"role": "user", "content": "Reverse these words: red sun swim."}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 12 minus 5?"}],
    [
        {"role": "user", "content": "What is 1 plus 1?"},
        {"role": "assistant", "content": "The answer is 2."},
        {"role": "user", "content": "Count from 7 to 9."},
    ],
    [{"role": "user", "content": "hello there, café ünïcode"}],
]


def prompts(chats=CHATS, first_index: int = 100) -> list[Prompt]:
    return [Prompt(first_index + i, tuple(chat)) for i, chat in enumerate(chats)]


# --- the server ------------------------------------------------------------------------------------


@dataclass
class Server:
    proc: subprocess.Popen
    base_url: str
    log: Path
    start_seconds: float

    def chat_posts(self) -> int:
        """Chat requests the server has answered, from uvicorn's access log."""
        return self.log.read_text(errors="replace").count('"POST /v1/chat/completions HTTP/1.1"')


def start_server(model_dir: Path, log: Path) -> Server:
    port = free_port_base(span=1)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "HF_HOME": str(log.parent / "hf-home"),
    }
    started = time.monotonic()
    out = open(log, "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "transformers.cli.transformers",
            "serve",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--device",
            "cpu",
            "--dtype",
            "float32",
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )  # its own group, killed whole
    out.close()
    server = Server(proc, f"http://127.0.0.1:{port}/v1", log, 0.0)
    try:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"transformers serve exited {proc.returncode}:\n{log.read_text()[-3000:]}")
            if time.monotonic() - started > SERVER_START_TIMEOUT_S:
                raise AssertionError(
                    f"transformers serve not ready in {SERVER_START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}"
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
    except BaseException:
        stop_server(server)
        raise
    server.start_seconds = time.monotonic() - started
    print(f"transformers serve ready in {server.start_seconds:.1f} s", file=sys.stderr)
    return server


def stop_server(server: Server) -> None:
    try:
        os.killpg(server.proc.pid, signal.SIGCONT)  # in case a test left it paused
        os.killpg(server.proc.pid, signal.SIGTERM)
        server.proc.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """The built target, copied, with `do_sample: true` in its generation config as Qwen3 ships it:
    `transformers serve` samples only then (a request's temperature 0 still turns sampling off)."""
    built = ensure_tiny_target(tmp_path_factory.mktemp("targets"), RECIPE)
    path = tmp_path_factory.mktemp("served") / "tiny-target"
    shutil.copytree(built, path)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, "do_sample": True}, indent=2))
    return path


@pytest.fixture(scope="module")
def server(target, tmp_path_factory):
    s = start_server(target, tmp_path_factory.mktemp("server") / "serve.log")
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def second_server(target, tmp_path_factory):
    s = start_server(target, tmp_path_factory.mktemp("server2") / "serve.log")
    yield s
    stop_server(s)


def closed_url() -> str:
    """A loopback port nobody listens on: connections are refused."""
    return f"http://127.0.0.1:{free_port_base(span=1)}/v1"


def engine(urls: list[str], backoff_base_s: float = FAST, **cfg) -> OpenAIEngine:
    return OpenAIEngine(
        RegenerateConfig(engine="openai", base_urls=urls, **{"retries": 2, **cfg}),
        backoff_base_s=backoff_base_s,
        backoff_cap_s=30.0,
    )


def collect(eng: OpenAIEngine, ps: list[Prompt], settings: GenerationSettings = GREEDY) -> dict[int, Reply]:
    out: dict[int, Reply] = {}
    try:
        for reply in eng.generate(ps, settings):
            assert reply.index not in out, f"row {reply.index} answered twice"
            out[reply.index] = reply
    finally:
        eng.close()
    assert sorted(out) == [p.index for p in ps], "not one reply per prompt"
    return out


def cut_tails(replies: dict[int, Reply]) -> dict[int, Reply]:
    """Replies with the trailing whitespace of those cut at max_new_tokens removed. `transformers serve` streams its
    text through tokenizers' DecodeStream, which holds back a token's text until it is sure of it and is not flushed
    at the end: a reply cut at the limit right after a space token arrives without that space (seen on the tiny
    target with entropy, 2026-12-04). Only the text of the last token of a cut reply differs; tokens, counts and
    every other reply are compared exactly."""
    return {i: replace(r, text=r.text.rstrip()) if r.finish_reason == "length" else r for i, r in replies.items()}


def count_sends(eng: OpenAIEngine) -> list[str]:
    """Every HTTP attempt the engine makes, by URL (wraps its one sending method)."""
    sent: list[str] = []
    send = eng._send

    def counted(method, url, path, data):
        sent.append(url)
        return send(method, url, path, data)

    eng._send = counted
    return sent


# --- the in-process reference ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(target):
    """Greedy replies of a plain in-process `model.generate` (batch of one, one thread) with the same chat
    template: what the server should send back, text and token counts."""
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()

    def reply(prompt: Prompt, settings: GenerationSettings = GREEDY) -> Reply:
        inputs = tokenizer.apply_chat_template(
            list(prompt.messages),
            add_generation_prompt=True,
            enable_thinking=settings.enable_thinking,
            return_tensors="pt",
            return_dict=True,
        )
        if settings.temperature > 0:  # as the server does: its torch seed set to the request's, then generate
            torch.manual_seed(prompt_seed(settings.seed, prompt.index))
            sampling = {"do_sample": True, "temperature": settings.temperature, "top_p": settings.top_p}
        else:
            sampling = {"do_sample": False}
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.inference_mode():
                out = model.generate(**inputs, max_new_tokens=settings.max_new_tokens, **sampling)
        finally:
            torch.set_num_threads(threads)
        generated = out[0, inputs["input_ids"].shape[1] :]
        # The server's rule: "length" when as many tokens as allowed were generated (even if the last is the end).
        finish = "length" if len(generated) >= settings.max_new_tokens else "stop"
        return Reply(
            prompt.index,
            tokenizer.decode(generated, skip_special_tokens=True),
            finish,
            inputs["input_ids"].shape[1],
            len(generated),
        )

    reply.tokenizer = tokenizer
    return reply


# --- against the server --------------------------------------------------------------------------------


@pytest.mark.processes
def test_greedy_replies_equal_in_process_generate(server, reference, target):
    eng = engine([server.base_url], concurrency=1)  # model empty: asked from GET /models
    assert eng.model() == str(target)
    got = collect(eng, prompts())
    want = {p.index: reference(p) for p in prompts()}
    assert got == want
    assert {r.finish_reason for r in got.values()} == {"stop"}, "the trained target ends its replies itself"
    assert all(r.text and r.completion_tokens > 5 for r in got.values())


@pytest.mark.processes
def test_sampled_replies_follow_each_prompts_seed(server, reference):
    """temperature > 0: each request carries `prompt_seed(seed, index)`, and the server's replies equal an
    in-process sampled generate seeded with it (one request in flight: `transformers serve` seeds its
    process-wide generator per request, so only then is the seed its own)."""
    sampled = replace(GREEDY, temperature=1.0, top_p=0.95, seed=5)
    ps = prompts()
    got = collect(engine([server.base_url], concurrency=1), ps, sampled)
    assert cut_tails(got) == cut_tails({p.index: reference(p, sampled) for p in ps})
    again = collect(engine([server.base_url], concurrency=1), ps, sampled)
    assert again == got, "the same seed samples the same replies"
    other = collect(engine([server.base_url], concurrency=1), ps, replace(sampled, seed=6))
    greedy = {p.index: reference(p) for p in ps}
    assert any(other[i].text != got[i].text for i in got), "another seed samples other replies"
    assert any(got[i].text != greedy[i].text for i in got), "sampling at temperature 1 is not greedy"


@pytest.mark.processes
def test_thinking_switch_reaches_the_chat_template(server, reference):
    """`chat_template_kwargs` gets to `apply_chat_template`: with thinking off the Qwen3-style template
    pre-fills an empty <think> block, so the prompt the server counted is longer, and the same length as
    the template makes in process for each setting."""
    ps = prompts(CHATS[:2])
    for thinking in (False, True):
        settings = replace(GREEDY, enable_thinking=thinking, max_new_tokens=4)
        got = collect(engine([server.base_url]), ps, settings)
        for p in ps:
            want = len(
                reference.tokenizer.apply_chat_template(
                    list(p.messages),
                    add_generation_prompt=True,
                    enable_thinking=thinking,
                    tokenize=True,
                    return_dict=True,
                )["input_ids"]
            )
            assert got[p.index].prompt_tokens == want, (thinking, p.messages)
    off = reference.tokenizer.apply_chat_template(
        list(ps[0].messages), add_generation_prompt=True, enable_thinking=False, tokenize=False
    )
    on = reference.tokenizer.apply_chat_template(
        list(ps[0].messages), add_generation_prompt=True, enable_thinking=True, tokenize=False
    )
    assert off != on, "the template must tell the two settings apart for this test to mean anything"


@pytest.mark.processes
def test_concurrency_keeps_that_many_in_flight_and_answers_each_prompt_once(server, reference):
    ps = prompts(CHATS * 2)  # 14 prompts
    eng = engine([server.base_url], concurrency=4)
    lock, now, peak = threading.Lock(), [0], [0]
    reply = eng._reply

    def counted(*args):
        with lock:
            now[0] += 1
            peak[0] = max(peak[0], now[0])
        try:
            return reply(*args)
        finally:
            with lock:
                now[0] -= 1

    eng._reply = counted
    got = collect(eng, ps)
    assert peak[0] == 4, f"{peak[0]} requests in flight at most, want regenerate.concurrency = 4"
    assert got == {p.index: reference(p) for p in ps}


@pytest.mark.processes
def test_small_max_new_tokens_finishes_with_length(server, reference):
    settings = replace(GREEDY, max_new_tokens=3)
    got = collect(engine([server.base_url]), prompts(), settings)
    for p in prompts():
        assert got[p.index].finish_reason == "length"
        assert got[p.index].completion_tokens == 3
        assert got[p.index] == reference(p, settings)
        assert reference(p).text.startswith(got[p.index].text)


@pytest.mark.processes
def test_requests_spread_over_servers(server, second_server, reference):
    before = (server.chat_posts(), second_server.chat_posts())
    ps = prompts(CHATS * 2)
    got = collect(engine([server.base_url, second_server.base_url], concurrency=2), ps)
    assert got == {p.index: reference(p) for p in ps}
    first, second = server.chat_posts() - before[0], second_server.chat_posts() - before[1]
    assert first + second == len(ps) and first >= 4 and second >= 4, (first, second)


@pytest.mark.processes
@pytest.mark.parametrize("closed_first", [True, False])
def test_fails_over_from_a_closed_port(server, reference, closed_first):
    """Failing over to the next URL happens within one round (retries = 0), without waiting."""
    urls = [closed_url(), server.base_url] if closed_first else [server.base_url, closed_url()]
    # retries = 0: no waits; the backoff base (1 s) is how long a failed server is put aside.
    eng = engine(urls, retries=0, concurrency=2, backoff_base_s=1.0)
    sent = count_sends(eng)
    got = collect(eng, prompts())
    assert got == {p.index: reference(p) for p in prompts()}
    closed = next(u for u in urls if u != server.base_url)
    # The closed one is put aside once it failed: tried again only when its time out is up.
    assert 1 <= sent.count(closed) <= 3, sent


@pytest.mark.processes
def test_fails_over_from_a_server_that_stopped_answering(server, second_server, reference):
    """A paused server accepts connections but never answers: each request times out there and is
    answered by the other."""
    os.killpg(second_server.proc.pid, signal.SIGSTOP)
    try:
        # timeout 3 s and a retry: the live server, generating one request at a time on a shared 2-core box,
        # must not time out itself.
        eng = engine(
            [second_server.base_url, server.base_url], retries=1, concurrency=2, timeout_s=3.0, backoff_base_s=1.0
        )
        sent = count_sends(eng)
        started = time.monotonic()
        got = collect(eng, prompts())
        took = time.monotonic() - started
    finally:
        os.killpg(second_server.proc.pid, signal.SIGCONT)
    assert got == {p.index: reference(p) for p in prompts()}
    # Tried first by requests in its turn until it had timed out once, then put aside (1 s, 2 s, ...).
    assert 1 <= sent.count(second_server.base_url) <= 4, sent
    assert took < 60, took


@pytest.mark.processes
def test_a_server_that_stays_paused_is_one_clear_error(second_server):
    os.killpg(second_server.proc.pid, signal.SIGSTOP)
    try:
        eng = engine([second_server.base_url], retries=1, timeout_s=0.5)
        with pytest.raises(ServerUnavailableError, match=r"timed out after 0.5 s \(regenerate.timeout_s\)"):
            collect(eng, prompts()[:1])
    finally:
        os.killpg(second_server.proc.pid, signal.SIGCONT)


@pytest.mark.processes
@pytest.mark.parametrize("model", ["", "named"])
def test_all_servers_closed_is_one_clear_error_after_retries(target, model):
    """Every URL in every round, `retries` rounds after the first with growing waits, then one error naming
    the URLs and the last failure (a RuntimeError: the CLI prints it on one line and exits 2)."""
    urls = [closed_url(), closed_url()]
    eng = OpenAIEngine(
        RegenerateConfig(engine="openai", base_urls=urls, retries=2, model=str(target) if model else ""),
        backoff_base_s=0.2,
        backoff_cap_s=30,
    )
    sent = count_sends(eng)
    started = time.monotonic()
    with pytest.raises(ServerUnavailableError) as error:
        collect(eng, prompts()[:3])
    took = time.monotonic() - started
    assert isinstance(error.value, RuntimeError)
    message = str(error.value)
    assert all(u in message for u in urls) and "cannot connect" in message and "Connection refused" in message
    assert "after 3 rounds (regenerate.retries = 2)" in message
    assert took >= 0.2 + 0.4, "waits 0.2 s, then 0.4 s, between the rounds"
    if model:  # the first request that gives up ends the job; the others were trying too
        assert len(sent) >= 6
    else:  # the one GET /models, before any prompt is sent
        assert len(sent) == 6 and took < 5


@pytest.mark.processes
def test_a_refused_request_is_an_error_reply_not_an_exception(server):
    """4xx (here: a model the server does not serve, 400) is the row's error, with the server's words,
    and is not retried."""
    eng = engine([server.base_url], model="no-such-model")
    sent = count_sends(eng)
    got = collect(eng, prompts())
    for reply in got.values():
        assert (reply.finish_reason, reply.text) == ("error", "")
        assert "HTTP 400" in reply.error and "no-such-model" in reply.error and "pinned" in reply.error
    assert len(sent) == len(prompts()), "a 4xx is not retried"


@pytest.mark.processes
def test_a_server_error_on_one_row_is_retried_then_that_rows_error(server, reference):
    """A message without a role makes transformers serve fail with 500: retried (retries = 2), then an
    error Reply for that row alone; the other rows are answered."""
    chats = [CHATS[0], [{"content": "no role here"}], CHATS[1]]
    ps = prompts(chats)
    eng = engine([server.base_url], concurrency=3, retries=2)
    eng.model()  # GET /models before counting
    sent = count_sends(eng)
    got = collect(eng, ps)
    bad = got[ps[1].index]
    assert bad.finish_reason == "error" and "HTTP 500" in bad.error, bad
    assert got[ps[0].index] == reference(ps[0]) and got[ps[2].index] == reference(ps[2])
    assert len(sent) == 2 + 3, "the failing row tried 1 + retries times, the others once"


# --- without a server ------------------------------------------------------------------------------------


def test_request_body_carries_the_settings():
    eng = OpenAIEngine(RegenerateConfig(engine="openai", base_urls=["http://127.0.0.1:9/v1/"]))
    try:
        settings = GenerationSettings(max_new_tokens=7, temperature=0.7, top_p=0.9, seed=3, enable_thinking=True)
        body = eng.request_body("m", Prompt(42, ({"role": "user", "content": "hi"},)), settings)
    finally:
        eng.close()
    assert body == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 7,
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": prompt_seed(3, 42),
        "n": 1,
        "stream": False,
        "chat_template_kwargs": {"enable_thinking": True},
    }
    assert eng.base_urls == ["http://127.0.0.1:9/v1"]


def test_api_key_from_the_named_environment_variable(monkeypatch):
    cfg = RegenerateConfig(engine="openai", base_urls=["http://127.0.0.1:9/v1"], api_key_env="DFLASH_TEST_KEY")
    monkeypatch.delenv("DFLASH_TEST_KEY", raising=False)
    with pytest.raises(RegenerateConfigError, match="DFLASH_TEST_KEY"):
        OpenAIEngine(cfg)
    monkeypatch.setenv("DFLASH_TEST_KEY", "sk-test")
    eng = OpenAIEngine(cfg)
    eng.close()
    assert eng._headers["Authorization"] == "Bearer sk-test"
    no_key = OpenAIEngine(replace(cfg, api_key_env=""))
    no_key.close()
    assert "Authorization" not in no_key._headers


def test_no_base_url_is_a_config_error():
    with pytest.raises(RegenerateConfigError, match="base_urls"):
        OpenAIEngine(RegenerateConfig(engine="openai"))


def test_backoff_doubles_from_the_base_up_to_the_cap():
    assert [backoff_delay(a, 1.0, 30.0) for a in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert backoff_delay(1000, 1.0, 30.0) == 30


@pytest.mark.processes
def test_the_regenerate_command_through_the_server_writes_what_the_hf_engine_writes(server, target, tmp_path):
    """`dflash-ring regenerate` end to end with `engine = "openai"` against the served target, and again with
    `engine = "hf"` in process on the same prompts: the same data set, byte for byte (greedy)."""
    rows = [{"messages": chat + [{"role": "assistant", "content": "the corpus reply"}]} for chat in CHATS]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    outputs = {}
    for name in ("openai", "hf"):
        sets = [
            f'data.path="{data}"',
            f'data.cache_dir="{tmp_path / "cache"}"',
            f'target.path="{target}"',
            'target.device="cpu"',
            "metrics.enabled=false",
            f'regenerate.engine="{name}"',
            f'regenerate.output="{tmp_path / name}"',
            "regenerate.max_new_tokens=48",
            "regenerate.shard_rows=3",
            f'regenerate.base_urls=["{closed_url()}", "{server.base_url}"]',
            "regenerate.retries=1",
        ]
        out = subprocess.run(
            [sys.executable, "-m", "dflash_ring", "regenerate", "--json", *[a for s in sets for a in ("--set", s)]],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        assert out.returncode == 0, out.stderr[-3000:]
        outputs[name] = [p.read_bytes() for p in sorted((tmp_path / name).glob("shard-*.jsonl"))]
    assert len(outputs["openai"]) == 3 and outputs["openai"] == outputs["hf"]
    written = [json.loads(line) for shard in outputs["openai"] for line in shard.decode().splitlines()]
    assert [r["messages"][:-1] for r in written] == CHATS  # the prompt side unchanged
    assert all(r["messages"][-1]["content"] != "the corpus reply" for r in written)


@pytest.mark.processes
def test_a_url_or_key_refused_for_every_row_stops_the_job(server):
    """404 (here: the base URL without /v1) would refuse every row alike: one clear error, not a data set of
    per-row errors (a finished shard is never asked again)."""
    eng = engine([server.base_url.removesuffix("/v1")], model="named", retries=0)
    try:
        with pytest.raises(ServerRefusedError, match="404.*/v1"):
            list(eng.generate(prompts()[:2], GREEDY))
    finally:
        eng.close()


# --- a server that misbehaves: a small real HTTP server in the test ----------------------------------------


def _ok_reply(content: Any = "a fine reply", completion_tokens: int = 3) -> bytes:
    return json.dumps(
        {
            "choices": [{"message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": completion_tokens},
        }
    ).encode()


class _Misbehaving(http.server.BaseHTTPRequestHandler):
    """Answers by the last message's content: "drip" sends its headers, then one body byte every 0.2 s; "huge" a
    valid reply of 3 MB; "overcount" claims more tokens than asked for; "deep" JSON nested past any parser;
    "number" a content that is not a string; anything else a fine reply."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        what = body["messages"][-1]["content"]
        if what == "drip":
            self._headers(10_000)
            try:
                for _ in range(10_000):
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(0.2)
            except OSError:  # the client hung up: done
                return
            return
        reply = {
            "huge": lambda: _ok_reply("word " * 600_000),
            "overcount": lambda: _ok_reply(completion_tokens=999),
            "deep": lambda: b"[" * 200_000 + b"]" * 200_000,
            "number": lambda: _ok_reply(content=12345),
        }
        data = reply.get(what, _ok_reply)()
        self._headers(len(data))
        self.wfile.write(data)

    def _headers(self, length: int) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(length))
        self.end_headers()


@pytest.fixture
def misbehaving() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Misbehaving)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()


def _in_thread(fn: Callable[[], Any], hang_s: float = 60.0) -> Any:
    """fn() on a thread; a hang (far past any deadline the test sets) fails the test instead of blocking it."""
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # handed back to the test
            out["error"] = e

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(hang_s)
    assert not t.is_alive(), f"still running after {hang_s} s: the request has no deadline"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_a_server_dripping_its_reply_is_cut_off_at_the_request_deadline(misbehaving):
    """Headers at once, then a byte every 0.2 s: each read is quick, the request is not; timeout_s bounds the
    whole request, so the engine gives up (as a server that cannot answer now) instead of reading for ~30 min."""
    eng = engine([misbehaving], model="m", timeout_s=1.0, retries=0)
    ps = [Prompt(0, ({"role": "user", "content": "drip"},))]
    try:
        with pytest.raises(ServerUnavailableError, match=r"timed out after 1 s \(regenerate.timeout_s\)"):
            _in_thread(lambda: list(eng.generate(ps, GREEDY)))
    finally:
        eng.close()


def test_a_bad_reply_is_that_rows_error_and_the_others_are_answered(misbehaving):
    """A reply over the size cap, more tokens than max_new_tokens, JSON too deep to parse, a content that is not
    text: each is its own row's error, never the job's end, and the fine rows are answered."""
    kinds = ["huge", "fine", "overcount", "deep", "number", "fine again"]
    ps = [Prompt(i, ({"role": "user", "content": k},)) for i, k in enumerate(kinds)]
    eng = engine([misbehaving], model="m", retries=0, concurrency=2, max_new_tokens=8)
    got = _in_thread(lambda: collect(eng, ps, replace(GREEDY, max_new_tokens=8)))
    assert [got[i].finish_reason for i in range(len(kinds))] == ["error", "stop", "error", "error", "error", "stop"]
    assert "over 1050624 bytes" in got[0].error, got[0].error
    assert "999 completion tokens, over the 8 asked for" in got[2].error, got[2].error
    assert "unreadable answer" in got[3].error and "not a string" in got[4].error, (got[3].error, got[4].error)
    assert got[1].text == got[5].text == "a fine reply"


class _Scripted(http.server.BaseHTTPRequestHandler):
    """Answers every request with the server's `script`: (status, body bytes)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        status, data = self.server.script  # type: ignore[attr-defined]
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
# Where a reply's fields live: each example puts any JSON value at one of them (or replaces the whole body).
REPLY_PATHS = [
    (),
    ("choices",),
    ("choices", 0),
    ("choices", 0, "message"),
    ("choices", 0, "message", "content"),
    ("choices", 0, "message", "reasoning_content"),
    ("choices", 0, "finish_reason"),
    ("usage",),
    ("usage", "prompt_tokens"),
    ("usage", "completion_tokens"),
    ("data",),
    ("data", 0),
    ("data", 0, "id"),
    ("error",),
    ("error", "message"),
]


def _reply_with(path: tuple, value: Any) -> Any:
    body = json.loads(_ok_reply())
    body["data"] = [{"id": "m"}]  # also a /models listing
    body["error"] = {"message": "m"}  # what an error status carries
    if not path:
        return value
    node = body
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return body


@pytest.fixture(scope="module")
def scripted() -> Iterator[http.server.ThreadingHTTPServer]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    status=st.sampled_from([200, 200, 200, 400, 401, 404, 413, 429, 500]),
    path=st.sampled_from(REPLY_PATHS),
    value=JSON,
    raw=st.none() | st.binary(max_size=40),
    ask_model=st.booleans(),
)
def test_any_answer_is_a_reply_or_one_engine_error(scripted, status, path, value, raw, ask_model):
    """Whatever a server answers (any status, any JSON at any field of a reply or a model listing, or bytes that are
    no JSON): the row gets a reply (its text a string, finished by stop or length, else an error that says why),
    or the job stops with one OpenAIEngineError line; never another exception (a traceback in `regenerate`)."""
    scripted.script = (status, raw if raw is not None else json.dumps(_reply_with(path, value)).encode())
    port = scripted.server_address[1]
    eng = engine([f"http://127.0.0.1:{port}/v1"], model="" if ask_model else "m", retries=0, max_new_tokens=8)
    try:
        got = collect(eng, [Prompt(0, ({"role": "user", "content": "q"},))], replace(GREEDY, max_new_tokens=8))
    except OpenAIEngineError as e:
        assert str(e).startswith("openai engine") and "\n" not in str(e), str(e)
        return
    reply = got[0]
    assert isinstance(reply.text, str) and reply.finish_reason in ("stop", "length", "error"), reply
    if reply.finish_reason == "error":
        assert isinstance(reply.error, str) and reply.error and reply.text == "", reply
    else:
        assert 0 <= reply.completion_tokens <= 8 and reply.prompt_tokens >= 0, reply
