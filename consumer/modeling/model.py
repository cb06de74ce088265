"""DFlash drafter: Qwen3 layers whose attention also reads the target's hidden states.

Training packs several sequences without padding and drafts many blocks per
sequence in one pass. Each block is [anchor token, MASK x (B-1)]; its queries
may see the target context strictly before the anchor (at inference the
anchor's own target state does not exist yet) and the B tokens of their own
block, and nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from dflash_ring.consumer.modeling.qwen3_blocks import Qwen3MLP, Qwen3RMSNorm, rope_frequencies, rotate_half

# The frozen head lives in target_head.py; re-exported for callers that import it from here.
from dflash_ring.consumer.modeling.head_loader import load_target_head  # noqa: F401
from dflash_ring.consumer.modeling.target_head import EMBED_KEYS, LM_HEAD_KEYS, FrozenTargetHead  # noqa: F401

if TYPE_CHECKING:  # built from consumer/drafter_hf_config.model_config: no transformers import at a drafter's start
    from transformers import Qwen3Config


def cu_seqlens_from_lengths(lengths: Sequence[int] | torch.Tensor) -> torch.Tensor:
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    return F.pad(lengths.cumsum(0), (1, 0))


@dataclass(frozen=True)
class Anchors:
    """Block starts in a packed batch, grouped by sequence so attention never crosses sequences."""

    positions: torch.Tensor  # [N] int64 packed index of each anchor, ascending within a sequence
    cu_anchors: torch.Tensor  # [num_seqs + 1]: sequence i owns positions[cu_anchors[i]:cu_anchors[i + 1]]
    cu_seqlens: torch.Tensor  # [num_seqs + 1]: sequence i owns tokens [cu_seqlens[i], cu_seqlens[i + 1])

    @property
    def num_blocks(self) -> int:
        return self.positions.numel()

    def seq_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """First and one-past-last packed index of each anchor's sequence, [N] each."""
        counts = self.cu_anchors.diff()
        return self.cu_seqlens[:-1].repeat_interleave(counts), self.cu_seqlens[1:].repeat_interleave(counts)


def sample_anchors(
    loss_mask: torch.Tensor, cu_seqlens: torch.Tensor, num_anchors: int, generator: torch.Generator
) -> Anchors:
    """Per sequence, up to num_anchors distinct p with loss_mask[p] and loss_mask[p+1], uniformly.

    The pair condition guarantees each block supervises at least its first
    draft position. Resampled every step; the explicit generator keeps runs reproducible.
    """
    supervised = loss_mask.bool()
    valid = torch.zeros_like(supervised)
    valid[:-1] = supervised[:-1] & supervised[1:]
    ends = cu_seqlens[1:]
    valid[ends[ends > 0] - 1] = False  # p + 1 would belong to the next sequence
    bounds = cu_seqlens.tolist()
    picked: list[torch.Tensor] = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        candidates = valid[start:end].nonzero().squeeze(1) + start
        if candidates.numel() > num_anchors:
            keep = torch.randperm(candidates.numel(), generator=generator, device=generator.device)[:num_anchors]
            candidates = candidates[keep.to(candidates.device)].sort().values
        picked.append(candidates)
    counts = torch.tensor([p.numel() for p in picked], device=cu_seqlens.device)
    positions = torch.cat(picked) if picked else cu_seqlens.new_zeros(0)
    return Anchors(positions=positions, cu_anchors=F.pad(counts.cumsum(0), (1, 0)), cu_seqlens=cu_seqlens)


def block_attention_mask(
    anchors: torch.Tensor,
    ctx_len: int,
    block_size: int,
    sliding_window: int | None = None,
    sliding_causal: bool = True,
) -> torch.Tensor:
    """Boolean [n*B, ctx_len + n*B] mask (True = attend) for n blocks of one sequence.

    Keys are [context 0..ctx_len-1 | block 0 | block 1 | ...]; `anchors` are
    positions within the sequence. Sliding layers follow SpecForge/z-lab: the
    window is per query position (a query at anchor+k keeps the last W keys,
    itself included) and attention inside the block is causal (against z-lab's
    own model: tests/test_peer_conformance.py), unless sliding_causal is False
    (DFlash2: the whole block, as full layers see it; B <= W keeps it inside the window).
    """
    n, device = anchors.numel(), anchors.device
    offsets = torch.arange(block_size, device=device).repeat(n)
    block_ids = torch.arange(n, device=device).repeat_interleave(block_size)
    q_anchor = anchors.repeat_interleave(block_size)[:, None]
    key = torch.arange(ctx_len, device=device)[None, :]
    ctx_visible = key < q_anchor
    block_visible = block_ids[:, None] == block_ids[None, :]
    if sliding_window is not None:
        ctx_visible &= key > q_anchor + offsets[:, None] - sliding_window
        if sliding_causal:
            block_visible &= offsets[None, :] <= offsets[:, None]
    return torch.cat([ctx_visible, block_visible], dim=1)


@dataclass(frozen=True)
class _AttentionGroup:
    """Blocks attended in one SDPA call: a slice of block-token rows and the context keys they may need."""

    rows: slice
    context: slice
    masks: dict[int | None, torch.Tensor]  # by sliding window (None = full attention)


def _attention_groups(
    anchors: Anchors, block_size: int, windows: set[int | None], anchors_per_group: int, sliding_causal: bool = True
) -> list[_AttentionGroup]:
    """Split each sequence's blocks into groups: block-to-block keys grow with group size, so small groups
    keep the mask and the wasted block-block scores small; a group's context stops at its last anchor."""
    seq_starts = anchors.seq_bounds()[0]
    local = anchors.positions - seq_starts
    local_host = local.tolist()
    cu_seq, cu_anc = anchors.cu_seqlens.tolist(), anchors.cu_anchors.tolist()
    groups = []
    for seq in range(len(cu_anc) - 1):
        for first in range(cu_anc[seq], cu_anc[seq + 1], anchors_per_group):
            last = min(first + anchors_per_group, cu_anc[seq + 1])
            ctx_len = local_host[last - 1]  # anchors are sorted: the last one sees the most context
            masks = {
                w: block_attention_mask(local[first:last], ctx_len, block_size, w, sliding_causal) for w in windows
            }
            groups.append(
                _AttentionGroup(
                    rows=slice(first * block_size, last * block_size),
                    context=slice(cu_seq[seq], cu_seq[seq] + ctx_len),
                    masks=masks,
                )
            )
    return groups


FLEX_TILE = 128  # flex_attention's default block size; the sparsity below is computed per tile of it


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class FlexLayout:
    """One flex_attention call over all blocks of a packed batch.

    Keys are [context (padded to a tile) | block tokens (padded to a tile)]. The
    tile lists name only the context tiles between a tile's first sequence start
    and its last anchor, plus the tiles of its own blocks, so the kernel computes
    about what the mask lets through, with no per-sequence split and no dense mask.

    Context tiles that every row of a query tile may see whole (after the latest sequence start and
    before the earliest anchor of the tile's blocks: most of them) are listed as full tiles, on which
    the kernel skips the mask function; only the edge tiles and the block tiles evaluate it.
    Sliding-window masks list only the tiles inside the window of some row, and as full those inside the
    window of every row.
    """

    num_queries: int  # real block-token rows; the rest up to a tile is padding
    context_len: int  # padded context length: block keys start here
    masks: dict[int | None, BlockMask]  # by sliding window (None = full attention)


def _tile_rows(
    slot: torch.Tensor, ranges: list[tuple[torch.Tensor, torch.Tensor]], kv_tiles: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query tile, the kv tiles of consecutive ranges [lo, lo + count): (counts, index rows) for BlockMask."""
    rows = torch.zeros_like(slot.expand(len(ranges[0][0]), -1))
    begin = torch.zeros_like(ranges[0][1])
    for lo, count in ranges:
        rows = torch.where(slot >= begin[:, None], lo[:, None] + slot - begin[:, None], rows)
        begin = begin + count
    return begin.to(torch.int32), rows.clamp(max=kv_tiles - 1).to(torch.int32)


def flex_layout(
    anchors: Anchors, context_len: int, block_size: int, windows: set[int | None], sliding_causal: bool = True
) -> FlexLayout:
    """sliding_causal: as block_attention_mask's (False: a sliding layer sees its whole block, DFlash2)."""
    n, dev = anchors.num_blocks, anchors.positions.device
    rows = n * block_size
    q_len, t_pad = _round_up(max(rows, 1), FLEX_TILE), _round_up(context_len, FLEX_TILE)
    anchor = anchors.positions
    start = anchors.seq_bounds()[0]
    tiles = torch.arange(q_len // FLEX_TILE, device=dev)
    first = (tiles * FLEX_TILE // block_size).clamp(max=max(n - 1, 0))
    last = (((tiles + 1) * FLEX_TILE - 1) // block_size).clamp(max=max(n - 1, 0))
    if n:
        ctx_lo, ctx_hi = start[first] // FLEX_TILE, (anchor[last] + FLEX_TILE - 1) // FLEX_TILE
    else:
        ctx_lo = ctx_hi = torch.zeros_like(tiles)
    ctx_hi = torch.maximum(ctx_hi, ctx_lo)
    blk_lo = (t_pad + first * block_size) // FLEX_TILE
    blk_hi = torch.maximum((t_pad + (last + 1) * block_size + FLEX_TILE - 1) // FLEX_TILE, blk_lo + 1)
    kv_tiles = (t_pad + q_len) // FLEX_TILE
    slot = torch.arange(kv_tiles, device=dev)[None, :]  # BlockMask reads the kv tile count off this width
    n_blk = blk_hi - blk_lo
    # the tile's blocks first..last (padding rows act as the last block, as in the mask below)
    span = (first[:, None] + torch.arange(FLEX_TILE // block_size + 2, device=dev)[None]).minimum(last[:, None])

    def tile_lists(window: int | None):
        """(partial, full) kv tiles per query tile. A window moves both lower edges up: no row sees a key at or
        before anchor - window (offset 0, the loosest), and every row sees a key from anchor + B - window on
        (the last offset of the tile's latest anchor), so the tiles a window cuts off are not listed at all."""
        lo = ctx_lo
        if not n:
            full_lo = full_hi = ctx_hi
        else:
            lowest = start[span].amax(1)
            if window is not None:
                lo = torch.maximum(start[first], anchor[first] - window + 1) // FLEX_TILE
                lowest = torch.maximum(lowest, anchor[span].amax(1) + block_size - window)
            full_lo = (lowest + FLEX_TILE - 1) // FLEX_TILE
            full_hi = anchor[span].amin(1) // FLEX_TILE
            whole = full_hi > full_lo
            full_lo, full_hi = torch.where(whole, full_lo, ctx_hi), torch.where(whole, full_hi, ctx_hi)
        partial = _tile_rows(slot, [(lo, full_lo - lo), (full_hi, ctx_hi - full_hi), (blk_lo, n_blk)], kv_tiles)
        return partial, _tile_rows(slot, [(full_lo, full_hi - full_lo)], kv_tiles)

    safe_anchor = anchor if n else anchor.new_zeros(1)
    safe_start = start if n else start.new_zeros(1)
    last_block = max(n - 1, 0)

    def rule(window: int | None):
        def mask_mod(b, h, q_idx, kv_idx):
            q_block, offset = q_idx // block_size, q_idx % block_size
            a = safe_anchor[q_block.clamp(max=last_block)]
            s = safe_start[q_block.clamp(max=last_block)]
            ctx_ok = (kv_idx >= s) & (kv_idx < a)
            key = kv_idx - t_pad
            blk_ok = key // block_size == q_block
            if window is not None:
                ctx_ok = ctx_ok & (kv_idx > a + offset - window)
                if sliding_causal:
                    blk_ok = blk_ok & (key % block_size <= offset)
            return torch.where(kv_idx < t_pad, ctx_ok, blk_ok)

        return mask_mod

    def block_mask(window: int | None) -> BlockMask:
        (counts, indices), (full_counts, full_indices) = tile_lists(window)
        return BlockMask.from_kv_blocks(
            counts[None, None],
            indices[None, None],
            full_counts[None, None],
            full_indices[None, None],
            BLOCK_SIZE=FLEX_TILE,
            mask_mod=rule(window),
            seq_lengths=(q_len, t_pad + q_len),
        )

    masks = {w: block_mask(w) for w in windows}
    return FlexLayout(num_queries=rows, context_len=t_pad, masks=masks)


_compiled_flex = None

# Triton tile sizes of the flex kernels by head dim, where Inductor's defaults were measured slower on the H200
# (docs/benchmarks.md, issue 21): at head dim 256 (Qwen3.6-27B's width) a 128 x 64 forward tile with 8 warps and
# 2 stages, which the backward kernel shares, ran a 2048-window layer of the ddtree recipe in 4.7 + 36.9 ms against
# 7.4 + 47.4 ms with the defaults. Head dim 128 (Qwen3-8B) keeps the defaults.
FLEX_KERNEL_OPTIONS: dict[int, dict[str, int]] = {256: {"BLOCK_M": 128, "BLOCK_N": 64, "num_stages": 2, "num_warps": 8}}


def flex_kernel_options(q: torch.Tensor, k: torch.Tensor) -> dict[str, int | bool] | None:
    """The flex kernels' options for these queries and keys: the tile sizes by head dim (FLEX_KERNEL_OPTIONS), and
    IS_DIVISIBLE where both lengths are whole tiles (flex_layout pads them to FLEX_TILE; every block size the kernels
    use divides it). Compiled with dynamic shapes, Inductor cannot prove the lengths divisible and builds kernels that
    bound-check every load and store; told so, they run nearly as a static compile's do, with no recompile per shape
    (issue 45, bench/attention.py on an H100: a 2,048-window ddtree layer at the 27B width 41.2 -> 35.1 ms forward +
    backward, a static compile 32.5; in the step, flex's kernels 262 -> 237 ms)."""
    options = dict(FLEX_KERNEL_OPTIONS.get(q.shape[-1], {}))
    if q.shape[-2] % FLEX_TILE == 0 and k.shape[-2] % FLEX_TILE == 0:
        options["IS_DIVISIBLE"] = True
    return options or None


def _flex_attention(q, k, v, block_mask: BlockMask) -> torch.Tensor:
    """Compiled on CUDA (fused kernel, built once per process); eager elsewhere (tests on CPU).

    K/V stay grouped (enable_gqa) rather than repeated to the query heads: measured at head dim 256 (issue 45), the
    repeat saved ~3% of the attention's time while its K/V gradients, each head's cast to bf16 before the group's
    sum, differed 10x more from the grouped kernel's (which sums the group in fp32)."""
    global _compiled_flex
    if q.is_cuda:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=True)
        return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=True, kernel_options=flex_kernel_options(q, k))
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)


# cuDNN attention builds a graph per new shape (~12 ms of CPU per call, seen on H200); every group
# has its own key length, so it would rebuild on nearly every call. The other kernels take any shape.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [L, heads, head_dim]; cos/sin: [L, head_dim]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class DFlashAttention(nn.Module):
    """Queries from block tokens only; keys/values from [context ; block], sharing k_proj/v_proj/k_norm."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_groups = config.num_attention_heads // config.num_key_value_heads
        hidden, kv_width = config.hidden_size, config.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_width, bias=False)
        self.v_proj = nn.Linear(hidden, kv_width, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.sliding_window: int | None = config.sliding_window if sliding else None

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (-1, self.head_dim))

    def _expand_kv(self, x: torch.Tensor) -> torch.Tensor:
        """[L, kv_heads, d] -> [1, heads, L, d]; query head h reads kv head h // groups, as in HF repeat_kv."""
        return x.transpose(0, 1).repeat_interleave(self.num_kv_groups, dim=0)[None]

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        block_rope: tuple[torch.Tensor, torch.Tensor],
        context_rope: tuple[torch.Tensor, torch.Tensor],
        groups: list[_AttentionGroup] | FlexLayout,
    ) -> torch.Tensor:
        q = _apply_rope(self.q_norm(self._heads(self.q_proj(x))), *block_rope)
        k_block = _apply_rope(self.k_norm(self._heads(self.k_proj(x))), *block_rope)
        k_context = _apply_rope(self.k_norm(self._heads(self.k_proj(context))), *context_rope)
        v_block, v_context = self._heads(self.v_proj(x)), self._heads(self.v_proj(context))
        if isinstance(groups, FlexLayout):
            return self.o_proj(self._flex(q, k_context, k_block, v_context, v_block, groups).flatten(1))
        outputs = []
        with sdpa_kernel(_SDPA_BACKENDS):
            for group in groups:
                k = torch.cat([k_context[group.context], k_block[group.rows]])
                v = torch.cat([v_context[group.context], v_block[group.rows]])
                out = F.scaled_dot_product_attention(  # 4-D inputs: fused kernels take no other rank
                    q[group.rows].transpose(0, 1)[None],
                    self._expand_kv(k),
                    self._expand_kv(v),
                    attn_mask=group.masks[self.sliding_window],
                )
                outputs.append(out[0].transpose(0, 1))
        attended = torch.cat(outputs) if outputs else q  # no blocks: q is already empty
        return self.o_proj(attended.flatten(1))

    def _flex(self, q, k_context, k_block, v_context, v_block, layout: FlexLayout) -> torch.Tensor:
        rows = q.shape[0]
        q_len = layout.masks[self.sliding_window].seq_lengths[0]

        def keys(context: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
            pad_ctx = context.new_zeros(layout.context_len - context.shape[0], *context.shape[1:])
            pad_blk = block.new_zeros(q_len - rows, *block.shape[1:])
            return torch.cat([context, pad_ctx, block, pad_blk]).transpose(0, 1)[None]

        query = torch.cat([q, q.new_zeros(q_len - rows, *q.shape[1:])]).transpose(0, 1)[None]
        out = _flex_attention(
            query, keys(k_context, k_block), keys(v_context, v_block), layout.masks[self.sliding_window]
        )
        return out[0, :, :rows].transpose(0, 1)


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        block_rope: tuple[torch.Tensor, torch.Tensor],
        context_rope: tuple[torch.Tensor, torch.Tensor],
        groups: list[_AttentionGroup] | FlexLayout,
    ) -> torch.Tensor:
        # The fused context is not re-normed per layer (z-lab): only block tokens get input_layernorm.
        x = x + self.self_attn(self.input_layernorm(x), context, block_rope, context_rope, groups)
        return x + self.mlp(self.post_attention_layernorm(x))


def block_size_of(config: Qwen3Config) -> int:
    """Newer checkpoints move block_size into dflash_config; SGLang reads both, so do we (DSpark: top-level only)."""
    nested = getattr(config, "dflash_config", None) or {}
    return int(nested.get("block_size", getattr(config, "block_size", 0)))


def _drafter_key(config: Qwen3Config, key: str) -> Any:
    """A DFlash setting where the layout keeps it: nested in dflash_config (z-lab), or top-level (DeepSeek's DSpark)."""
    nested = getattr(config, "dflash_config", None) or {}
    return nested[key] if key in nested else getattr(config, key)


class DFlashDraftModel(nn.Module):
    """Parameter names match the public checkpoints exactly (no prefix, no embed/lm_head)."""

    sample_from_anchor = False  # slot 0 is the given anchor; slots 1..B-1 draft
    # Sliding layers attend causally inside the block (what the engines serve when config.json names no is_causal);
    # DFlash2 trains them bidirectional there and its export writes is_causal: false.
    sliding_causal = True

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.config = config
        self.block_size = block_size_of(config)
        self.mask_token_id = int(_drafter_key(config, "mask_token_id"))
        self.target_layer_ids = list(_drafter_key(config, "target_layer_ids"))
        if self.block_size < 2:
            raise ValueError("config has no block_size >= 2 (top level or in dflash_config)")
        hidden = config.hidden_size
        self.layers = nn.ModuleList(self._make_layer(config, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        # A plain fp32 tensor, not a buffer (HF's inv_freq is an nn.Buffer, which would re-register):
        # model.to(bfloat16) must not round the RoPE frequencies, serving stacks keep them in fp32.
        inv_freq, self._rope_scaling = rope_frequencies(config)
        self._inv_freq = inv_freq.to(torch.float32)
        self._windows = {layer.self_attn.sliding_window for layer in self.layers}
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=config.initializer_range)

    def _make_layer(self, config: Qwen3Config, layer_idx: int) -> nn.Module:
        return DFlashDecoderLayer(config, layer_idx)

    def compile_layers(self, include_fc: bool = False) -> None:
        """torch.compile each decoder layer in place (one graph serves all: they share code and shapes), fusing
        norms, RoPE, SiLU and residual adds around the matmuls; state_dict names are unchanged. `include_fc`
        compiles fc too: under FP8 (consumer/modeling/fp8.py) its input's rowwise cast, a pass over all [T, n*H]
        features, is fused only there; in bf16 fc is one matmul that compiling would not speed up."""
        for layer in self.layers:
            layer.compile(dynamic=True)
        if include_fc:
            self.fc.compile(dynamic=True)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [L, head_dim] exactly as Qwen3RotaryEmbedding computes them."""
        freqs = positions[:, None].float() * self._inv_freq.to(positions.device)[None, :]
        angles = torch.cat([freqs, freqs], dim=-1)
        return (angles.cos() * self._rope_scaling).to(dtype), (angles.sin() * self._rope_scaling).to(dtype)

    def forward(
        self,
        context: torch.Tensor,
        input_ids: torch.Tensor,
        anchors: Anchors,
        head: FrozenTargetHead,
        *,
        attention: str = "sdpa",
        anchors_per_group: int = 64,
    ) -> torch.Tensor:
        """Draft hidden states [N, B, H] (final-normed) for every anchor of a packed batch.

        context: [T, n*H] target features (layers target_layer_ids, concatenated on channels);
        input_ids: [T]; the anchors index both. Position 0 of each block is the anchor itself;
        head.logits(out[:, k]) is the draft for token anchor + k. attention: "sdpa" runs one
        masked SDPA call per group of anchors_per_group blocks; "flex" one block-sparse
        flex_attention call for all blocks (same result, far less wasted work on a GPU).
        """
        if context.shape[-1] != self.fc.in_features:
            raise ValueError(f"context width {context.shape[-1]} != {self.fc.in_features} (n_target_layers * hidden)")
        if context.shape[0] != input_ids.shape[0] or context.shape[0] != int(anchors.cu_seqlens[-1]):
            raise ValueError("context, input_ids and cu_seqlens disagree on the packed length")
        block = self.block_size
        ids = input_ids.new_full((anchors.num_blocks, block), self.mask_token_id)
        ids[:, 0] = input_ids[anchors.positions]
        x = head.embed(ids.reshape(-1)).to(self.fc.weight.dtype)
        fused = self.hidden_norm(self.fc(context.to(self.fc.weight.dtype)))

        token_starts = anchors.cu_seqlens[:-1].repeat_interleave(anchors.cu_seqlens.diff())
        context_positions = torch.arange(context.shape[0], device=context.device) - token_starts
        offsets = torch.arange(block, device=context.device)
        block_positions = ((anchors.positions - anchors.seq_bounds()[0])[:, None] + offsets).reshape(-1)
        block_rope, context_rope = self._rope(block_positions, x.dtype), self._rope(context_positions, x.dtype)
        if attention == "flex":
            groups = flex_layout(anchors, context.shape[0], block, self._windows, self.sliding_causal)
        elif attention == "sdpa":
            groups = _attention_groups(anchors, block, self._windows, anchors_per_group, self.sliding_causal)
        else:
            raise ValueError(f"attention must be 'flex' or 'sdpa', got {attention!r}")
        for layer in self.layers:
            x = layer(x, fused, block_rope, context_rope, groups)
        return self.norm(x).view(-1, block, x.shape[-1])

    def draft_block(self, context: torch.Tensor, committed_ids: torch.Tensor, head: FrozenTargetHead) -> torch.Tensor:
        """Inference: draft hidden states [B, H] for the block anchored at the last committed token.

        committed_ids: [S + 1] tokens so far, the anchor last (at position S); context: [S, n*H] target
        features of positions 0..S-1 (the anchor's own does not exist yet). Runs the training forward
        with one anchor, so inference cannot drift from what was trained: the block sees all of the
        context, itself bidirectionally, and sits at positions S..S+B-1.
        """
        length = committed_ids.shape[0]
        if context.shape[0] != length - 1:
            raise ValueError(f"{length} committed tokens need {length - 1} context rows, got {context.shape[0]}")
        # A row for the anchor keeps the packed shapes; the mask (keys < anchor) never reads it.
        padded = torch.cat([context, context.new_zeros(1, context.shape[1])])
        device = committed_ids.device
        anchors = Anchors(
            positions=torch.tensor([length - 1], device=device),
            cu_anchors=torch.tensor([0, 1], device=device),
            cu_seqlens=torch.tensor([0, length], device=device),
        )
        return self(padded, committed_ids, anchors, head)[0]

    def objective_inputs(self, hidden: torch.Tensor, input_ids: torch.Tensor, anchors: Anchors) -> dict[str, Any]:
        """What the family's own modules give the objective beside the backbone's output (consumer/training/loss.py
        dflash_loss's keyword arguments): none for DFlash."""
        return {}
