"""One data row -> token ids and an assistant-only loss mask, under the target's chat template.

Without `{% generation %}` markers in the template, assistant spans are found by rendering the
whole conversation again with one reply swapped for a dummy: the text that changes is the reply
as the template renders it. Comparing against the rendered prefix of the conversation would break
on templates that rewrite history (Qwen3 drops earlier replies' reasoning and pre-fills an empty
<think> block only in the generation prompt), and searching for role headers is template-specific.
"""

from __future__ import annotations

import _signal  # the C module behind `signal`: see _bounded
import json
import re
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from dflash_ring.common.config.data import DataError

ROLES = ("system", "user", "assistant")
_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Two one-character replies that differ, so one of them differs from any reply's first and last character.
_DUMMIES = ("x", "y")
# The chat every template must render (with generation markers: and mark the reply of) before any row is encoded.
_MINIMAL_CHAT = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}]
# A template writes a row's text with its own around it (role headers, a default system prompt, tool descriptions):
# at most RENDER_FACTOR times the row's characters plus RENDER_SLACK of its own. One that loops over or multiplies
# the content renders far more, and tokenizing that would not end: the row is a bad row before it is tokenized.
RENDER_FACTOR, RENDER_SLACK = 8, 1 << 16
# A template that loops without writing (nested range loops, which jinja's sandbox caps one at a time, or a loop over
# a huge string) renders for hours, and RENDER_FACTOR never sees its output: each render gets at most RENDER_SECONDS
# (`_bounded`). Generous, so that only a template that would not end is refused, even on a loaded host: a real template
# renders a row in well under a millisecond, one at the size bound (producer/data_source.py: 786 KB at the default
# max_length) in tens of milliseconds. Per render, not per row: a row renders once more per assistant turn, and one of
# 1000 turns at that size takes 22 s in all, a row to keep. A module constant, not a setting: no real template comes
# near it, and a template that loops is to be fixed, not waited for.
RENDER_SECONDS = 10.0

_T = TypeVar("_T")


class BadRow(ValueError):
    """A row that cannot become a training sample; its message is the reason shown to the user."""


class _RenderTimeout(BaseException):
    """Raised into a render past RENDER_SECONDS by the SIGALRM handler: a BaseException, so that no `except Exception`
    in jinja's or transformers' code, nor `ChatEncoder._apply`'s, takes it for the template's own error."""


def _alarm(signum: int, frame: object) -> None:
    raise _RenderTimeout(
        f"it did not finish rendering within {RENDER_SECONDS:g} s: a template that loops without output"
    )


def _bounded(render: Callable[[], _T]) -> _T:
    """`render()`, interrupted by _RenderTimeout past RENDER_SECONDS. Jinja compiles a template to Python, so a
    SIGALRM handler that raises stops it between two bytecodes; the itimer repeats every RENDER_SECONDS in case the
    exception is swallowed (raised inside a __del__ or a weakref callback). The SIGALRM handler and ITIMER_REAL found
    are put back after, the itimer less the time the render took, at once if it fell due meanwhile (role_process's,
    which raises a stop again, is late by one render at most); a handler that took SIGALRM over during the render
    (role_process's, on a stop) keeps it and its itimer. Through `_signal`: `signal.signal` and `signal.getsignal` turn
    a handler into an enum by way of a raised ValueError, ~2 us each and most of the cost; with `_signal` the bound
    costs ~1 us a render (a small row renders 5 times in ~550 us: within the noise).

    Only a process's main thread may set a signal handler: on any other thread the render is not bounded. Every
    caller runs on one: the producer's start-up, `data stats`, `tools/draft_vocab.py`, `bench pipeline`, the tiny
    target's build and `check-target` on the CLI's main thread, and `datasets.map` (producer/pretokenized.py `_build`)
    in that thread, or with data.num_proc > 1 on the main thread of each of its worker processes. A caller on another
    thread would hang on such a template as before; it would need to render in a process it can kill instead."""
    previous = _signal.getsignal(signal.SIGALRM)
    if previous is None or threading.current_thread() is not threading.main_thread():
        return render()  # a handler set outside Python cannot be put back; another thread cannot set one
    _signal.signal(signal.SIGALRM, _alarm)
    delay, interval = signal.setitimer(signal.ITIMER_REAL, RENDER_SECONDS, RENDER_SECONDS)
    started = time.monotonic()
    try:
        return render()
    finally:
        try:  # an alarm due as the render returned runs its handler after one of these calls: it did finish
            ours = _signal.getsignal(signal.SIGALRM) is _alarm
            if ours:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _RenderTimeout:
            signal.setitimer(signal.ITIMER_REAL, 0)
            ours = True
        if ours:
            _signal.signal(signal.SIGALRM, previous)
            if delay:
                signal.setitimer(signal.ITIMER_REAL, max(delay - (time.monotonic() - started), 1e-6), interval)


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    """`tokenizer.apply_chat_template(messages, **kwargs)` within RENDER_SECONDS (`_bounded`), for the renders outside
    ChatEncoder (regenerate's prompts, eval's): past it, BadRow naming the template, so one prompt is lost, not the
    run. The template's own errors go through as they are."""
    try:
        return _bounded(lambda: tokenizer.apply_chat_template(messages, **kwargs))
    except _RenderTimeout:
        raise BadRow(
            f"the chat template of {tokenizer.name_or_path} did not finish rendering it within {RENDER_SECONDS:g} s "
            "(a template that loops without output); fix the template or use a tokenizer whose template renders it"
        ) from None


def conversation_of(row: Any, *, reply_required: bool = True) -> list[dict[str, Any]]:
    """Validate a row of either shape (chat `messages`, or `prompt`/`response`) into messages.

    `reply_required=False` also takes prompt-only rows (a `prompt` without `response`, a chat without an
    assistant turn): what `regenerate` answers, where the reply is the target's to write.
    """
    if not isinstance(row, Mapping):
        raise BadRow(f"row is not an object (got {type(row).__name__})")
    messages = row.get("messages")
    if messages is None:
        prompt, response = row.get("prompt"), row.get("response")
        if prompt is None and response is None:
            raise BadRow("no 'messages' and no 'prompt'/'response'")
        turns = [("prompt", "user", prompt)]
        if response is not None or reply_required:
            turns.append(("response", "assistant", response))
        for name, _, value in turns:
            if not isinstance(value, str) or not value.strip():
                raise BadRow(f"'{name}' is not a non-empty string")
        messages = [{"role": role, "content": value} for _, role, value in turns]
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        raise BadRow(f"'messages' is not a list (got {type(messages).__name__})")
    if not messages:
        raise BadRow("empty conversation")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise BadRow(f"message {i} is not an object (got {type(message).__name__})")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise BadRow(f"message {i} has role {role!r}, not one of {ROLES}")
        if not isinstance(content, str):
            raise BadRow(f"message {i} content is not a string (got {type(content).__name__})")
        if role == "assistant" and not content.strip():
            raise BadRow(f"message {i} is an empty assistant reply")
        _check_text(content, i)
        # None-valued keys come from Arrow's union of struct fields; templates treat absent and None alike.
        out.append({k: v for k, v in message.items() if v is not None})
    if reply_required and not any(m["role"] == "assistant" for m in out):
        raise BadRow("no assistant turn")
    return out


def prompt_of(row: Any) -> list[dict[str, Any]]:
    """The chat a reply is generated for: the conversation before its last turn when that is an assistant
    reply, else (a prompt-only row) the whole conversation; either way it must end with a user turn."""
    messages = conversation_of(row, reply_required=False)
    if messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    if not messages or messages[-1]["role"] != "user":
        before = f"a {messages[-1]['role']} turn" if messages else "nothing"
        raise BadRow(f"the reply to regenerate follows {before}, not a user turn")
    return messages


def _check_text(text: str, index: int) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRow(f"message {index} is not valid Unicode ({e.reason})") from e
    if "\ufffd" in text:
        raise BadRow(f"message {index} has undecodable bytes (U+FFFD)")


def eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Every id that ends a reply: the generation config may list several (Qwen3: <|im_end|>, <|endoftext|>)."""
    configured = model.generation_config.eos_token_id
    ids = set(configured if isinstance(configured, list) else [] if configured is None else [configured])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def decode_json_row(text: str) -> Any:
    """One JSON line as its value; whatever the JSON parser refuses is this row's BadRow, never the data set's
    error: a syntax error, nesting deeper than the parser recurses, an integer past Python's digit limit."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRow(f"invalid JSON ({e.msg} at column {e.colno})") from e
    except (ValueError, RecursionError) as e:
        raise BadRow(f"invalid JSON ({_why(e)})") from e


def _why(e: BaseException) -> str:
    """A parser's refusal in a few words: RecursionError's message names Python's stack, not the row's nesting."""
    if isinstance(e, RecursionError):
        return "nested deeper than the JSON parser recurses"
    return " ".join(str(e).split())[:200] or type(e).__name__


class ChatEncoder:
    """Holds the tokenizer and settings; picklable so `datasets.map` can ship it to workers."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_length: int,
        enable_thinking: bool,
        reserved_token: int | None = None,
    ):
        """`reserved_token`: the drafter's mask token when it is a row of the tokenizer's vocabulary (a reserved
        special token, for a target with no unused embedding row): a row that contains it is a bad row, since the
        drafter could not tell that token from its mask."""
        if not tokenizer.is_fast:
            raise DataError("loss masks need character offsets: load the target tokenizer as a fast tokenizer")
        if not tokenizer.chat_template:
            raise DataError(
                f"the target tokenizer {tokenizer.name_or_path} has no chat template: set target.tokenizer to a "
                "tokenizer directory that has one (chat_template in tokenizer_config.json, or chat_template.jinja)"
            )
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.enable_thinking = enable_thinking
        self.reserved_token = reserved_token
        # The template apply_chat_template renders: of a named set (a list in tokenizer_config.json), "default".
        self.uses_generation_markers = bool(_GENERATION_MARKER.search(tokenizer.get_chat_template()))
        if self.uses_generation_markers:
            self._check_markers()
        self.generation_prompt, self.closing = ("", "") if self.uses_generation_markers else self._probe()

    def encode(self, row: Any) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids int32, loss_mask uint8), truncated to max_length; raises BadRow, also for a render past
        RENDER_SECONDS (`_bounded`): a template that loops on some rows' content would otherwise never end."""
        messages = conversation_of(row)
        try:
            return self._encode(messages)
        except _RenderTimeout:
            raise BadRow(
                f"the chat template of {self.tokenizer.name_or_path} did not finish rendering it within "
                f"{RENDER_SECONDS:g} s (a template that loops without output): skipped; fix the template or set "
                "target.tokenizer to a tokenizer directory whose template renders it"
            ) from None

    def _encode(self, messages: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
        text = self._apply(messages, tokenize=False)  # bounded before anything tokenizes it (the marked path too)
        self._check_rendered(messages, text)
        if self.uses_generation_markers:
            out = self._apply(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            ids = np.asarray(out["input_ids"], dtype=np.int32)
            mask = np.asarray(out["assistant_masks"], dtype=np.uint8)
        else:
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids = np.asarray(enc["input_ids"], dtype=np.int32)
            mask = _mask_spans(
                np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2), self._spans(messages, text)
            )
        ids, mask = ids[: self.max_length], mask[: self.max_length]
        if not mask.any():
            raise BadRow(f"no assistant token within max_length={self.max_length}")
        if self.reserved_token is not None and (ids == self.reserved_token).any():
            raise BadRow(
                f"contains token {self.reserved_token} "
                f"({self.tokenizer.convert_ids_to_tokens(self.reserved_token)!r}), the drafter's mask token"
            )
        return ids, mask

    def _check_rendered(self, messages: list[dict[str, Any]], text: str) -> None:
        """BadRow, naming the template, when it rendered the row past RENDER_FACTOR times its characters plus
        RENDER_SLACK: a template that loops over or multiplies the content, whose tokenizing would not end."""
        own = sum(len(str(v)) for m in messages for v in m.values())
        if len(text) > RENDER_FACTOR * own + RENDER_SLACK:
            raise BadRow(
                f"the chat template of {self.tokenizer.name_or_path} renders it as {len(text)} characters from its "
                f"{own}, past {RENDER_FACTOR} times those plus {RENDER_SLACK} (a template that loops over or "
                "multiplies the content): skipped before tokenizing"
            )

    def _apply(self, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
        """One render, bounded (`_bounded`: _RenderTimeout goes through to the caller, which says what it means)."""
        try:
            return _bounded(
                lambda: self.tokenizer.apply_chat_template(messages, enable_thinking=self.enable_thinking, **kwargs)
            )
        except Exception as e:  # templates raise anything (jinja errors, raise_exception(...)); only this row is lost
            raise BadRow(f"chat template failed: {type(e).__name__}: {e}") from e

    def _spans(self, messages: list[dict[str, Any]], text: str) -> list[tuple[int, int]]:
        """Character spans of assistant turns in `text`: generation-prompt end to reply end plus its closing."""
        spans: list[tuple[int, int]] = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            renders = [self._apply(_with_content(messages, k, d), tokenize=False) for d in _DUMMIES]
            start = min(_common_prefix(text, r) for r in renders)
            end = len(text) - min(_common_suffix(text, r) for r in renders)
            if k > 0 and self.generation_prompt:
                # Extend back over what the model writes before the reply itself (Qwen3 with thinking on:
                # the <think> block), up to where the generation prompt ends. Only when the text before
                # this turn renders the same on its own: a template that rewrites history (Qwen3 renders
                # a final reply differently) would otherwise pull earlier turns into the span.
                prompt = self._apply(messages[:k], tokenize=False, add_generation_prompt=True)
                shared = _common_prefix(text, prompt)
                if shared >= len(prompt) - len(self.generation_prompt):
                    start = min(start, shared)
            end += _common_prefix(self.closing, text[end:])
            if start >= end or (spans and start < spans[-1][1]):
                raise BadRow(f"cannot locate assistant message {k} in the rendered conversation")
            spans.append((start, end))
        return spans

    def _check_markers(self) -> None:
        """A template with `{% generation %}` markers renders a minimal chat and marks its reply: one that does not
        parse, or whose markers mark nothing, would skip every row of every data set, each as a bad row."""
        try:
            out = self._apply(_MINIMAL_CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        except (BadRow, _RenderTimeout) as e:
            raise _unusable(self.tokenizer, str(e)) from e
        if not any(out["assistant_masks"]):
            raise _unusable(self.tokenizer, "its {% generation %} markers mark no token of the reply")

    def _probe(self) -> tuple[str, str]:
        """The generation prompt, and what the template writes right after a reply (ChatML:
        '<|im_end|>\\n'), read off a minimal chat."""
        user = _MINIMAL_CHAT[:1]
        try:
            asked = self._apply(user, tokenize=False)
            prompted = self._apply(user, tokenize=False, add_generation_prompt=True)
            replies = [self._apply(user + [{"role": "assistant", "content": d}], tokenize=False) for d in _DUMMIES]
        except (BadRow, _RenderTimeout) as e:
            raise _unusable(self.tokenizer, str(e)) from e
        generation_prompt = prompted[len(asked) :] if prompted.startswith(asked) else ""
        n = _common_suffix(*replies)
        return generation_prompt, replies[0][len(replies[0]) - n :]


def _unusable(tokenizer: PreTrainedTokenizerBase, why: str) -> DataError:
    return DataError(
        f"the chat template of {tokenizer.name_or_path} cannot render a minimal user/assistant chat "
        f"({why}); fix the template or set target.tokenizer to a tokenizer directory whose template works"
    )


def _with_content(messages: list[dict[str, Any]], k: int, content: str) -> list[dict[str, Any]]:
    return [{**m, "content": content} if i == k else m for i, m in enumerate(messages)]


def _mask_spans(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for tokens overlapping a span (the rule HF uses for generation markers)."""
    starts = offsets[:, 0]
    # Zero-width offsets (possible with trimmed offsets) count as one character at their start.
    ends = np.maximum(offsets[:, 1], starts + 1)
    mask = np.zeros(len(offsets), dtype=np.uint8)
    for s, e in spans:
        mask[(starts < e) & (ends > s)] = 1
    return mask


def _common_prefix(a: str, b: str) -> int:
    """Length of the common prefix; binary search over C-level slice compares, not a Python loop."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix(a: str, b: str) -> int:
    return _common_prefix(a[::-1], b[::-1])


def template_token_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The ids a minimal chat renders to (with its generation prompt): the template's own tokens, which every row
    contains, so none of them can be a mask token. A template that does not render it within RENDER_SECONDS is refused
    here (DataError), as ChatEncoder's probe would refuse it, rather than after each of these renders' bound."""
    ids: set[int] = set()
    for add in (False, True):
        try:
            rendered = _bounded(
                lambda add=add: tokenizer.apply_chat_template(
                    _MINIMAL_CHAT if not add else _MINIMAL_CHAT[:1],
                    tokenize=True,
                    add_generation_prompt=add,
                    return_dict=True,
                )
            )
        except _RenderTimeout as e:
            raise _unusable(tokenizer, str(e)) from None
        except Exception:  # a template that cannot render fails the data set with its own line (ChatEncoder)
            continue
        ids.update(int(i) for i in rendered["input_ids"])
    return ids


def mask_token_candidates(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> list[tuple[int, str]]:
    """Rows a drafter's mask token may take, best first: the first embedding row no token uses (Qwen3's 151669),
    else the tokenizer's special tokens that are neither BOS, EOS, PAD nor UNK nor rendered by the chat template
    (SmolLM2's `<empty_output>`, 16): tokens ordinary text never holds, and a row that does hold one is skipped."""
    if len(tokenizer) < vocab_size:
        return [(len(tokenizer), "<unused row>")]
    taken = template_token_ids(tokenizer)
    taken.update(
        i
        for i in (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id)
        if i is not None
    )
    special = sorted(
        {int(i) for i, t in tokenizer.added_tokens_decoder.items() if t.special and int(i) < vocab_size} - taken
    )
    return [(i, tokenizer.convert_ids_to_tokens(i)) for i in reversed(special)]


def mask_token_refusal(tokenizer: PreTrainedTokenizerBase, mask_token_id: int, vocab_size: int) -> str | None:
    """Why `mask_token_id` cannot be the drafter's mask for this tokenizer, or None. An unused row, or a special
    token that is not BOS/EOS/PAD/UNK and not the template's, may be; an ordinary token may not: rows holding it
    would all be skipped, and a template token is in every row."""
    if mask_token_id >= len(tokenizer) or any(
        mask_token_id == i for i, _ in mask_token_candidates(tokenizer, vocab_size)
    ):
        return None
    candidates = mask_token_candidates(tokenizer, vocab_size)
    named = ", ".join(f"{i} ({t})" for i, t in candidates[:4]) or "none: give the target an unused embedding row"
    token = tokenizer.convert_ids_to_tokens(mask_token_id)
    return (
        f"mask token {mask_token_id} ({token!r}) is a token the data or the chat template uses, so the drafter could "
        f"not tell it from its mask: set target.mask_token_id to an unused embedding row or a reserved special token "
        f"the data never contains (candidates: {named})"
    )
