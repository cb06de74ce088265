"""DSpark's two small heads on the DFlash backbone: the Markov logit bias and the confidence (arXiv 2607.05147).

Slot k of a DSpark block drafts token anchor + k + 1, and its logits are the backbone's through the frozen target
head plus a low-rank bias from the token before it, prev_k (the anchor for k = 0; teacher-forced in training, the
token sampled at slot k - 1 when serving):

    logits_k = lm_head(h_k) + markov_w2 @ e_k
    vanilla: e_k = W1[prev_k]
    gated:   e_k = sigmoid(gate_proj([h_k ; W1[prev_k]])) * W1[prev_k]
    rnn:     g, c, o = joint_proj([s_{k-1} ; W1[prev_k] ; h_k]);  s_k = sigmoid(g) s_{k-1} + (1 - sigmoid(g)) tanh(c);
             e_k = tanh(o);  s_{-1} = 0

with W1 = markov_w1 (an embedding over the target vocabulary, [V, r]) and h_k the backbone's final-normed output.
The head is split into `features` (e_k, [.., r]: cheap) and markov_w2 (the [V, r] product), so the loss can form
the bias inside its chunks over the vocabulary (consumer/objectives/head_loss.py) instead of materialising
[rows, V] for the whole step.

The confidence head estimates P(slot k accepted | every earlier slot accepted): c_k = sigmoid(proj([h_k ;
W1[prev_k]])), a Linear(H + r, 1) with bias, computed in fp32 (DeepSpec's `AcceptRatePredictor` with
`confidence_head_with_markov`, the released setting, the only one SGLang loads).

Parameter names are DeepSeek's flat `Qwen3DSparkModel` names: markov_head.markov_w1.weight,
markov_head.markov_w2.weight, markov_head.{gate_proj,joint_proj}.*, confidence_head.proj.{weight,bias}.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_ring.common.config.schema import ConfigError
from dflash_ring.consumer.modeling.target_head import HeadSpec


def check_dspark_head(spec: HeadSpec) -> None:
    """DSpark's layout has no key for a target head's transforms: the engines that serve it embed the block with the
    plain embedding and add the Markov bias to the plain lm_head product, so a target whose head scales its embedding
    or its logits (Gemma, Granite, Cohere, Falcon-H1) would be served otherwise than trained: refused."""
    if spec.embed_scale is not None or spec.logit_multiplier is not None or spec.logit_softcap is not None:
        raise ConfigError(
            f"arch 'dspark' needs a target whose head is a plain embedding and lm_head; this target's is "
            f"not ({spec.describe()}): the DSpark layout the engines load has no key for it. Train "
            "arch = 'dflash' for this target"
        )


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, rank: int, hidden_size: int, kind: str) -> None:
        super().__init__()
        if kind not in ("vanilla", "gated", "rnn"):
            raise ValueError(f"markov head kind {kind!r} is not 'vanilla', 'gated' or 'rnn'")
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def prev_embedding(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """W1[prev]: [.., r]; also the confidence head's second input."""
        return self.markov_w1(prev_ids)

    def features(self, hidden: torch.Tensor, prev_emb: torch.Tensor) -> torch.Tensor:
        """e_k [N, B, r] from the backbone output hidden [N, B, H] and W1[prev] [N, B, r]: bias_k = markov_w2(e_k)."""
        if self.kind == "vanilla":
            return prev_emb
        hidden = hidden.to(prev_emb.dtype)
        if self.kind == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([hidden, prev_emb], dim=-1))) * prev_emb
        state = prev_emb.new_zeros(prev_emb.shape[0], self.rank)
        out = []
        for k in range(prev_emb.shape[1]):  # the recurrence runs along the block, B steps
            gate, candidate, output = self.joint_proj(torch.cat([state, prev_emb[:, k], hidden[:, k]], -1)).chunk(3, -1)
            gate = torch.sigmoid(gate)
            state = gate * state + (1 - gate) * torch.tanh(candidate)
            out.append(torch.tanh(output))
        return torch.stack(out, dim=1)

    def bias(self, features: torch.Tensor) -> torch.Tensor:
        """The logit bias [.., V] of features e (serving and tests; the loss forms it chunk by chunk)."""
        return F.linear(features.to(self.markov_w2.weight.dtype), self.markov_w2.weight)


class ConfidenceHead(nn.Module):
    def __init__(self, hidden_size: int, rank: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size + rank, 1)

    def forward(self, hidden: torch.Tensor, prev_emb: torch.Tensor) -> torch.Tensor:
        """Confidence logits [N, B] (fp32, autocast or not) from hidden [N, B, H] and W1[prev] [N, B, r]."""
        with torch.autocast(hidden.device.type, enabled=False):
            features = torch.cat([hidden.float(), prev_emb.float()], dim=-1)
            return F.linear(features, self.proj.weight.float(), self.proj.bias.float()).squeeze(-1)
