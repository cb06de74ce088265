"""Offline acceptance eval: speculative decoding with a DFlash, DSpark or DFlash2 drafter against its target.

Follows z-lab's `dflash_generate` (dflash.md section 5): the target prefills the prompt and gives
the first token; each round the drafter proposes tokens after the last committed one (a DFlash
block of B proposes B - 1, a DSpark block B: its anchor slot drafts too), the target checks the
whole block in one forward, a prefix of the drafts is accepted and one token of the target's own is
added (at the first rejection, or as a bonus after the last draft). What is drafted only changes how
many tokens each target forward yields, which is what tau measures, never the output:

- greedy (temperature 0, the default): drafts are argmaxes, the matching prefix is accepted and the
  target's argmax follows; the output is exactly the target's greedy decode;
- sampling at temperature T > 0: drafts are sampled from the drafter's distribution q_k at T and
  verified by speculative sampling (Leviathan et al. 2023; Chen et al. 2023): draft x_k is accepted
  with probability min(1, p_k(x_k) / q_k(x_k)), p_k the target's distribution at T; at the first
  rejection the target's token is sampled from norm(max(p_k - q_k, 0)), after the last draft from
  p. The output is then distributed exactly as sampling from the target alone at T.

A DSpark drafter (DSparkDraftModel) drafts in two stages: one backbone forward per block gives every
slot's hidden state, then B cheap Markov steps left to right: slot k's logits are the backbone's plus
the Markov bias of the token before it (the anchor for slot 0, else the token drafted at slot k - 1),
so q_k is conditioned on the drafted prefix. Its confidence head's cumulative product is scored
against the rounds' acceptance (consumer/evaluation/calibration.py).

A DFlash2 drafter (DFlash2DraftModel) drafts through its candidate selector, as z-lab's `propose` does: one
backbone forward gives slots 1..B-1 their hidden states and logits (the target's head); each slot's candidates are
the K tokens of largest logit, scored with the token before it (the anchor for slot 1, else the candidate chosen
at the slot before), and the path walks the block from the anchor: the scores' argmax when greedy, else a sample of
q_k = softmax(scores_k / T) over the K candidates. That q_k, zero outside the candidates, is what the sampled
verification divides by, so the output is again exactly the target's (greedy) or distributed as it (T > 0).

Tree verification (`tree_speculative_generate`, DDTree) spends a node budget on a best-first tree of the
drafter's likeliest paths instead of one chain (draft_tree.py) and accepts the longest path the target's
greedy decode follows; the eval reports its tau per budget next to the chain's, on the same prompts
(greedy, DFlash drafters: a DSpark or DFlash2 drafter's slots depend on the drafted prefix, which a tree of
independent slots would drop).

Baselines put the drafter's tau in context, decoded on the same prompts by the same target and the same lossless
verification (so only the drafts differ): `untrained`, the export's own architecture and config with freshly
initialised weights (what training bought), and `prompt-lookup`, n-gram drafting from the sequence itself
(prompt_lookup.py: what a drafter must beat to be worth serving). A prompt-lookup draft is a point mass, so at T > 0
speculative sampling accepts it with probability p(x) and resamples from p without x at a rejection: `verify_sampled`
with one-hot q.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from statistics import fmean

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from dflash_ring.common.bounded_read import PROMPTS_BYTES, read_text
from dflash_ring.common.chat_encoding import BadRow, decode_json_row, eos_ids, prompt_of, render_chat
from dflash_ring.common.host_bounds import check_memory
from dflash_ring.common.target_loading import load_target_hf_config, load_target_lm
from dflash_ring.common.tokenizer_loading import check_token_ids, load_target_tokenizer
from dflash_ring.common.refusal import Refusal

from dflash_ring.consumer.evaluation.calibration import ConfidenceCalibration, confidence_calibration
from dflash_ring.consumer.evaluation.draft_tree import (
    build_draft_tree,
    check_tree_target,
    follow_greedy,
    keep_path,
    tree_attention_mask,
)
from dflash_ring.consumer.layouts.export import load_drafter
from dflash_ring.consumer.modeling.head_loader import load_target_head
from dflash_ring.consumer.modeling.draft import Draft, DraftFn, sample_tokens
from dflash_ring.consumer.families import family_of
from dflash_ring.consumer.modeling.model import DFlashDraftModel, FrozenTargetHead
from dflash_ring.consumer.evaluation.prompt_lookup import DEFAULT_LOOKUP_NGRAM, DEFAULT_LOOKUP_TOKENS, prompt_lookup

log = logging.getLogger(__name__)

BASELINES = ("untrained", "prompt-lookup")  # what `--baseline` decodes beside the drafter (cli.py lists them too)
# The seed an untrained baseline's weights are drawn with: `make run`'s untrained row draws them after
# torch.manual_seed(0) (tools/launcher.py `_compare`), so the two rows are the same drafter.
UNTRAINED_SEED = 0
# The most drafts a prompt-lookup round may propose: each round verifies them in one target forward (at T > 0 with a
# [K, vocab] one-hot q); the PLD default is 10 and drafters' blocks are 16, so this only stops a typo.
MAX_LOOKUP_TOKENS = 256


class EvalRefusal(Refusal, ValueError):
    """An input evaluate_drafter refuses: a tree budget or temperature out of range, tree verification of a drafter
    or at a temperature it does not apply to, a drafter of another target, a malformed row of the data file, an
    unknown baseline or no drafter where one is needed. The
    user's, so one line at the CLI (exit 2); the decoders' checks of what a draft or distribution function returned
    stay plain ValueErrors: those are bugs, shown with their traceback."""


DistributionFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""As DraftFn, but -> [B - 1, V] log-probabilities of block positions 1..B-1 (what a draft tree is built from)."""


@dataclass(frozen=True)
class Generation:
    tokens: list[int]  # generated ids, prompt excluded; ends with EOS if one was produced
    accepted: list[int]  # drafts accepted in each verification round, each in 0..n (n drafts per round)
    confidence: list[list[float]] = field(default_factory=list)  # per round, its drafts' confidence logits (DSpark)


@dataclass(frozen=True)
class TreeAcceptance:
    """Tree verification at one node budget, on the same prompts as the chain figures beside it."""

    budget: int  # draft nodes per round; the root (the last committed token) is not counted
    tau: float  # as the chain's: per prompt mean(accepted + 1) over rounds, averaged over prompts
    tau_per_prompt: list[float | None]
    accepted_histogram: list[int]  # [B]: rounds whose accepted path had k drafts (its depth), k = 0..B-1
    rounds: int
    tokens_generated: int
    # Prompts whose tokens equal the chain's: all of them in exact arithmetic (both are the greedy
    # decode); in low precision the two forwards' rounding differs, so a near-tie may resolve otherwise.
    same_tokens_as_chain: int


@dataclass(frozen=True)
class BaselineAcceptance:
    """A baseline's chain verification beside the report's drafter: the same prompts, target, temperature, per-prompt
    seeds and verification, so what differs in tau is the drafts alone."""

    name: str  # one of BASELINES: "untrained" or "prompt-lookup"
    drafts_per_round: int  # prompt lookup: at most this many (fewer where the continuation ends, none without a match)
    tau: float  # as the chain's: per prompt mean(accepted + 1) over rounds, averaged over prompts
    tau_per_prompt: list[float | None]
    accepted_histogram: list[int]  # [drafts_per_round + 1]: rounds that accepted k drafts
    rounds: int
    tokens_generated: int
    # Greedy: prompts whose tokens equal the drafter's chain (all of them, but for low-precision near-ties: both are
    # the target's greedy decode). None when sampled: other drafts draw other random numbers.
    same_tokens_as_chain: int | None
    init_seed: int | None = None  # untrained: the seed its weights were drawn with
    lookup_ngram: int | None = None  # prompt lookup: the longest suffix n-gram it matches


@dataclass(frozen=True)
class AcceptanceReport:
    block_size: int
    drafts_per_round: int  # n: B - 1 for a DFlash drafter, B for a DSpark drafter (its anchor slot drafts too)
    num_prompts: int
    tau: float  # mean acceptance length: per prompt mean(accepted + 1) over rounds, averaged over prompts
    tau_per_prompt: list[float | None]  # None for a prompt that ended before any round
    accepted_histogram: list[int]  # [n + 1]: rounds that accepted k drafts, k = 0..n
    rounds: int
    tokens_generated: int
    trees: list[TreeAcceptance] = field(default_factory=list)  # one per tree budget asked for, in that order
    temperature: float = 0.0  # 0: greedy; else sampling at this temperature, verified losslessly
    seed: int | None = None  # the sampling's seed (None when greedy)
    # A DSpark drafter's confidence, per position k: prod_{j<=k} sigmoid(c_j) against "the first k drafts were
    # all accepted", over every chain round (consumer/evaluation/calibration.py). None for a DFlash drafter.
    calibration: ConfidenceCalibration | None = None
    # What drafted the chain above: "drafter" (the exported one), or "prompt-lookup" when it ran without a drafter
    # (then block_size is its drafts per round + 1, and lookup_ngram its longest n-gram).
    drafted_by: str = "drafter"
    lookup_ngram: int | None = None
    baselines: list[BaselineAcceptance] = field(default_factory=list)  # one per --baseline, in the order asked


@dataclass(frozen=True)
class EvalProgress:
    """Where an evaluation stands after a decoder finished a prompt: what `evaluate_drafter` hands its `progress`."""

    decoder: str  # "chain", "tree N", or a baseline's name
    done: int  # prompts this decoder has decoded
    total: int  # prompts it decodes
    tau: float  # its tau over those prompts
    tokens: int  # tokens the target committed for them
    seconds: float  # its decoding time so far
    decodes_done: int  # (prompt, decoder) decodes finished, every decoder counted
    decodes_total: int
    elapsed_s: float  # the whole decoding's time so far

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def eta_s(self) -> float:
        """The decodes left at the mean time of those done (decoders differ in speed: a rough figure)."""
        return self.elapsed_s / self.decodes_done * (self.decodes_total - self.decodes_done) if self.decodes_done else 0


def target_features(hidden_states: Sequence[torch.Tensor], target_layer_ids: Sequence[int]) -> torch.Tensor:
    """[batch, seq, n*H]: outputs of the listed decoder layers (HF hidden_states[l + 1]), concatenated."""
    return torch.cat([hidden_states[layer + 1] for layer in target_layer_ids], dim=-1)


def cache_argument(model: PreTrainedModel) -> str:
    """The name of forward's KV-cache argument: `cache` from transformers 5.2x, `past_key_values` before.

    Neither version refuses the other's name: 5.17 passes an unknown `cache=` down its **kwargs unread and
    builds a cache of its own, so ours stays empty and every forward runs without its prefix (the chain eval
    then failed in `crop`). The name is read from the signature, never assumed."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def drafter_draft_fn(
    drafter: DFlashDraftModel,
    head: FrozenTargetHead,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> DraftFn:
    """Drafts from an exported drafter by its family's draft function (consumer/families/<name>/), argmaxes at
    temperature 0, else samples at `temperature` from `generator`."""
    draft_block = family_of(drafter).draft

    def draft(committed: torch.Tensor, context: torch.Tensor) -> Draft | torch.Tensor:
        return draft_block(drafter, head, committed, context, temperature, generator)

    return draft


def prompt_lookup_draft_fn(
    *, max_ngram: int, max_tokens: int, temperature: float = 0.0, vocab_size: int | None = None
) -> DraftFn:
    """Drafts by prompt lookup (prompt_lookup.py) from the committed ids; reads no target features. Up to
    `max_tokens` a round, none where no suffix n-gram occurred before: speculative_generate with `fewer_drafts`.

    At temperature > 0 the drafts are a point mass: q = one-hot rows over the target's `vocab_size` logits, with
    which `verify_sampled` accepts x with probability min(1, p(x) / 1) = p(x) and at a rejection resamples from
    norm(max(p - onehot(x), 0)), p without x: the output stays distributed as the target's own sampling."""
    if temperature > 0 and vocab_size is None:
        raise ValueError("sampled prompt-lookup drafts need the target's vocab_size for their one-hot q")

    def draft(committed: torch.Tensor, context: torch.Tensor) -> Draft | torch.Tensor:
        ids = prompt_lookup(committed.cpu().numpy(), max_ngram=max_ngram, max_tokens=max_tokens)
        tokens = torch.tensor(ids, dtype=committed.dtype, device=committed.device)
        if temperature == 0:
            return tokens
        return Draft(tokens, probs=torch.nn.functional.one_hot(tokens, vocab_size).float())

    return draft


def untrained_drafter(drafter: DFlashDraftModel, seed: int = UNTRAINED_SEED) -> DFlashDraftModel:
    """A drafter of `drafter`'s class and config with freshly initialised weights, drawn after torch.manual_seed(seed):
    with the default seed the untrained row of `make run` (tools/launcher.py builds it from the same config after
    torch.manual_seed(0)). The global generator is left as it was, so the rest of the eval does not depend on it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        fresh = type(drafter)(drafter.config)
    return fresh.to(device=drafter.fc.weight.device, dtype=drafter.fc.weight.dtype).eval()


def drafter_distribution_fn(drafter: DFlashDraftModel, head: FrozenTargetHead) -> DistributionFn:
    """The same drafter pass as `drafter_draft_fn`, as log-probabilities for a draft tree."""

    def distributions(committed: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(_draft_logits(drafter, head, committed, context).float(), dim=-1)

    return distributions


def _draft_logits(
    drafter: DFlashDraftModel, head: FrozenTargetHead, committed: torch.Tensor, context: torch.Tensor
) -> torch.Tensor:
    hidden = drafter.draft_block(context.to(drafter.fc.weight.dtype), committed, head)
    return head.logits(hidden[1:])


def _prefill(
    target: PreTrainedModel,
    cache: DynamicCache,
    prompt_ids: Sequence[int],
    target_layer_ids: Sequence[int],
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt through the target into the empty `cache`: (its features [S, n*H], the committed ids [S + 1]
    ending with the target's first token, its argmax or a sample at `temperature`). From here on the cache and the
    features cover committed[:-1]. No layers, no features ([S, 0]): a draft that reads none (prompt lookup) spares
    the target every layer's hidden states."""
    prompt = torch.tensor([list(prompt_ids)], device=target.device)
    out = target(
        input_ids=prompt,
        **{cache_argument(target): cache},
        output_hidden_states=bool(target_layer_ids),
        logits_to_keep=1,
    )
    context = (
        target_features(out.hidden_states, target_layer_ids)[0]
        if target_layer_ids
        else out.logits.new_empty((prompt.shape[1], 0))
    )
    first, _ = sample_tokens(out.logits[0, -1:], temperature, generator)
    return context, torch.cat([prompt[0], first])


def verify_greedy(drafts: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """(drafts accepted, the target's token after them): drafts [n] against the target's logits [n + 1, V] at
    [anchor, drafts]. The longest prefix equal to the target's argmaxes is accepted, then its argmax follows."""
    verified = target_logits.argmax(dim=-1)  # verified[k]: the target's token after the anchor and k drafts
    n = int((drafts == verified[:-1]).long().cumprod(dim=0).sum())
    return n, int(verified[n])


def verify_sampled(
    drafts: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor, generator: torch.Generator | None
) -> tuple[int, int]:
    """Speculative sampling: (drafts accepted, the target's token after them), distributed as sampling the target.

    drafts [n] were sampled from draft_probs [n, V] (q_k, each given the drafts before it); target_probs [n + 1, V]
    (p_k) are the target's at [anchor, drafts]. Draft k is accepted with probability min(1, p_k(x_k) / q_k(x_k)),
    in order; at the first rejection the next token is sampled from norm(max(p_k - q_k, 0)), and after n accepted
    drafts from p_n. Then every token is distributed as p given what precedes it (Leviathan et al. 2023, thm. 1)."""
    n = drafts.shape[0]
    rows = torch.arange(n, device=drafts.device)
    p, q = target_probs[rows, drafts], draft_probs[rows, drafts]
    uniform = torch.rand(n, generator=generator, device=drafts.device, dtype=p.dtype)
    accepted = int((uniform * q < p).long().cumprod(dim=0).sum())  # u < p / q, without dividing by q
    if accepted == n:
        residual = target_probs[n]
    else:
        residual = (target_probs[accepted] - draft_probs[accepted]).clamp(min=0)
        if not residual.sum() > 0:  # p_k == q_k up to rounding: a rejection is then a rounding event
            residual = target_probs[accepted]
    return accepted, int(torch.multinomial(residual, 1, generator=generator))


def _finish(
    generated: list[int],
    accepted: list[int],
    eos: set[int],
    max_new_tokens: int,
    confidence: list[list[float]] | None = None,
) -> Generation:
    tokens = generated[:max_new_tokens]
    stop = next((i for i, t in enumerate(tokens) if t in eos), None)
    return Generation(
        tokens=tokens if stop is None else tokens[: stop + 1], accepted=accepted, confidence=confidence or []
    )


@torch.inference_mode()
def speculative_generate(
    target: PreTrainedModel,
    prompt_ids: Sequence[int],
    draft: DraftFn,
    *,
    block_size: int,
    target_layer_ids: Sequence[int],
    eos_token_ids: Iterable[int],
    max_new_tokens: int,
    num_drafts: int | None = None,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    fewer_drafts: bool = False,
) -> Generation:
    """Decoding of `prompt_ids` by draft-then-verify rounds, stopping at EOS or max_new_tokens: greedy at temperature
    0, else sampling at `temperature` (from `generator`) with speculative-sampling verification (`verify_sampled`).
    Each round `draft` proposes `num_drafts` tokens (default B - 1, DFlash's; a DSpark block drafts B), or with
    `fewer_drafts` up to that many, none included (prompt lookup: its match's continuation can be short, or absent).
    A drafter that returned fewer than its block would lower tau unseen, so only a caller that means it allows it.
    Empty `target_layer_ids`: `draft` is handed no features ([S, 0])."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature}")
    num_drafts = block_size - 1 if num_drafts is None else num_drafts
    eos = set(eos_token_ids)
    device = target.device
    cache = DynamicCache(config=target.config)
    context, committed = _prefill(target, cache, prompt_ids, target_layer_ids, temperature, generator)
    generated = committed[-1:].tolist()
    accepted: list[int] = []
    confidence: list[list[float]] = []
    finished = generated[0] in eos
    while len(generated) < max_new_tokens and not finished:
        proposal = draft(committed, context)
        if isinstance(proposal, torch.Tensor):
            proposal = Draft(tokens=proposal)
        shape = tuple(proposal.tokens.shape)
        if len(shape) != 1 or shape[0] > num_drafts or (shape[0] < num_drafts and not fewer_drafts):
            at_most = "at most " if fewer_drafts else ""
            raise ValueError(f"draft returned shape {shape}, expected {at_most}({num_drafts},)")
        if temperature > 0 and proposal.probs is None:
            raise ValueError(
                "sampled verification (temperature > 0) needs the distributions the drafts were "
                "sampled from (Draft.probs)"
            )
        block = torch.cat([committed[-1:], proposal.tokens.to(device)])
        drafted = block.shape[0] - 1
        out = target(
            input_ids=block[None], **{cache_argument(target): cache}, output_hidden_states=bool(target_layer_ids)
        )
        logits = out.logits[0]  # [n + 1, V]: logits[k] is the target's next-token distribution after block[: k + 1]
        if temperature == 0:
            n, bonus = verify_greedy(block[1:], logits)
        else:
            target_probs = torch.softmax(logits.float() / temperature, dim=-1)
            n, bonus = verify_sampled(block[1:], proposal.probs.to(device).float(), target_probs, generator)
        # Keep the anchor and the n accepted drafts; the target's own token is the next round's anchor.
        if drafted > n:
            cache.crop(-(drafted - n))
        if target_layer_ids:
            context = torch.cat([context, target_features(out.hidden_states, target_layer_ids)[0, : n + 1]])
        new = torch.cat([block[1 : n + 1], torch.tensor([bonus], device=device)])
        committed = torch.cat([committed, new])
        generated += new.tolist()
        accepted.append(n)
        if proposal.confidence is not None:
            confidence.append(proposal.confidence.float().tolist())
        finished = not eos.isdisjoint(new.tolist())
    return _finish(generated, accepted, eos, max_new_tokens, confidence)


@torch.inference_mode()
def tree_speculative_generate(
    target: PreTrainedModel,
    prompt_ids: Sequence[int],
    distributions: DistributionFn,
    *,
    budget: int,
    block_size: int,
    target_layer_ids: Sequence[int],
    eos_token_ids: Iterable[int],
    max_new_tokens: int,
) -> Generation:
    """Greedy decoding by DDTree rounds: a best-first tree of `budget` draft nodes from the drafter's
    distributions, verified in one target forward under a tree mask; stops at EOS or max_new_tokens.

    Each round the target sees [last committed token, every tree node] at positions prefix + depth, each
    node attending to the committed prefix (the cache) and its own ancestors only, so its logits and
    hidden states are those a plain forward of its path would give. The accepted path follows the
    target's argmax from the root; the path and the target's token after it commit, the cache keeps the
    path's rows (a gather, no second forward) and the drafter's next context is the path's features.
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    eos = set(eos_token_ids)
    device = target.device
    cache = DynamicCache(config=target.config)
    check_tree_target(getattr(target.config, "_attn_implementation", None), cache)
    context, committed = _prefill(target, cache, prompt_ids, target_layer_ids)
    generated = committed[-1:].tolist()
    accepted: list[int] = []
    finished = generated[0] in eos
    while len(generated) < max_new_tokens and not finished:
        log_probs = distributions(committed, context)
        if log_probs.ndim != 2 or log_probs.shape[0] != block_size - 1:
            raise ValueError(f"distributions returned shape {tuple(log_probs.shape)}, expected ({block_size - 1}, V)")
        tree = build_draft_tree(log_probs, budget)
        past = committed.shape[0] - 1  # what the cache holds
        ids = torch.tensor([[int(committed[-1])] + tree.tokens], device=device)
        positions = past + torch.tensor([[0] + tree.depths], device=device)
        out = target(
            input_ids=ids,
            position_ids=positions,
            attention_mask=tree_attention_mask(tree, past, target.dtype, device),
            **{cache_argument(target): cache},
            output_hidden_states=True,
        )
        path, bonus = follow_greedy(tree, out.logits[0].argmax(dim=-1).tolist())
        keep_path(cache, past, path)
        rows = torch.tensor(path, device=device)
        context = torch.cat([context, target_features(out.hidden_states, target_layer_ids)[0, rows]])
        new = ids[0, rows[1:]].tolist() + [bonus]
        committed = torch.cat([committed, torch.tensor(new, device=device)])
        generated += new
        accepted.append(len(path) - 1)
        finished = not eos.isdisjoint(new)
    return _finish(generated, accepted, eos, max_new_tokens)


def _tau(generations: Sequence[Generation]) -> float:
    """Per prompt mean(accepted + 1) over its rounds, averaged over the prompts that had a round (0 without one)."""
    scored = [fmean(n + 1 for n in g.accepted) for g in generations if g.accepted]
    return fmean(scored) if scored else 0.0


def _acceptance(generations: Sequence[Generation], outcomes: int) -> dict:
    histogram = [0] * outcomes  # accepted = 0 .. outcomes - 1
    for generation in generations:
        for n in generation.accepted:
            histogram[n] += 1
    per_prompt = [fmean(n + 1 for n in g.accepted) if g.accepted else None for g in generations]
    scored = [t for t in per_prompt if t is not None]
    return dict(
        tau=fmean(scored) if scored else 0.0,
        tau_per_prompt=per_prompt,
        accepted_histogram=histogram,
        rounds=sum(histogram),
        tokens_generated=sum(len(g.tokens) for g in generations),
    )


def summarize(
    generations: Sequence[Generation],
    block_size: int,
    trees: Mapping[int, Sequence[Generation]] | None = None,
    *,
    drafts_per_round: int | None = None,
    temperature: float = 0.0,
    seed: int | None = None,
) -> AcceptanceReport:
    """The chain's figures (rounds of `drafts_per_round` drafts, default B - 1), the confidence's calibration where
    the rounds carry confidences (DSpark), and for each tree budget (its generations on the same prompts) the tree's."""
    drafts = block_size - 1 if drafts_per_round is None else drafts_per_round
    rounds = [(c, n) for g in generations for c, n in zip(g.confidence, g.accepted)]
    if any(len(g.confidence) != len(g.accepted) for g in generations if g.confidence):
        raise ValueError("a generation carries confidences for some of its rounds only")
    tree_reports = [
        TreeAcceptance(
            budget=budget,
            **_acceptance(tree_generations, block_size),
            same_tokens_as_chain=sum(t.tokens == c.tokens for t, c in zip(tree_generations, generations)),
        )
        for budget, tree_generations in (trees or {}).items()
    ]
    return AcceptanceReport(
        block_size=block_size,
        drafts_per_round=drafts,
        num_prompts=len(generations),
        **_acceptance(generations, drafts + 1),
        trees=tree_reports,
        temperature=temperature,
        seed=seed,
        calibration=confidence_calibration(rounds),
    )


def chat_prompts(path: str | Path, tokenizer: PreTrainedTokenizerBase, limit: int | None = None) -> list[list[int]]:
    """Token ids of each jsonl row's prompt, with the generation prompt (thinking off, as in the published evals).

    The prompt is `prompt_of`'s, the rule `regenerate` answers rows by, so a file one takes the other does: a chat
    up to its final assistant reply, a chat ending in a user turn whole, a `prompt` with or without a `response`.
    A row with no user turn to answer is refused, naming its line."""
    if Path(path).exists() and not Path(path).is_file():  # a directory, a FIFO (read forever), a device
        raise EvalRefusal(f"data {path} is not a regular file: point --data at a JSONL file of chat rows")
    lines = read_text(path, PROMPTS_BYTES, EvalRefusal, "data").splitlines()
    if not tokenizer.chat_template:
        raise EvalRefusal(
            f"the target tokenizer {tokenizer.name_or_path} has no chat template to render the prompts of {path} with"
        )
    prompts = []
    for number, line in enumerate(lines, 1):
        if limit is not None and len(prompts) >= limit:
            break
        if not line.strip():
            continue
        # Each row is the user's input: whatever makes it no prompt is one line naming the file and the line.
        try:
            messages = prompt_of(decode_json_row(line))
            try:
                text = render_chat(
                    tokenizer, messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
                )
            except BadRow:
                raise  # one that did not finish rendering: named as it is
            except Exception as e:  # noqa: BLE001 (templates raise anything: jinja errors, raise_exception(...))
                raise BadRow(f"the target's chat template failed ({type(e).__name__}: {e})") from None
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if not ids:
                raise BadRow("the target's chat template renders its prompt as no tokens")
        except BadRow as e:
            raise EvalRefusal(f"data {path}, line {number}: {e}") from None
        prompts.append(ids)
    if not prompts:
        raise EvalRefusal(f"data {path} has no rows: it needs JSONL chat rows, one per line")
    return prompts


def check_compatible(drafter: DFlashDraftModel, target: PreTrainedModel) -> None:
    """Refuse a drafter built for another target: its features or mask row would not exist here."""
    config = target.config.get_text_config()
    width = len(drafter.target_layer_ids) * config.hidden_size
    if drafter.fc.in_features != width or max(drafter.target_layer_ids) >= config.num_hidden_layers:
        raise EvalRefusal(
            f"drafter reads target layers {drafter.target_layer_ids} ({drafter.fc.in_features} channels) but the "
            f"target has {config.num_hidden_layers} layers of width {config.hidden_size}"
        )
    if drafter.mask_token_id >= config.vocab_size:
        raise EvalRefusal(f"drafter mask_token_id {drafter.mask_token_id} is not a row of the target's embedding")
    selector = getattr(drafter, "candidate_selector", None)
    if selector is not None and selector.successor_codebook.shape[0] != config.vocab_size:
        raise EvalRefusal(
            f"the DFlash2 drafter's selector covers {selector.successor_codebook.shape[0]} tokens but the "
            f"target's vocabulary has {config.vocab_size}"
        )
    markov = getattr(drafter, "markov_head", None)
    if markov is not None and markov.markov_w1.num_embeddings != config.vocab_size:
        raise EvalRefusal(
            f"the DSpark drafter's Markov head covers {markov.markov_w1.num_embeddings} tokens but the "
            f"target's vocabulary has {config.vocab_size}"
        )


def evaluate_drafter(
    drafter_dir: str | Path | None,
    target_dir: str | Path,
    data: str | Path,
    *,
    max_new_tokens: int = 256,
    limit: int | None = None,
    device: str = "cpu",
    cpu_threads: int | None = 1,
    tree_budgets: Sequence[int] = (),
    temperature: float = 0.0,
    seed: int = 0,
    baselines: Sequence[str] = (),
    lookup_ngram: int = DEFAULT_LOOKUP_NGRAM,
    lookup_tokens: int | None = None,
    progress: Callable[[EvalProgress], None] | None = None,
) -> AcceptanceReport:
    """tau and the acceptance histogram of an exported drafter (DFlash, DSpark or DFlash2: through its selector) on
    the prompts of a chat jsonl file: by chain verification, and by tree verification at each of `tree_budgets` (draft
    nodes per round; greedy DFlash only) on the same prompts; for a DSpark drafter the confidence's calibration too.

    Greedy at temperature 0; at temperature > 0 drafts and target tokens are sampled (losslessly verified), each
    prompt from its own generator seeded from `seed`, so a prompt's tokens do not depend on `limit`.

    `baselines` (of BASELINES) are decoded on the same prompts the same way and reported beside the drafter:
    "untrained" (`untrained_drafter`), "prompt-lookup" (suffix n-grams of up to `lookup_ngram` tokens, up to
    `lookup_tokens` drafts a round: by default the drafter's own drafts per round, so the two verify as many tokens).
    Without a drafter (`drafter_dir` None) only prompt lookup can run, and its figures are the report's own, at
    `lookup_tokens` (default DEFAULT_LOOKUP_TOKENS) drafts a round.

    `progress` is called after every decoded prompt (each decoder's), with where the evaluation stands: a real
    target takes minutes a call, and nothing else shows it is moving.

    On the CPU, torch runs `cpu_threads` threads (None: torch's default). One, as inside `dflash-ring run`:
    decoding is many small forwards, where more threads only add overhead (2.4x slower with 2 on 2 cores).
    """
    previous = torch.get_num_threads()
    if device == "cpu" and cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
    try:
        return _evaluate(
            drafter_dir,
            target_dir,
            data,
            max_new_tokens=max_new_tokens,
            limit=limit,
            device=device,
            tree_budgets=tree_budgets,
            temperature=temperature,
            seed=seed,
            baselines=baselines,
            lookup_ngram=lookup_ngram,
            lookup_tokens=lookup_tokens,
            progress=progress,
        )
    finally:
        torch.set_num_threads(previous)


def check_round_memory(drafter: DFlashDraftModel, head: FrozenTargetHead, device: str) -> None:
    """A round drafts block_size positions and scores them: [block, vocab] float32 logits in the drafter's head and
    again in the target's verification, with the drafter's [block, hidden] activations of each layer beside them.
    An export's block_size and vocab_size are checked against the device's free memory before the first round
    (common/host_bounds.py): block_size 1e9 allocated past 3 GB before it failed."""
    vocab = max(int(drafter.config.vocab_size), int(head.embed_weight.shape[0]))
    hidden, layers = int(drafter.config.hidden_size), int(drafter.config.num_hidden_layers)
    check_memory(
        drafter.block_size * (2 * vocab + 4 * hidden * (layers + 1)) * 4,
        f"a round of the drafter's block (block_size = {drafter.block_size}, vocab_size = {vocab})",
        device,
        "the export's config.json is not the drafter's (export it again) or the device is too small",
    )


def prompt_generators(seed: int, count: int, device: str | torch.device) -> list[torch.Generator]:
    """One generator per prompt, each seeded by a draw of a generator seeded with `seed`, one draw at a time: the
    first k prompts get the same generators whatever the count."""
    root = torch.Generator().manual_seed(seed)
    seeds = [int(torch.randint(2**62, (1,), generator=root)) for _ in range(count)]
    return [torch.Generator(device=device).manual_seed(s) for s in seeds]


def _check_settings(
    drafter_dir: str | Path | None,
    tree_budgets: Sequence[int],
    temperature: float,
    baselines: Sequence[str],
    lookup_ngram: int,
    lookup_tokens: int | None,
) -> None:
    """Everything refused before a file is read: one line each."""
    if bad := [b for b in tree_budgets if b < 1]:
        raise EvalRefusal(f"tree budgets count draft nodes and must be at least 1, got {bad}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise EvalRefusal(f"temperature must be a finite number >= 0 (0: greedy), got {temperature}")
    if tree_budgets and temperature > 0:
        raise EvalRefusal("tree verification (tree budgets) is greedy only: evaluate trees at temperature 0")
    if unknown := [b for b in baselines if b not in BASELINES]:
        raise EvalRefusal(f"unknown baseline {unknown[0]!r}: choose among {', '.join(BASELINES)}")
    if lookup_ngram < 1:
        raise EvalRefusal(f"the prompt-lookup n-gram is at least 1 token, got {lookup_ngram}")
    if lookup_tokens is not None and not 1 <= lookup_tokens <= MAX_LOOKUP_TOKENS:
        raise EvalRefusal(f"prompt lookup drafts 1..{MAX_LOOKUP_TOKENS} tokens a round, got {lookup_tokens}")
    if drafter_dir is None:
        if list(dict.fromkeys(baselines)) != ["prompt-lookup"]:
            asked = f"baselines {', '.join(dict.fromkeys(baselines))}" if baselines else "no baseline"
            raise EvalRefusal(
                f"no drafter given ({asked}): give --drafter, or ask for --baseline prompt-lookup alone, "
                "the one decoder that needs none"
            )
        if tree_budgets:
            raise EvalRefusal("tree verification (tree budgets) drafts from a drafter's distributions: give --drafter")


def _evaluate(
    drafter_dir: str | Path | None,
    target_dir: str | Path,
    data: str | Path,
    *,
    max_new_tokens: int,
    limit: int | None,
    device: str,
    tree_budgets: Sequence[int],
    temperature: float,
    seed: int,
    baselines: Sequence[str],
    lookup_ngram: int,
    lookup_tokens: int | None,
    progress: Callable[[EvalProgress], None] | None,
) -> AcceptanceReport:
    _check_settings(drafter_dir, tree_budgets, temperature, baselines, lookup_ngram, lookup_tokens)
    baselines = list(dict.fromkeys(baselines))
    load_target_hf_config(target_dir)  # a config.json transformers refuses: one line naming its field
    drafter = head = None
    if drafter_dir is not None:
        # From the checkpoint, not target.get_input_embeddings().weight: the head also carries the family's
        # embedding scale and logit softcap (Gemma3), which a bare weight would drop.
        head = load_target_head(target_dir, dtype=torch.float32, device=device)
        # Either layout; a DSpark export's embed_tokens and lm_head must be this target's (load_drafter checks them).
        drafter = load_drafter(drafter_dir, device=device, dtype=torch.float32, arch=None, target_head=head).eval()
        check_round_memory(drafter, head, device)
        _check_tree_drafter(drafter, tree_budgets)
    tokenizer = load_target_tokenizer(target_dir)  # tokenizer files transformers cannot load: one line naming them
    # A config.json the model code cannot build, weights that do not fit it or lack tensors: one line naming it.
    target = load_target_lm(target_dir, dtype=torch.float32, local_files_only=True).to(device).eval()
    if drafter is not None:
        check_compatible(drafter, target)
    eos = eos_ids(target, tokenizer)
    prompts = chat_prompts(data, tokenizer, limit)
    vocab = target.config.get_text_config().vocab_size
    check_token_ids(max(max(p) for p in prompts), vocab, target_dir, target_dir, f"data {data}, rendered,")

    def generators() -> list[torch.Generator | None]:
        """Each decoder's own, the same seeds: prompt i's random numbers start alike whatever drafts them."""
        return prompt_generators(seed, len(prompts), device) if temperature > 0 else [None] * len(prompts)

    common = dict(eos_token_ids=eos, max_new_tokens=max_new_tokens, temperature=temperature)

    def chain(model: DFlashDraftModel) -> Callable[[list[int], torch.Generator | None], Generation]:
        dspark = getattr(model, "sample_from_anchor", False)
        return lambda prompt, g: speculative_generate(
            target,
            prompt,
            drafter_draft_fn(model, head, temperature=temperature, generator=g),
            block_size=model.block_size,
            target_layer_ids=model.target_layer_ids,
            num_drafts=model.block_size if dspark else model.block_size - 1,
            generator=g,
            **common,
        )

    num_drafts = None if drafter is None else drafter.block_size - (0 if drafter.sample_from_anchor else 1)
    lookup = lookup_tokens or num_drafts or DEFAULT_LOOKUP_TOKENS
    logits_rows = target.get_output_embeddings().weight.shape[0]  # the width of the target's logits: q's one-hot

    def prompt_lookup_chain(prompt: list[int], g: torch.Generator | None) -> Generation:
        draft = prompt_lookup_draft_fn(
            max_ngram=lookup_ngram, max_tokens=lookup, temperature=temperature, vocab_size=logits_rows
        )
        return speculative_generate(
            target,
            prompt,
            draft,
            block_size=lookup + 1,
            target_layer_ids=[],
            num_drafts=lookup,
            generator=g,
            fewer_drafts=True,
            **common,
        )

    # Every decoder over every prompt, in report order: the drafter's chain (or prompt lookup's, without a drafter),
    # its trees, then the baselines.
    decoders: dict[str, Callable[[list[int], torch.Generator | None], Generation]] = {}
    if drafter is not None:
        decoders["chain"] = chain(drafter)
        distributions = drafter_distribution_fn(drafter, head)
        for budget in dict.fromkeys(tree_budgets):
            decoders[f"tree {budget}"] = lambda prompt, g, budget=budget: tree_speculative_generate(
                target,
                prompt,
                distributions,
                budget=budget,
                block_size=drafter.block_size,
                target_layer_ids=drafter.target_layer_ids,
                eos_token_ids=eos,
                max_new_tokens=max_new_tokens,
            )
        if "untrained" in baselines:
            decoders["untrained"] = chain(untrained_drafter(drafter))
    if "prompt-lookup" in baselines:
        decoders["prompt-lookup"] = prompt_lookup_chain
    results = _decode_all(decoders, prompts, generators, progress)

    chain_name = "chain" if drafter is not None else "prompt-lookup"
    block_size = drafter.block_size if drafter is not None else lookup + 1
    report = summarize(
        results[chain_name],
        block_size,
        {budget: results[f"tree {budget}"] for budget in dict.fromkeys(tree_budgets)},
        drafts_per_round=num_drafts if drafter is not None else lookup,
        temperature=temperature,
        seed=seed if temperature > 0 else None,
    )
    rows = [
        BaselineAcceptance(
            name=name,
            drafts_per_round=lookup if name == "prompt-lookup" else num_drafts,
            **_acceptance(results[name], (lookup if name == "prompt-lookup" else num_drafts) + 1),
            same_tokens_as_chain=(
                sum(b.tokens == c.tokens for b, c in zip(results[name], results[chain_name]))
                if temperature == 0
                else None
            ),
            init_seed=UNTRAINED_SEED if name == "untrained" else None,
            lookup_ngram=lookup_ngram if name == "prompt-lookup" else None,
        )
        for name in baselines
        if name != chain_name
    ]
    return replace(
        report,
        drafted_by="drafter" if drafter is not None else "prompt-lookup",
        lookup_ngram=lookup_ngram if drafter is None else None,
        baselines=rows,
    )


def _check_tree_drafter(drafter: DFlashDraftModel, tree_budgets: Sequence[int]) -> None:
    if tree_budgets and (why := family_of(drafter).no_draft_tree) is not None:
        raise EvalRefusal(f"tree verification (tree budgets) takes a DFlash drafter: {why}")


def _decode_all(
    decoders: Mapping[str, Callable[[list[int], torch.Generator | None], Generation]],
    prompts: Sequence[list[int]],
    generators: Callable[[], list[torch.Generator | None]],
    progress: Callable[[EvalProgress], None] | None,
) -> dict[str, list[Generation]]:
    """Each decoder's generations of every prompt, reporting to `progress` after each one."""
    total = len(decoders) * len(prompts)
    started = time.monotonic()
    results: dict[str, list[Generation]] = {}
    for name, decode in decoders.items():
        begun = time.monotonic()
        done: list[Generation] = []
        for prompt, generator in zip(prompts, generators()):
            done.append(decode(prompt, generator))
            if progress is not None:
                now = time.monotonic()
                progress(
                    EvalProgress(
                        decoder=name,
                        done=len(done),
                        total=len(prompts),
                        tau=_tau(done),
                        tokens=sum(len(g.tokens) for g in done),
                        seconds=now - begun,
                        decodes_done=len(results) * len(prompts) + len(done),
                        decodes_total=total,
                        elapsed_s=now - started,
                    )
                )
        results[name] = done
    return results


def format_progress(p: EvalProgress) -> str:
    """One progress line: `chain: 3/100 prompts, tau 2.412, 153.2 target tokens/s, ETA 4m10s`."""
    return (
        f"{p.decoder}: {p.done}/{p.total} prompts, tau {p.tau:.3f}, {p.tokens_per_s:.1f} target tokens/s, "
        f"ETA {_duration(p.eta_s)}"
    )


def _duration(seconds: float) -> str:
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def progress_logger(interval_s: float = 5.0) -> Callable[[EvalProgress], None]:
    """A `progress` for evaluate_drafter that logs (stderr, under the CLI) each decoder's first and last prompt and
    one line at most every `interval_s` between: a line per prompt would flood a fast eval's log, none at all left a
    218-760 s call silent."""
    last = [-math.inf]

    def report(p: EvalProgress) -> None:
        now = time.monotonic()
        if p.done in (1, p.total) or now - last[0] >= interval_s:
            last[0] = now
            log.info("%s", format_progress(p))

    return report


def _optional(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def format_calibration(calibration: ConfidenceCalibration) -> list[str]:
    lines = [
        f"confidence calibration: prod_{{j<=k}} sigmoid(c_j) against the first k drafts all accepted, over "
        f"{calibration.pooled.count // max(len(calibration.positions), 1)} rounds ({calibration.bins} bins)",
        "      k  accepted  predicted    ECE  AUROC  Brier",
    ]
    for row in [*calibration.positions, calibration.pooled]:
        name = f"{row.position:>7}" if row.position else " pooled"
        lines.append(
            f"{name}  {row.observed:8.3f}  {row.mean_predicted:9.3f}  {row.ece:5.3f}  "
            f"{_optional(row.auroc):>5}  {row.brier:5.3f}"
        )
    return lines


def format_report(report: AcceptanceReport) -> str:
    decoding = "greedy" if report.temperature == 0 else f"temperature {report.temperature:g}, seed {report.seed}"
    if report.drafted_by == "prompt-lookup":
        drafted = (
            f"prompt lookup: suffix n-grams of {report.lookup_ngram} down to 1 tokens, up to "
            f"{report.drafts_per_round} drafts per round"
        )
    else:
        drafted = f"block size {report.block_size}, {report.drafts_per_round} drafts per round"
    lines = [
        f"tau {report.tau:.3f} ({drafted}, {decoding}) over {report.num_prompts} prompts: {report.rounds} rounds, "
        f"{report.tokens_generated} tokens generated",
        "accepted drafts per round: "
        + ", ".join(f"{k}: {count}" for k, count in enumerate(report.accepted_histogram) if count),
    ]
    if report.calibration is not None:
        lines += format_calibration(report.calibration)
    for tree in report.trees:
        gain = f" ({tree.tau / report.tau:.2f}x chain)" if report.tau else ""
        lines += [
            f"tree budget {tree.budget}: tau {tree.tau:.3f}{gain}: {tree.rounds} rounds, {tree.tokens_generated} "
            f"tokens generated, {tree.same_tokens_as_chain}/{report.num_prompts} prompts token-identical to chain",
            "  accepted drafts per round: "
            + ", ".join(f"{k}: {count}" for k, count in enumerate(tree.accepted_histogram) if count),
        ]
    if report.baselines:
        lines += format_baselines(report)
    return "\n".join(lines)


def format_baselines(report: AcceptanceReport) -> list[str]:
    """The drafter's chain and each baseline's, one row each: the same prompts, target and verification."""
    same = "greedy: prompts token-identical to the drafter's" if report.temperature == 0 else "sampled"
    rows = [("drafter", str(report.drafts_per_round), report.tau, report.rounds, report.tokens_generated, "-")]
    for b in report.baselines:
        if b.name == "untrained":
            name, drafts = f"untrained (init seed {b.init_seed})", str(b.drafts_per_round)
        else:
            name, drafts = f"prompt lookup ({b.lookup_ngram}-gram)", f"<={b.drafts_per_round}"
        identical = "-" if b.same_tokens_as_chain is None else f"{b.same_tokens_as_chain}/{report.num_prompts}"
        rows.append((name, drafts, b.tau, b.rounds, b.tokens_generated, identical))
    lines = [
        f"baselines on the same prompts, target and verification ({same}):",
        f"  {'drafts by':<28} {'drafts/round':>12} {'tau':>7} {'x drafter':>9} {'rounds':>7} {'tokens':>7} "
        f"{'same tokens':>11}",
    ]
    for name, drafts, tau, rounds, tokens, identical in rows:
        ratio = f"{tau / report.tau:.2f}x" if report.tau else "-"
        lines.append(f"  {name:<28} {drafts:>12} {tau:7.3f} {ratio:>9} {rounds:>7} {tokens:>7} {identical:>11}")
    return lines


def report_json(report: AcceptanceReport) -> str:
    return json.dumps(asdict(report), indent=2)
