"""DFlash2's two additions to the DFlash drafter (shared/reference/dspark-dflash2.md 2.1): the grouped dynamic causal
convolution around each attention and MLP sublayer, and the candidate selector after the target's head.

Convolution (per layer: `attention_conv`, `mlp_conv`). For a sublayer f with (normed) input h of a block [B, H]:

    delta = kernel_projection(h)                     [B, 2, k, H / g]: an input and an output kernel per position
    y[t]  = sum_{o < k} (base[0, o] + delta[t, 0, o]) * h[t - o]      (delta shared by the g channels of a group)
    z     = f(y)
    out[t] = sum_{o < k} (base[1, o] + delta[t, 1, o]) * z[t - o]

with every tap t - o before the block's first slot zero: a block never reads another block's rows. Training packs
many blocks, [N, B, H], so the shift runs along the block axis only. At initialisation base[:, 0] = 1, the other
taps 0 and kernel_projection 0: the identity, so a fresh DFlash2 drafter starts as the DFlash drafter it wraps.

Selector (`candidate_selector`). Slot t's unary top-K of the draft's logits, rescored with the predecessor token:

    score[t, c] = unary[t, c] + < predecessor_codebook[prev_t] * hidden_projection(h_t), successor_codebook[c] >

The codebooks are bare [V, r] parameters, so their state_dict names carry no `.weight`, as the released checkpoint
stores them. Serving walks the block from the anchor (prev of slot 1 is the anchor, then the token chosen); training
scores the teacher-forced true predecessor (consumer/objectives/selector.py).

Pure torch: the training model (consumer/modeling/model.py) and the exported model code (consumer/hf_dflash2.py) use it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def grouped_dynamic_causal_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """x [..., B, H] (B: the block axis), delta [..., B, k, G], base [k, H] -> [..., B, H]; taps stay inside the
    block."""
    *lead, block, hidden = x.shape
    kernel, groups = base.shape[0], delta.shape[-1]
    grouped = x.reshape(*lead, block, groups, hidden // groups)
    out = torch.zeros_like(grouped)
    for o in range(min(kernel, block)):
        shifted = grouped if o == 0 else F.pad(grouped[..., : block - o, :, :], (0, 0, 0, 0, o, 0))
        coefficient = base[o].to(x.dtype).view(groups, hidden // groups) + delta[..., o, :, None].to(x.dtype)
        out = out + coefficient * shifted
    return out.reshape(x.shape)


class GroupedDynamicCausalConv(nn.Module):
    """The input and output convolutions of one sublayer; both kernels come from the sublayer's input."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"hidden_size {hidden_size} is not a multiple of conv_group_size {group_size}")
        self.kernel_size, self.groups = kernel_size, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity: one tap of weight 1 on the position itself, nothing dynamic."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [..., B, H] -> (the convolved sublayer input, the output kernel for finish)."""
        delta = self.kernel_projection(h).unflatten(-1, (2, self.kernel_size, self.groups))
        return grouped_dynamic_causal_conv(h, delta[..., 0, :, :], self.base_kernel[0]), delta[..., 1, :, :]

    def finish(self, z: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return grouped_dynamic_causal_conv(z, delta, self.base_kernel[1])


class CandidateSelector(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int, init_std: float = 0.02) -> None:
        super().__init__()
        if not 1 <= top_k <= vocab_size:
            raise ValueError(f"selector_top_k {top_k} must be in [1, vocab_size {vocab_size}]")
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        for param in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            nn.init.normal_(param, std=init_std)

    def context(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """[..., r]: predecessor_codebook[prev] * hidden_projection(hidden), the query side of the bilinear term."""
        projected = self.hidden_projection(hidden)
        return self.predecessor_codebook[prev_ids].to(projected.dtype) * projected

    def pairwise(self, context: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """[..., K]: < context, successor_codebook[c] > for each candidate c."""
        successors = self.successor_codebook[candidates].to(context.dtype)
        return (context.unsqueeze(-2) * successors).sum(-1)

    def scores(
        self, hidden: torch.Tensor, prev_ids: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor
    ) -> torch.Tensor:
        """Scores [..., K] of the candidates (unary: their logits) given each slot's predecessor prev_ids [...]."""
        return unary.float() + self.pairwise(self.context(hidden, prev_ids), candidates).float()

    def walk(
        self,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        anchor_ids: torch.Tensor,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Serving: the path through a block's drafting slots from the anchor.

        hidden [b, D, H] and logits [b, D, V] of the D drafting slots, anchor_ids [b]. Greedy (argmax of the scores)
        at temperature 0, else sampled from softmax(scores / T). Returns (path [b, D], candidates [b, D, K] in
        descending unary order, scores [b, D, K] of each slot given the path's predecessor); softmax(scores / T) is
        the draft's q over the candidates that lossless rejection sampling needs.
        """
        unary, candidates = torch.topk(logits, self.top_k, dim=-1)
        projected = self.hidden_projection(hidden)
        prev, path, rows = anchor_ids, [], []
        for slot in range(hidden.shape[1]):
            context = self.predecessor_codebook[prev].to(projected.dtype) * projected[:, slot]
            score = unary[:, slot].float() + self.pairwise(context, candidates[:, slot]).float()
            if temperature > 0:
                pick = torch.multinomial(torch.softmax(score / temperature, -1), 1, generator=generator)[:, 0]
            else:
                pick = score.argmax(-1)
            prev = candidates[:, slot].gather(-1, pick[:, None])[:, 0]
            path.append(prev)
            rows.append(score)
        return torch.stack(path, 1), candidates, torch.stack(rows, 1)
