"""A DDTree draft tree (liranringel/ddtree): the likeliest continuations of one DFlash block, best first.

Why a tree: a chain of B-1 drafts is lost at its first miss, while the drafter's distribution at a
position usually holds the target's token among its top few. DDTree spends a node budget on the
likeliest token paths of one drafter pass instead, and the target checks them all in one forward under
a tree attention mask. Training-free: any DFlash drafter's per-position distributions build it.

The tree: node 0 is the root (the last committed token); a node at depth k is a token for block
position k (1..B-1) and its score is the sum of the drafter's log-probabilities along its path (the
product of the probabilities; the drafter's positions are scored independently, as one non-causal
pass predicts them). Best-first keeps a heap of frontier candidates, starting with the top-1 token
at depth 1; taking a node offers its next-ranked sibling and its top-1 child. A candidate never scores
above the node that offered it, so nodes are taken in non-increasing score and the tree is the
`budget` highest-scoring paths (ties broken by rank, lower first), exactly DDTree's `build_ddtree_tree`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from dflash_ring.common.refusal import Refusal


class TreeTargetError(Refusal, ValueError):
    """A target that tree verification cannot verify exactly (check_tree_target): the user's choice of target
    with --tree-budget, so one line at the CLI (exit 2)."""


@dataclass(frozen=True)
class DraftTree:
    """Nodes 1..N in the order best-first took them; index 0 is the root."""

    tokens: list[int]  # [N]: node i's token is tokens[i - 1]
    depths: list[int]  # [N]: node i's block position, 1..B-1
    parents: list[int]  # [N + 1]: parents[0] = -1; a parent always precedes its children
    scores: list[float]  # [N]: log-probability of node i's path, non-increasing

    @property
    def size(self) -> int:
        return len(self.tokens)

    def children(self) -> list[dict[int, int]]:
        """For each node, its children by token (a node's children carry distinct tokens)."""
        kids: list[dict[int, int]] = [{} for _ in self.parents]
        for node in range(1, len(self.parents)):
            kids[self.parents[node]][self.tokens[node - 1]] = node
        return kids

    def visibility(self) -> torch.Tensor:
        """[N + 1, N + 1] bool: row i is True at node i and at each of its ancestors, nowhere else."""
        seen = torch.zeros(len(self.parents), len(self.parents), dtype=torch.bool)
        seen[0, 0] = True
        for node in range(1, len(self.parents)):
            seen[node] = seen[self.parents[node]]  # parents precede children: that row is complete
            seen[node, node] = True
        return seen


def build_draft_tree(log_probs: torch.Tensor, budget: int) -> DraftTree:
    """The `budget` best paths of the per-position log-probabilities [B-1, V] (block positions 1..B-1)."""
    if budget < 1:
        raise ValueError(f"tree budget must be at least 1 draft node, got {budget}")
    depth_limit, vocab = log_probs.shape
    top_lp, top_ids = torch.topk(log_probs.float().cpu(), k=min(budget, vocab), dim=-1)
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    width = len(top_lp[0])
    # (-score, ranks along the path, parent node, depth, rank at this depth); ranks break score ties.
    heap = [(-top_lp[0][0], (0,), 0, 1, 0)]
    tokens: list[int] = []
    depths: list[int] = []
    parents = [-1]
    scores: list[float] = []
    while heap and len(tokens) < budget:
        neg, ranks, parent, depth, rank = heapq.heappop(heap)
        score = -neg
        tokens.append(top_ids[depth - 1][rank])
        depths.append(depth)
        parents.append(parent)
        scores.append(score)
        node = len(tokens)
        if rank + 1 < width:
            sibling = score - top_lp[depth - 1][rank] + top_lp[depth - 1][rank + 1]
            heapq.heappush(heap, (-sibling, ranks[:-1] + (rank + 1,), parent, depth, rank + 1))
        if depth < depth_limit:
            heapq.heappush(heap, (-(score + top_lp[depth][0]), ranks + (0,), node, depth + 1, 0))
    return DraftTree(tokens=tokens, depths=depths, parents=parents, scores=scores)


def tree_attention_mask(
    tree: DraftTree, prefix_length: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """[1, 1, N + 1, prefix + N + 1] additive mask: every node sees the whole committed prefix (the KV cache)
    and, among the tree's nodes, exactly its ancestors and itself.

    Additive (0 / dtype min), not bool: transformers 5.x passes a 4D mask through unchanged to the
    attention function (`_preprocess_mask_arguments` returns it as is in 5.17 and 5.24), and eager adds it
    to the scores while SDPA accepts either, so a float mask means the same on both paths.
    """
    nodes = tree.size + 1
    mask = torch.zeros(1, 1, nodes, prefix_length + nodes, dtype=dtype, device=device)
    hidden = ~tree.visibility().to(device)
    mask[0, 0, :, prefix_length:].masked_fill_(hidden, torch.finfo(dtype).min)
    return mask


def follow_greedy(tree: DraftTree, verified: list[int]) -> tuple[list[int], int]:
    """The accepted path (node indices from the root) and the bonus token, given the target's argmax at
    every node (`verified[i]`: its next token after node i's path): from the root, step to the child
    that carries the target's token while there is one."""
    children = tree.children()
    path = [0]
    while (child := children[path[-1]].get(verified[path[-1]])) is not None:
        path.append(child)
    return path, verified[path[-1]]


def check_tree_target(attn_implementation: str | None, cache: DynamicCache) -> None:
    """Refuse what a tree mask cannot verify exactly. Flash and flex kernels take no additive 4D mask. A
    sliding-window layer keeps only its window (and a 4D mask bypasses the window) and a linear-attention
    layer folds every token into its state, so neither can drop the rejected branches."""
    if attn_implementation not in ("eager", "sdpa"):
        raise TreeTargetError(
            f"tree verification runs on eager or sdpa attention, not {attn_implementation!r}: load the target "
            "with attn_implementation='sdpa'"
        )
    kinds = {type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer}
    if kinds:
        raise TreeTargetError(
            f"tree verification needs a target whose layers are all full attention; this one has {sorted(kinds)} "
            "cache layers (sliding-window or linear attention): evaluate it without --tree-budget"
        )


def keep_path(cache: DynamicCache, past_length: int, path: list[int]) -> None:
    """Keep, after the first `past_length` positions, only the tree nodes on the accepted path, in order.

    A gather of the path's rows into place followed by a crop: the nodes off the path are dropped
    without re-running the accepted ones. Valid because each node's keys and values were computed
    seeing exactly its ancestors, as a plain forward of the committed sequence would."""
    index = torch.tensor(path, dtype=torch.long)
    for layer in cache.layers:
        for states in (layer.keys, layer.values):
            rows = index.to(states.device) + past_length
            states[..., past_length : past_length + len(path), :] = states.index_select(-2, rows)
    cache.crop(-(cache.get_seq_length() - past_length - len(path)))  # negative: tokens to drop, in 5.17 and 5.24
