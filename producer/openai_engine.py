"""The `openai` engine of `dflash-ring regenerate`: replies from any OpenAI-compatible server.

vLLM, SGLang and `transformers serve` all answer POST `{base_url}/chat/completions`; this engine
sends one non-streaming request per prompt (`n` = 1) from a bounded thread pool, so at most
`regenerate.concurrency` requests are in flight, spread round-robin over `regenerate.base_urls`.
Standard library only (http.client, concurrent.futures, json): one blocking request per worker thread
is all a batch job needs, and the CLI stays free of an HTTP client dependency. The `openai` client was tried
in its place (2026-12-05) and kept out: it has retries and backoff, but no whole-request deadline (its timeout
is per read, so a server trickling bytes holds a worker for ever) and no cap on a reply body, it has no failover
across several base URLs (what spreads a job over servers here), and it reads OPENAI_API_KEY / OPENAI_BASE_URL
from the environment (a key meant for another endpoint would be sent to ours); wrapped to add those, the engine
grew from 437 to 468 lines.

Each request carries the model, the chat, `max_tokens`, `temperature`, `top_p`, a per-prompt
`seed` (`prompt_seed`, so a resumed run samples the same) and `chat_template_kwargs:
{"enable_thinking": ...}`, which vLLM, SGLang and `transformers serve` pass to the chat template
(templates without the switch ignore it; `transformers serve` refuses unknown top-level fields
with 422 but takes this one).

Servers differ (checked against `transformers serve` of transformers 5.24, the one the tests run):
- `transformers serve` generates one request at a time, sets `seed` with a process-wide
  `torch.manual_seed` (so with several requests in flight the seeds may interleave: sampled replies
  are then not reproducible row by row, greedy ones are), and samples only when the model's
  generation_config.json says `do_sample: true` (Qwen3's does; otherwise a temperature > 0 is
  ignored and replies are greedy). vLLM and SGLang seed each request on its own.
- A server with a reasoning parser (vLLM `--reasoning-parser`) returns the thinking apart from the
  reply; this engine refuses that (one clear error) rather than guess how to join them: run the
  server without one, so replies come back as the target wrote them.
- `max_tokens` is sent (vLLM, SGLang and `transformers serve` take it; `max_completion_tokens` is
  the newer OpenAI name for the same bound).

Failures, in three kinds:
- Unreachable or unavailable server: a connection error, a timeout (`timeout_s`), 408, 429, 502,
  503 or 504. That server is put aside for a while (exponential, capped at `backoff_cap_s`) and
  the request fails over at once to the next URL; once every URL failed in a round, the request
  waits 1 s, 2 s, 4 s, ... (capped at 30 s) and tries again, `retries` times. If it still fails,
  `ServerUnavailableError` (an `OpenAIEngineError`, a RuntimeError: the CLI prints one line and
  exits 2) names the URLs
  and the last failure: the job stops instead of writing a data set of errors.
- A server error about this request (any other 5xx): retried the same way, then the row gets an
  error Reply with the server's text: the server is up, only this row fails.
- Refused for every row (401, 403, 404: a wrong key, URL path or model): `ServerRefusedError`, the
  job stops; finished shards stay and a corrected command goes on from there.
- Refused for this row (any other 4xx: a prompt over the context length; `transformers serve`'s
  400 for another model name): not retried; an error Reply with the server's text.
"""

from __future__ import annotations

import http.client
import itertools
import json
import logging
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from dflash_ring.common.config.regenerate import RegenerateConfig, RegenerateConfigError

from .generation import GenerationSettings, Prompt, Reply, prompt_seed

log = logging.getLogger(__name__)

# Statuses that say the server (not the request) cannot answer now: retried, then fatal.
UNAVAILABLE_STATUSES = frozenset({408, 429, 502, 503, 504})
REFUSING_STATUSES = frozenset({401, 403, 404})  # the key, the URL or the model: wrong for every row
_ERROR_TEXT_CHARS = 500  # of a server's error body kept in a Reply
# The cap on a reply's body: a token is rarely over 16 characters, each at most 12 bytes as JSON escapes, and
# the rest of an OpenAI reply (ids, usage, the echoed model name) is well under 1 MiB.
_REPLY_BASE_BYTES, _REPLY_BYTES_PER_TOKEN = 1 << 20, 256


class OpenAIEngineError(RuntimeError):
    """The job cannot go on with these servers (a RuntimeError: the CLI prints it on one line, exit 2)."""


class ServerUnavailableError(OpenAIEngineError):
    """No server answered after every retry: the URLs tried and the last failure."""


class ServerRefusedError(OpenAIEngineError):
    """401, 403 or 404 on a chat request: a wrong key, URL or model refuses every row alike, so the job stops
    rather than record each row as an error (a finished shard is never asked again)."""


class EngineClosedError(OpenAIEngineError):
    """The engine was closed while requests were still waiting to be retried."""


@dataclass(frozen=True)
class _Failure:
    """The server could not answer now (unreachable, timed out, overloaded): fatal once retries are spent."""

    url: str
    what: str  # one line: "cannot connect: ...", "HTTP 503: ...", "timed out after 5 s ..."


@dataclass(frozen=True)
class _Answer:
    status: int
    body: Any  # the parsed JSON, or the raw text when the body is not JSON
    url: str


class _Servers:
    """Round-robin over the base URLs, putting aside for a while those that just failed."""

    def __init__(self, urls: Sequence[str], base_delay_s: float, cap_s: float):
        self.urls = list(urls)
        self._base, self._cap = base_delay_s, cap_s
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self._failures = [0] * len(self.urls)
        self._aside_until = [0.0] * len(self.urls)

    def order(self) -> list[int]:
        """Every server once, starting at the next in turn; those put aside go last, soonest back first."""
        n = len(self.urls)
        start = next(self._turn) % n
        rotated = [(start + k) % n for k in range(n)]
        now = time.monotonic()
        with self._lock:
            aside = dict(enumerate(self._aside_until))
        return sorted(rotated, key=lambda i: (aside[i] > now, aside[i] if aside[i] > now else 0.0))

    def failed(self, i: int) -> None:
        with self._lock:
            self._failures[i] += 1
            self._aside_until[i] = time.monotonic() + backoff_delay(self._failures[i] - 1, self._base, self._cap)

    def answered(self, i: int) -> None:
        with self._lock:
            self._failures[i] = 0
            self._aside_until[i] = 0.0


def backoff_delay(attempt: int, base_s: float, cap_s: float) -> float:
    """Wait before retry `attempt` (0-based): base, 2 base, 4 base, ... capped."""
    return min(cap_s, base_s * (2 ** min(attempt, 62)))


class OpenAIEngine:
    """`Engine` over OpenAI-compatible servers; `backoff_base_s`/`backoff_cap_s` are there for tests."""

    def __init__(self, cfg: RegenerateConfig, *, backoff_base_s: float = 1.0, backoff_cap_s: float = 30.0):
        if not cfg.base_urls:
            raise RegenerateConfigError(
                "regenerate.base_urls is empty: the openai engine needs at least one server, "
                'e.g. base_urls = ["http://127.0.0.1:8000/v1"]'
            )
        self.cfg = cfg
        self.base_urls = [url.rstrip("/") for url in cfg.base_urls]
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if cfg.api_key_env:
            key = os.environ.get(cfg.api_key_env, "")
            if not key:
                raise RegenerateConfigError(
                    f"regenerate.api_key_env = {cfg.api_key_env!r}, but that environment variable is not set "
                    "(or empty): set it, or leave api_key_env empty for a server without a key"
                )
            self._headers["Authorization"] = f"Bearer {key}"
        self._backoff = (backoff_base_s, backoff_cap_s)
        self._servers = _Servers(self.base_urls, backoff_base_s, backoff_cap_s)
        self._model = cfg.model
        self._model_lock = threading.Lock()
        self._closed = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=cfg.concurrency, thread_name_prefix="openai-engine")
        # A reply's body may hold this much: JSON around max_new_tokens tokens of (escaped) text, with room to spare.
        self._max_new_tokens = cfg.max_new_tokens
        self._reply_cap = _REPLY_BASE_BYTES + _REPLY_BYTES_PER_TOKEN * cfg.max_new_tokens

    # --- Engine ---------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Prompt], settings: GenerationSettings) -> Iterator[Reply]:
        """One Reply per prompt as each arrives, at most `concurrency` requests in flight."""
        if not prompts:
            return
        model = self.model()
        pending = iter(prompts)
        in_flight: set[Future] = set()
        try:
            for prompt in itertools.islice(pending, self.cfg.concurrency):
                in_flight.add(self._pool.submit(self._reply, model, prompt, settings))
            while in_flight:
                done, in_flight = wait(in_flight, return_when=FIRST_COMPLETED)
                for future in done:
                    reply = future.result()  # ServerUnavailableError ends the job here
                    for prompt in itertools.islice(pending, 1):
                        in_flight.add(self._pool.submit(self._reply, model, prompt, settings))
                    yield reply
        finally:
            for future in in_flight:  # an error, or the caller stopped reading: leave the rest
                future.cancel()

    def close(self) -> None:
        """Stop: no new request starts and waiting retries end; requests on the wire finish on their own."""
        self._closed.set()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> OpenAIEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the model -------------------------------------------------------------------------------

    def model(self) -> str:
        """`regenerate.model`, or when empty the first model the servers list (asked once)."""
        with self._model_lock:
            if not self._model:
                answer = self._call("GET", "/models", None)
                if answer.status != 200:
                    what = (
                        answer.body if answer.status == _TOO_LARGE else f"HTTP {answer.status}: {_snippet(answer.body)}"
                    )
                    raise OpenAIEngineError(f"openai engine: GET {answer.url}/models answered {what}")
                models = answer.body.get("data") if isinstance(answer.body, dict) else None
                if not (isinstance(models, list) and models and isinstance(models[0], dict) and "id" in models[0]):
                    raise OpenAIEngineError(
                        f"openai engine: GET {answer.url}/models lists no model ({_snippet(answer.body)}): "
                        "set regenerate.model"
                    )
                self._model = str(models[0]["id"])
                log.info("openai engine: using model %s, the first that %s lists", self._model, answer.url)
            return self._model

    # --- one prompt ------------------------------------------------------------------------------

    def request_body(self, model: str, prompt: Prompt, settings: GenerationSettings) -> dict[str, Any]:
        return {
            "model": model,
            "messages": [dict(m) for m in prompt.messages],
            "max_tokens": settings.max_new_tokens,
            "temperature": settings.temperature,
            "top_p": settings.top_p,
            "seed": prompt_seed(settings.seed, prompt.index),
            "n": 1,
            "stream": False,
            "chat_template_kwargs": {"enable_thinking": settings.enable_thinking},
        }

    def _reply(self, model: str, prompt: Prompt, settings: GenerationSettings) -> Reply:
        answer = self._call("POST", "/chat/completions", self.request_body(model, prompt, settings))
        if answer.status in REFUSING_STATUSES:
            raise ServerRefusedError(
                f"openai engine: HTTP {answer.status} from {answer.url}/chat/completions: {_snippet(answer.body)}; "
                "every request would be refused alike: check regenerate.api_key_env (401/403), the base URL "
                "(it ends with /v1) and regenerate.model (404)"
            )
        if answer.status == _TOO_LARGE:
            return _error(prompt, f"{answer.url} sent {answer.body}")
        if answer.status != 200:
            return _error(prompt, f"HTTP {answer.status} from {answer.url}: {_snippet(answer.body)}")
        try:
            choice = answer.body["choices"][0]
            message = choice["message"]
            text = message.get("content") or ""
            reasoning = message.get("reasoning_content") or message.get("reasoning")
            usage = answer.body.get("usage") or {}
            prompt_tokens, completion_tokens = (
                int(usage.get("prompt_tokens", 0)),
                int(usage.get("completion_tokens", 0)),
            )
            finish = choice.get("finish_reason")
            _check_reply(text, prompt_tokens, completion_tokens, settings.max_new_tokens)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError, OverflowError) as e:
            return _error(
                prompt, f"unreadable answer from {answer.url} ({type(e).__name__}: {e}): {_snippet(answer.body)}"
            )
        if reasoning:
            # The server split the reply (a reasoning parser): what the model wrote cannot be put back exactly.
            raise OpenAIEngineError(
                f"openai engine: {answer.url} returns the reasoning apart from the reply (a reasoning parser is on): "
                "start the server without one, so replies come back exactly as the target wrote them"
            )
        if finish not in ("stop", "length"):
            return Reply(
                prompt.index,
                "",
                "error",
                prompt_tokens,
                completion_tokens,
                error=f"{answer.url} finished with {finish!r}, not 'stop' or 'length'",
            )
        return Reply(prompt.index, text, finish, prompt_tokens, completion_tokens)

    # --- HTTP with failover and retries -----------------------------------------------------------

    def _call(self, method: str, path: str, body: dict[str, Any] | None) -> _Answer:
        """The first answer that is not a failure, trying every server each round, `retries` rounds after
        the first with backoff between them. An unavailable server at the end raises; a request-level
        5xx at the end is returned as it is."""
        last: _Failure | _Answer | None = None
        data = None if body is None else json.dumps(body).encode()
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                delay = backoff_delay(attempt - 1, *self._backoff)
                if self._closed.wait(delay):
                    raise EngineClosedError("openai engine closed while a request waited to be retried")
            for i in self._servers.order():
                if self._closed.is_set():
                    raise EngineClosedError("openai engine closed")
                url = self._servers.urls[i]
                got = self._send(method, url, path, data)
                if isinstance(got, _Answer) and got.status < 500 and got.status not in UNAVAILABLE_STATUSES:
                    self._servers.answered(i)
                    return got
                if isinstance(got, _Answer):  # a 5xx about this request: the server is up, try elsewhere
                    self._servers.answered(i)
                    last = got
                    continue
                self._servers.failed(i)
                last = got
                log.debug("openai engine: %s%s failed (%s)", url, path, got.what)
        if isinstance(last, _Answer):
            return last
        assert last is not None
        raise ServerUnavailableError(
            f"openai engine: no server answered {method} {path} after {self.cfg.retries + 1} rounds "
            f"(regenerate.retries = {self.cfg.retries}) over {', '.join(self.base_urls)}; "
            f"last failure: {last.url}{path}: {last.what}"
        )

    def _send(self, method: str, url: str, path: str, data: bytes | None) -> _Answer | _Failure:
        """One request, bounded as a whole: `timeout_s` from connect to the last byte (a server dripping its reply
        a byte at a time is cut off at the deadline, not timed per read) and `_reply_cap` bytes of body."""
        target = urllib.parse.urlsplit(url + path)
        kind = http.client.HTTPSConnection if target.scheme == "https" else http.client.HTTPConnection
        conn = kind(target.hostname, target.port, timeout=self.cfg.timeout_s)
        # At the deadline the socket is shut down, which ends whatever read is waiting on it.
        deadline = threading.Timer(self.cfg.timeout_s, _shut, (conn,))
        deadline.daemon = True
        started = time.monotonic()
        deadline.start()
        try:
            conn.request(
                method, target.path + (f"?{target.query}" if target.query else ""), body=data, headers=self._headers
            )
            response = conn.getresponse()
            raw = _read_capped(response, self._reply_cap)
            status = response.status
        except (OSError, http.client.HTTPException) as e:  # refused, reset, closed mid-answer, a bad status line
            if time.monotonic() - started >= self.cfg.timeout_s or isinstance(e, (TimeoutError, socket.timeout)):
                return _Failure(url, f"timed out after {self.cfg.timeout_s:g} s (regenerate.timeout_s)")
            if isinstance(e, ConnectionRefusedError) or (isinstance(e, OSError) and not response_started(conn)):
                return _Failure(url, f"cannot connect: {e}")
            return _Failure(url, f"{type(e).__name__}: {e}")
        except _TooLarge:
            return _Answer(
                _TOO_LARGE,
                f"a reply over {self._reply_cap} bytes (the cap for regenerate.max_new_tokens "
                f"= {self._max_new_tokens}), not read further",
                url,
            )
        finally:
            deadline.cancel()
            conn.close()
        if status in UNAVAILABLE_STATUSES:
            return _Failure(url, f"HTTP {status}: {_snippet(_parse(raw))}")
        return _Answer(status, _parse(raw), url)


class _TooLarge(Exception):
    """A reply body over the cap: read no further."""


_TOO_LARGE = 0  # the _Answer status of a reply cut off at the cap: that row's error, not retried


def _read_capped(response: http.client.HTTPResponse, cap: int) -> bytes:
    """The body, refused once it passes `cap` bytes (whatever Content-Length says)."""
    chunks, size = [], 0
    while chunk := response.read(min(1 << 16, cap + 1 - size)):
        chunks.append(chunk)
        size += len(chunk)
        if size > cap:
            raise _TooLarge
    if response.length:  # read(n) returns short, not an error, when the socket ends early (or was shut down)
        raise http.client.IncompleteRead(b"".join(chunks), response.length)
    return b"".join(chunks)


def response_started(conn: http.client.HTTPConnection) -> bool:
    """Whether the connection got as far as a socket (an error before one is a failure to connect)."""
    return conn.sock is not None


def _shut(conn: http.client.HTTPConnection) -> None:
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _check_reply(text: Any, prompt_tokens: int, completion_tokens: int, max_new_tokens: int) -> None:
    """A reply's fields as the request bounds them; ValueError (that row's error) otherwise."""
    if not isinstance(text, str):
        raise ValueError(f"the reply's content is a {type(text).__name__}, not a string")
    if prompt_tokens < 0 or completion_tokens < 0:
        raise ValueError(f"negative token counts (prompt {prompt_tokens}, completion {completion_tokens})")
    if completion_tokens > max_new_tokens:
        raise ValueError(
            f"{completion_tokens} completion tokens, over the {max_new_tokens} asked for (regenerate.max_new_tokens)"
        )


def _parse(raw: bytes) -> Any:
    text = raw.decode("utf-8", errors="replace")
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested too deep to parse: the text as it came
        return text


def _snippet(body: Any) -> str:
    """The server's own words about an error: OpenAI's error.message, vLLM's message, FastAPI's detail."""
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            body = error["message"]
        elif isinstance(error, str) and error:
            body = error
        elif body.get("message"):
            body = body["message"]
        elif "detail" in body:
            body = body["detail"]
    text = body if isinstance(body, str) else json.dumps(body)
    text = " ".join(text.split())
    return text[:_ERROR_TEXT_CHARS] + ("..." if len(text) > _ERROR_TEXT_CHARS else "") or "(empty body)"


def _error(prompt: Prompt, why: str) -> Reply:
    return Reply(prompt.index, "", "error", 0, 0, error=why)
