"""Offline acceptance eval: greedy speculative decoding with a DFlash drafter against its target.

Follows z-lab's `dflash_generate` (dflash.md section 5): the target prefills the prompt and gives
the first token; each round the drafter proposes B-1 tokens after the last committed one, the
target checks the whole block in one forward, the matching prefix is accepted and the target's
own next token is added as a bonus. The output is therefore exactly greedy target decoding; the
drafter only changes how many tokens each target forward yields, which is what tau measures.

Tree verification (`tree_speculative_generate`, DDTree) spends a node budget on a best-first tree of the
drafter's likeliest paths instead of one chain (draft_tree.py) and accepts the longest path the target's
greedy decode follows; the eval reports its tau per budget next to the chain's, on the same prompts.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import fmean

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from dflash_ring.common.chat_encoding import conversation_of, decode_json_row, eos_ids
from dflash_ring.common.target_config import load_target_hf_config

from .draft_tree import build_draft_tree, check_tree_target, follow_greedy, keep_path, tree_attention_mask
from .export import load_drafter
from .model import DFlashDraftModel, FrozenTargetHead, load_target_head

DraftFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(committed ids [S + 1] ending with the anchor, target features [S, n*H]) -> B - 1 draft token ids."""

DistributionFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""As DraftFn, but -> [B - 1, V] log-probabilities of block positions 1..B-1 (what a draft tree is built from)."""


@dataclass(frozen=True)
class Generation:
    tokens: list[int]  # generated ids, prompt excluded; ends with EOS if one was produced
    accepted: list[int]  # drafts accepted in each verification round, each in 0..B-1


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
class AcceptanceReport:
    block_size: int
    num_prompts: int
    tau: float  # mean acceptance length: per prompt mean(accepted + 1) over rounds, averaged over prompts
    tau_per_prompt: list[float | None]  # None for a prompt that ended before any round
    accepted_histogram: list[int]  # [B]: rounds that accepted k drafts, k = 0..B-1
    rounds: int
    tokens_generated: int
    trees: list[TreeAcceptance] = field(default_factory=list)  # one per tree budget asked for, in that order


def target_features(hidden_states: Sequence[torch.Tensor], target_layer_ids: Sequence[int]) -> torch.Tensor:
    """[batch, seq, n*H]: outputs of the listed decoder layers (HF hidden_states[l + 1]), concatenated."""
    return torch.cat([hidden_states[layer + 1] for layer in target_layer_ids], dim=-1)


def cache_argument(model: PreTrainedModel) -> str:
    """The name of forward's KV-cache argument: `cache` from transformers 5.2x, `past_key_values` before.

    Neither version refuses the other's name: 5.17 passes an unknown `cache=` down its **kwargs unread and
    builds a cache of its own, so ours stays empty and every forward runs without its prefix (the chain eval
    then failed in `crop`). The name is read from the signature, never assumed."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def drafter_draft_fn(drafter: DFlashDraftModel, head: FrozenTargetHead) -> DraftFn:
    """Drafts from a DFlash drafter: its block hidden states through the target's lm_head, argmax."""

    def draft(committed: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return _draft_logits(drafter, head, committed, context).argmax(dim=-1)

    return draft


def drafter_distribution_fn(drafter: DFlashDraftModel, head: FrozenTargetHead) -> DistributionFn:
    """The same drafter pass as `drafter_draft_fn`, as log-probabilities for a draft tree."""

    def distributions(committed: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(_draft_logits(drafter, head, committed, context).float(), dim=-1)

    return distributions


def _draft_logits(drafter: DFlashDraftModel, head: FrozenTargetHead, committed: torch.Tensor,
                  context: torch.Tensor) -> torch.Tensor:
    hidden = drafter.draft_block(context.to(drafter.fc.weight.dtype), committed, head)
    return head.logits(hidden[1:])


def _prefill(target: PreTrainedModel, cache: DynamicCache, prompt_ids: Sequence[int], target_layer_ids: Sequence[int]
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt through the target into the empty `cache`: (its features [S, n*H], the committed ids [S + 1]
    ending with the target's first token). From here on the cache and the features cover committed[:-1]."""
    prompt = torch.tensor([list(prompt_ids)], device=target.device)
    out = target(input_ids=prompt, **{cache_argument(target): cache}, output_hidden_states=True, logits_to_keep=1)
    context = target_features(out.hidden_states, target_layer_ids)[0]
    return context, torch.cat([prompt[0], out.logits[0, -1:].argmax(dim=-1)])


def _finish(generated: list[int], accepted: list[int], eos: set[int], max_new_tokens: int) -> Generation:
    tokens = generated[:max_new_tokens]
    stop = next((i for i, t in enumerate(tokens) if t in eos), None)
    return Generation(tokens=tokens if stop is None else tokens[: stop + 1], accepted=accepted)


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
) -> Generation:
    """Greedy decoding of `prompt_ids` by draft-then-verify rounds, stopping at EOS or max_new_tokens."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    eos = set(eos_token_ids)
    device = target.device
    cache = DynamicCache(config=target.config)
    context, committed = _prefill(target, cache, prompt_ids, target_layer_ids)
    generated = committed[-1:].tolist()
    accepted: list[int] = []
    finished = generated[0] in eos
    while len(generated) < max_new_tokens and not finished:
        drafts = draft(committed, context)
        if drafts.shape != (block_size - 1,):
            raise ValueError(f"draft returned shape {tuple(drafts.shape)}, expected ({block_size - 1},)")
        block = torch.cat([committed[-1:], drafts.to(device)])
        out = target(input_ids=block[None], **{cache_argument(target): cache}, output_hidden_states=True)
        verified = out.logits[0].argmax(dim=-1)  # verified[k]: the target's token after block[: k + 1]
        n = int((block[1:] == verified[:-1]).long().cumprod(dim=0).sum())
        # Keep the anchor and the n accepted drafts; the bonus verified[n] is the next round's anchor.
        cache.crop(-(block_size - 1 - n))
        context = torch.cat([context, target_features(out.hidden_states, target_layer_ids)[0, : n + 1]])
        new = torch.cat([block[1 : n + 1], verified[n : n + 1]])
        committed = torch.cat([committed, new])
        generated += new.tolist()
        accepted.append(n)
        finished = not eos.isdisjoint(new.tolist())
    return _finish(generated, accepted, eos, max_new_tokens)


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
            input_ids=ids, position_ids=positions, attention_mask=tree_attention_mask(tree, past, target.dtype, device),
            **{cache_argument(target): cache}, output_hidden_states=True,
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


def _acceptance(generations: Sequence[Generation], block_size: int) -> dict:
    histogram = [0] * block_size
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


def summarize(generations: Sequence[Generation], block_size: int,
              trees: Mapping[int, Sequence[Generation]] | None = None) -> AcceptanceReport:
    """The chain's figures, and for each tree budget (its generations on the same prompts) the tree's."""
    tree_reports = [
        TreeAcceptance(
            budget=budget,
            **_acceptance(tree_generations, block_size),
            same_tokens_as_chain=sum(t.tokens == c.tokens for t, c in zip(tree_generations, generations)),
        )
        for budget, tree_generations in (trees or {}).items()
    ]
    return AcceptanceReport(block_size=block_size, num_prompts=len(generations), **_acceptance(generations, block_size),
                            trees=tree_reports)


def chat_prompts(path: str | Path, tokenizer: PreTrainedTokenizerBase, limit: int | None = None) -> list[list[int]]:
    """Token ids of each jsonl row's conversation up to its last assistant turn, with the generation prompt
    (thinking off, as in the published evals)."""
    prompts = []
    for line in Path(path).read_text().splitlines():
        if limit is not None and len(prompts) >= limit:
            break
        if not line.strip():
            continue
        messages = conversation_of(decode_json_row(line))
        last_reply = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        text = tokenizer.apply_chat_template(
            messages[:last_reply], tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


def check_compatible(drafter: DFlashDraftModel, target: PreTrainedModel) -> None:
    """Refuse a drafter built for another target: its features or mask row would not exist here."""
    config = target.config.get_text_config()
    width = len(drafter.target_layer_ids) * config.hidden_size
    if drafter.fc.in_features != width or max(drafter.target_layer_ids) >= config.num_hidden_layers:
        raise ValueError(
            f"drafter reads target layers {drafter.target_layer_ids} ({drafter.fc.in_features} channels) but the "
            f"target has {config.num_hidden_layers} layers of width {config.hidden_size}"
        )
    if drafter.mask_token_id >= config.vocab_size:
        raise ValueError(f"drafter mask_token_id {drafter.mask_token_id} is not a row of the target's embedding")


def evaluate_drafter(
    drafter_dir: str | Path,
    target_dir: str | Path,
    data: str | Path,
    *,
    max_new_tokens: int = 256,
    limit: int | None = None,
    device: str = "cpu",
    cpu_threads: int | None = 1,
    tree_budgets: Sequence[int] = (),
) -> AcceptanceReport:
    """tau and the acceptance histogram of an exported drafter on the prompts of a chat jsonl file: by chain
    verification, and by tree verification at each of `tree_budgets` (draft nodes per round) on the same prompts.

    On the CPU, torch runs `cpu_threads` threads (None: torch's default). One, as inside `dflash-ring run`:
    decoding is many small forwards, where more threads only add overhead (2.4x slower with 2 on 2 cores).
    """
    previous = torch.get_num_threads()
    if device == "cpu" and cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
    try:
        return _evaluate(drafter_dir, target_dir, data, max_new_tokens, limit, device, tree_budgets)
    finally:
        torch.set_num_threads(previous)


def _evaluate(drafter_dir: str | Path, target_dir: str | Path, data: str | Path, max_new_tokens: int,
              limit: int | None, device: str, tree_budgets: Sequence[int]) -> AcceptanceReport:
    if bad := [b for b in tree_budgets if b < 1]:
        raise ValueError(f"tree budgets count draft nodes and must be at least 1, got {bad}")
    load_target_hf_config(target_dir)  # a config.json transformers refuses: one line naming its field
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).to(device).eval()
    drafter = load_drafter(drafter_dir, device=device, dtype=torch.float32).eval()
    check_compatible(drafter, target)
    # From the checkpoint, not target.get_input_embeddings().weight: the head also carries the family's
    # embedding scale and logit softcap (Gemma3), which a bare weight would drop.
    head = load_target_head(target_dir, dtype=torch.float32, device=device)
    draft = drafter_draft_fn(drafter, head)
    eos = eos_ids(target, tokenizer)
    prompts = chat_prompts(data, tokenizer, limit)
    decoding = dict(block_size=drafter.block_size, target_layer_ids=drafter.target_layer_ids, eos_token_ids=eos,
                    max_new_tokens=max_new_tokens)
    generations = [speculative_generate(target, prompt, draft, **decoding) for prompt in prompts]
    distributions = drafter_distribution_fn(drafter, head)
    trees = {
        budget: [tree_speculative_generate(target, prompt, distributions, budget=budget, **decoding)
                 for prompt in prompts]
        for budget in dict.fromkeys(tree_budgets)
    }
    return summarize(generations, drafter.block_size, trees)


def format_report(report: AcceptanceReport) -> str:
    lines = [
        f"tau {report.tau:.3f} (block size {report.block_size}) over {report.num_prompts} prompts: "
        f"{report.rounds} rounds, {report.tokens_generated} tokens generated",
        "accepted drafts per round: "
        + ", ".join(f"{k}: {count}" for k, count in enumerate(report.accepted_histogram) if count),
    ]
    for tree in report.trees:
        gain = f" ({tree.tau / report.tau:.2f}x chain)" if report.tau else ""
        lines += [
            f"tree budget {tree.budget}: tau {tree.tau:.3f}{gain}: {tree.rounds} rounds, {tree.tokens_generated} "
            f"tokens generated, {tree.same_tokens_as_chain}/{report.num_prompts} prompts token-identical to chain",
            "  accepted drafts per round: "
            + ", ".join(f"{k}: {count}" for k, count in enumerate(tree.accepted_histogram) if count),
        ]
    return "\n".join(lines)


def report_json(report: AcceptanceReport) -> str:
    return json.dumps(asdict(report), indent=2)
