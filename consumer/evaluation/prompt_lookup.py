"""Prompt lookup decoding (n-gram drafting): the training-free baseline a trained drafter has to beat.

Saxena's prompt lookup decoding (PLD), transformers' `prompt_lookup_num_tokens`: the drafts are whatever followed
the sequence's current ending the last time it occurred. Take the longest suffix n-gram of the committed tokens
(n = max_ngram down to 1) that occurred earlier, and propose the up-to-K tokens that followed its last earlier
occurrence; no match, no drafts (the round is then a plain target step). It costs no model at all, which is why a
drafter's tau is worth reporting next to it: on inputs that repeat themselves (code edits, extraction, quoting the
prompt) it is hard to beat, on open-ended chat it gains little.

The last occurrence, not the first as transformers' candidate generator takes: the most recent context is the
likeliest to continue the same way (a reply that repeats a list goes on from where it repeated it last).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

# Drafts per round without a drafter to match (the PLD reference implementation's num_pred_tokens).
DEFAULT_LOOKUP_TOKENS = 10
DEFAULT_LOOKUP_NGRAM = 3  # the PLD paper's and transformers' max_matching_ngram_size default


def prompt_lookup(tokens: Sequence[int] | np.ndarray, *, max_ngram: int, max_tokens: int) -> list[int]:
    """The up-to-`max_tokens` tokens that followed the last earlier occurrence of the longest suffix n-gram of
    `tokens` (n from `max_ngram` down to 1), [] when no suffix n-gram occurred before.

    An occurrence must be followed by at least one token, which rules out the suffix itself; it may overlap the
    suffix (in "a b a b a", the 3-gram "a b a" at 0 is followed by "b a"). The continuation stops at the end of
    `tokens`, so it can be shorter than `max_tokens`."""
    if max_ngram < 1 or max_tokens < 1:
        raise ValueError(f"max_ngram and max_tokens must be at least 1, got {max_ngram} and {max_tokens}")
    ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
    length = ids.shape[0]
    for n in range(min(max_ngram, length - 1), 0, -1):
        # Windows starting at 0 .. length - n - 1: each has a token after it (the suffix's own window is left out).
        windows = sliding_window_view(ids[:-1], n)
        found = np.flatnonzero((windows == ids[-n:]).all(axis=1))
        if found.size:
            start = int(found[-1]) + n
            return ids[start : start + max_tokens].tolist()
    return []
