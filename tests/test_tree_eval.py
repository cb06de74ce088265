"""Tree verification (DDTree) in the eval: the best-first tree under a budget, the tree mask, losslessness
against the target's plain greedy decode, the features and cache it leaves behind, and the CLI flag."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, Qwen3ForCausalLM

from dflash_ring.cli import main
from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.consumer.evaluation.draft_tree import DraftTree, build_draft_tree, tree_attention_mask
from dflash_ring.consumer.evaluation.evaluate import (
    cache_argument,
    drafter_distribution_fn,
    drafter_draft_fn,
    evaluate_drafter,
    speculative_generate,
    target_features,
    tree_speculative_generate,
)
from dflash_ring.consumer.layouts.export import export_drafter, load_drafter
from dflash_ring.consumer.modeling.model import FrozenTargetHead
from dflash_ring.consumer.families.build import build_drafter
from support import build_target, save_eval_target

BLOCK, MAX_NEW, LAYER_IDS, VOCAB = 4, 23, [1, 2], 448
PROMPTS = ([5, 17, 42, 9, 33, 120, 7], [3, 3, 3], list(range(60, 90)))
BUDGETS = (1, 3, 16, 64)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_eval_target(tmp_path_factory.mktemp("target"), VOCAB)


@pytest.fixture(scope="module")
def target(target_dir):
    return Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def drafter_dir(target_dir, tmp_path_factory):
    torch.manual_seed(1)
    cfg = DrafterConfig(
        num_hidden_layers=2, block_size=BLOCK, loss_gamma=2.0, mask_token_id=VOCAB - 1, target_layer_ids=LAYER_IDS
    )
    config = json.loads((target_dir / "config.json").read_text())
    return export_drafter(build_drafter(cfg, config), cfg, config, tmp_path_factory.mktemp("d") / "drafter")


@pytest.fixture(scope="module")
def drafter(drafter_dir):
    return load_drafter(drafter_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def greedy(target):
    """The reference: per prompt, the target's plain greedy continuation (whole sequence re-run per token)."""
    out = {}
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = list(prompt)
            for _ in range(MAX_NEW + BLOCK):
                ids.append(int(target(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            out[tuple(prompt)] = ids[len(prompt) :]
    return out


def head_of(target: Qwen3ForCausalLM) -> FrozenTargetHead:
    return FrozenTargetHead(target.get_input_embeddings().weight, target.get_output_embeddings().weight)


def log_probs_of(probs: list[list[float]], tokens: list[list[int]], vocab: int = 8) -> torch.Tensor:
    """[D, vocab] log-probabilities with probs[d][r] on token tokens[d][r], the rest spread thinly."""
    table = torch.full((len(probs), vocab), 1e-6)
    for d, (p, t) in enumerate(zip(probs, tokens)):
        table[d, t] = torch.tensor(p)
    return table.log()


def ranked(prompt: list[int], continuation: list[int], rank: int):
    """Distributions that put the target's own next tokens at `rank` (0: top-1) at every block position and
    other tokens above them: exercises accepted paths through siblings, i.e. non-contiguous cache rows."""

    def distributions(committed: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        done = committed.shape[0] - len(prompt)
        logits = torch.zeros(BLOCK - 1, VOCAB)
        for k, token in enumerate(continuation[done : done + BLOCK - 1]):
            logits[k, token] = 20.0 - rank  # sharp enough that every path of ranks <= rank beats any other
            for r in range(rank):  # decoys above it, each a different wrong token
                logits[k, (token + 1 + r) % (VOCAB - 1)] = 20.0 - r
        return torch.log_softmax(logits, dim=-1)

    return distributions


def tree_generate(target, prompt, distributions, budget, eos=(), max_new=MAX_NEW):
    return tree_speculative_generate(
        target,
        prompt,
        distributions,
        budget=budget,
        block_size=BLOCK,
        target_layer_ids=LAYER_IDS,
        eos_token_ids=eos,
        max_new_tokens=max_new,
    )


# --- the tree -------------------------------------------------------------------------------------


HAND_PROBS = [[0.6, 0.3, 0.1], [0.7, 0.2, 0.1], [0.8, 0.15, 0.05]]
HAND_TOKENS = [[4, 2, 7], [1, 5, 3], [6, 0, 2]]  # token of rank r at depth d


def test_best_first_order_and_budget_by_hand():
    """Scores: d1 r0 .6 -> d2 r0 .42 -> d3 r0 .336 -> d1 r1 .3 -> (d1 r1) d2 r0 .21 -> d3 r0 .168 -> d2 r1 .12."""
    log_probs = log_probs_of(HAND_PROBS, HAND_TOKENS)
    tree = build_draft_tree(log_probs, budget=5)
    assert tree.tokens == [4, 1, 6, 2, 1]
    assert tree.depths == [1, 2, 3, 1, 2]
    assert tree.parents == [-1, 0, 1, 2, 0, 4]
    assert [math.exp(s) for s in tree.scores] == pytest.approx([0.6, 0.42, 0.336, 0.3, 0.21], rel=1e-4)
    assert tree.children() == [{4: 1, 2: 4}, {1: 2}, {6: 3}, {}, {1: 5}, {}]

    seven = build_draft_tree(log_probs, budget=7)
    assert seven.tokens[:5] == tree.tokens and seven.parents[:6] == tree.parents  # a bigger budget only adds
    assert seven.tokens[5:] == [6, 5] and seven.depths[5:] == [3, 2] and seven.parents[6:] == [5, 1]
    assert build_draft_tree(log_probs, budget=1).tokens == [4]  # one node: the top-1 at position 1


def test_tree_is_the_budget_best_paths():
    """Against brute force: every path of length 1..D over the vocabulary, the `budget` most likely."""
    torch.manual_seed(0)
    depth, vocab = 3, 5
    log_probs = torch.log_softmax(torch.randn(depth, vocab) * 2, dim=-1)
    paths = [p for n in range(1, depth + 1) for p in itertools.product(range(vocab), repeat=n)]
    score = {p: float(sum(log_probs[d, t] for d, t in enumerate(p))) for p in paths}
    for budget in (1, 4, 17, 60, len(paths), len(paths) + 10):
        tree = build_draft_tree(log_probs, budget)
        assert tree.size == min(budget, len(paths))
        assert tree.scores == sorted(tree.scores, reverse=True)
        got = set(map(path_tokens, [tree] * tree.size, range(1, tree.size + 1)))
        want = set(sorted(paths, key=score.__getitem__, reverse=True)[: tree.size])
        assert got == want


def path_tokens(tree: DraftTree, node: int) -> tuple[int, ...]:
    tokens = []
    while node > 0:
        tokens.append(tree.tokens[node - 1])
        node = tree.parents[node]
    return tuple(reversed(tokens))


def test_budget_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        build_draft_tree(torch.zeros(3, 8), budget=0)


def test_mask_shows_each_node_its_ancestors_and_the_prefix():
    tree = build_draft_tree(log_probs_of(HAND_PROBS, HAND_TOKENS), budget=5)  # parents [-1, 0, 1, 2, 0, 4]
    ancestors_and_self = [{0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}, {0, 4}, {0, 4, 5}]
    visible = tree.visibility()
    for node, seen in enumerate(ancestors_and_self):
        assert {j for j in range(6) if visible[node, j]} == seen
    mask = tree_attention_mask(tree, prefix_length=3, dtype=torch.float32, device="cpu")
    assert mask.shape == (1, 1, 6, 9)
    assert (mask[0, 0, :, :3] == 0).all()  # the committed prefix: seen by every node
    assert torch.equal(mask[0, 0, :, 3:] == 0, visible)
    assert (mask[0, 0, :, 3:][~visible] == torch.finfo(torch.float32).min).all()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tree_forward_equals_a_plain_forward_of_each_path(target_dir, attn):
    """One cached tree forward gives every node the logits and features a plain forward of its path gives."""
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, attn_implementation=attn).eval()
    torch.manual_seed(3)
    prefix = [5, 17, 42, 9, 33, 120, 7]
    tree = build_draft_tree(torch.log_softmax(torch.randn(BLOCK - 1, 6), dim=-1), budget=20)
    assert len(set(tree.depths)) == BLOCK - 1 and max(len(c) for c in tree.children()) > 1  # deep and branching
    root = 11
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([prefix]), **{cache_argument(model): cache})
        out = model(
            input_ids=torch.tensor([[root] + tree.tokens]),
            position_ids=len(prefix) + torch.tensor([[0] + tree.depths]),
            attention_mask=tree_attention_mask(tree, len(prefix), torch.float32, "cpu"),
            **{cache_argument(model): cache},
            output_hidden_states=True,
        )
        features = target_features(out.hidden_states, LAYER_IDS)[0]
        for node in range(tree.size + 1):
            ids = prefix + [root, *path_tokens(tree, node)]
            plain = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
            torch.testing.assert_close(out.logits[0, node], plain.logits[0, -1], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(
                features[node], target_features(plain.hidden_states, LAYER_IDS)[0, -1], atol=1e-4, rtol=1e-4
            )


# --- decoding -------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_tree_decoding_with_the_drafter_equals_plain_greedy(target, drafter, greedy, prompt, budget):
    got = tree_generate(target, prompt, drafter_distribution_fn(drafter, head_of(target)), budget)
    assert got.tokens == greedy[tuple(prompt)][:MAX_NEW]
    assert all(0 <= n <= min(budget, BLOCK - 1) for n in got.accepted)
    assert len(got.tokens) == min(MAX_NEW, 1 + sum(n + 1 for n in got.accepted))


@pytest.mark.parametrize("rank", [0, 1, 2])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_long_accepts_through_siblings_keep_cache_and_features_exact(target, greedy, prompt, rank):
    """The target's tokens at rank `rank` of every position: a tree holding all rank<=`rank` paths accepts
    B-1 drafts every round, along a path of non-contiguous nodes; the context the drafter gets each round
    must then equal the features of a plain forward of the committed tokens."""
    continuation = greedy[tuple(prompt)]
    inner = ranked(prompt, continuation, rank)
    errors = []

    def checking(committed: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            plain = target(input_ids=committed[None, :-1], output_hidden_states=True)
        errors.append(float((context - target_features(plain.hidden_states, LAYER_IDS)[0]).abs().max()))
        return inner(committed, context)

    budget = sum((rank + 1) ** d for d in range(1, BLOCK))  # every path of ranks <= rank
    got = tree_generate(target, prompt, checking, budget)
    assert got.tokens == continuation[:MAX_NEW]
    assert got.accepted == [BLOCK - 1] * -(-(MAX_NEW - 1) // BLOCK)
    assert len(errors) == len(got.accepted) and max(errors) < 1e-4
    if rank:  # one node short of that, and a round finds its last draft missing
        short = tree_generate(target, prompt, inner, budget - 1)
        assert short.tokens == continuation[:MAX_NEW] and min(short.accepted) < BLOCK - 1


def test_budget_one_is_a_chain_of_one_draft(target, drafter):
    """One node is the drafter's top-1 at position 1: the rounds of a block-2 chain with that draft."""
    draft = drafter_draft_fn(drafter, head_of(target))
    for prompt in PROMPTS:
        tree = tree_generate(target, prompt, drafter_distribution_fn(drafter, head_of(target)), budget=1)
        chain = speculative_generate(
            target,
            prompt,
            lambda c, x: draft(c, x)[:1],
            block_size=2,
            target_layer_ids=LAYER_IDS,
            eos_token_ids=(),
            max_new_tokens=MAX_NEW,
        )
        assert tree == chain


@pytest.mark.parametrize("max_new", [1, 2, 4, 5, 9])
def test_max_new_tokens_cuts_a_long_accept(target, greedy, max_new):
    prompt = PROMPTS[0]
    continuation = greedy[tuple(prompt)]
    got = tree_generate(target, prompt, ranked(prompt, continuation, 1), budget=14, max_new=max_new)
    assert got.tokens == continuation[:max_new]
    assert len(got.accepted) == -(-(max_new - 1) // BLOCK)


@pytest.mark.parametrize("at", [0, 1, 5, 6])
def test_stops_at_eos_inside_an_accepted_path_and_keeps_it(target, greedy, at):
    prompt = PROMPTS[2]
    continuation = greedy[tuple(prompt)]
    eos = continuation[at]
    got = tree_generate(target, prompt, ranked(prompt, continuation + [0] * BLOCK, 1), budget=14, eos={eos})
    assert got.tokens == continuation[: continuation.index(eos) + 1]


def test_a_sliding_window_target_is_refused(tmp_path):
    path = build_target(tmp_path / "mistral", "mistral", layers=4)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    flat = lambda committed, context: torch.zeros(BLOCK - 1, model.config.vocab_size)  # noqa: E731
    with pytest.raises(ValueError, match="all full attention.*without --tree-budget"):
        tree_generate(model, [5, 6, 7], flat, budget=4)


# --- the report and the CLI -----------------------------------------------------------------------


def test_eval_reports_trees_next_to_an_unchanged_chain(target_dir, drafter_dir, tmp_path, capsys):
    data = tmp_path / "heldout.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "Count from 3 to 7."}, {"role": "assistant", "content": "3 4"}]},
        {"prompt": "Repeat: red cat.", "response": "red cat"},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    chain = evaluate_drafter(drafter_dir, target_dir, data, max_new_tokens=10)
    report = evaluate_drafter(drafter_dir, target_dir, data, max_new_tokens=10, tree_budgets=(2, 8))
    assert chain.trees == [] and {**asdict(report), "trees": []} == asdict(chain)  # the chain figures unchanged
    assert [t.budget for t in report.trees] == [2, 8]
    for tree in report.trees:
        assert sum(tree.accepted_histogram) == tree.rounds > 0 and 1 <= tree.tau <= BLOCK
        assert tree.same_tokens_as_chain == 2  # float32 on the CPU: the tree's greedy output is the chain's

    args = [
        "eval",
        "--drafter",
        str(drafter_dir),
        "--target",
        str(target_dir),
        "--data",
        str(data),
        "--max-new-tokens",
        "10",
    ]
    assert main([*args, "--tree-budget", "2,8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(asdict(report)))
    assert main([*args, "--tree-budget", "8"]) == 0
    text = capsys.readouterr().out
    assert f"tau {report.tau:.3f}" in text and f"tree budget 8: tau {report.trees[1].tau:.3f}" in text
    for bad, why in [("0", "at least 1"), ("16,x", "comma-separated")]:
        with pytest.raises(SystemExit) as exit_:
            main([*args, "--tree-budget", bad])
        assert exit_.value.code == 2 and why in capsys.readouterr().err
