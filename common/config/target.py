"""Which target model a producer runs, and which of its layers feed the drafter: the [target] settings as data.

The target's geometry (hidden size, layer count, vocabulary, the captured layers, the mask token) is part of the
ring's config fingerprint, so a drafter built for another one is refused when it attaches instead of training on
features it misreads. The counts are read from the target's directory by common/target_geometry.py; here they only
meet the settings (TargetConfig.geometry). Loading the target itself (its config class, its model, its tokenizer)
is common/target_loading.py and common/tokenizer_loading.py: a config module imports no transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from dflash_ring.common.config.paths import OutputDirectory, home_path, ReadPath
from dflash_ring.common.refusal import Refusal
from dflash_ring.common.config.drafter import build_target_layer_ids
from dflash_ring.common.config.ranges import Range

TargetDtype = Literal["auto", "float32", "bfloat16"]
AttnImplementation = Literal["auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3"]
Packing = Literal["auto", "packed", "padded"]


class TargetConfigError(Refusal, ValueError):
    """The target settings (or the model they point at) cannot be used; the message says what to fix."""


@dataclass(frozen=True)
class TargetGeometry:
    """What a drafter must agree on with the producers: the shape of every feature row."""

    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    layer_ids: tuple[int, ...]
    mask_token_id: int | None
    ship_final_hidden: bool

    @property
    def feature_width(self) -> int:
        return len(self.layer_ids) * self.hidden_size

    def fingerprint_fields(self) -> dict[str, Any]:
        return {
            "target.hidden_size": self.hidden_size,
            "target.num_hidden_layers": self.num_hidden_layers,
            "target.vocab_size": self.vocab_size,
            "target.layer_ids": list(self.layer_ids),
            "target.mask_token_id": self.mask_token_id,
            "target.ship_final_hidden": self.ship_final_hidden,
        }


@dataclass(frozen=True)
class TargetConfig:
    # A local Hugging Face model directory (config.json + weights); nothing is downloaded.
    path: ReadPath = ""
    # Tokenizer directory; empty means the model directory.
    tokenizer: str = ""
    # Decoder layers whose outputs become features (0-based; HF hidden_states[l + 1]).
    # None: the DFlash rule for num_draft_layers (evenly over 1..L-3, or [L // 2] for one layer).
    layer_ids: list[int] | None = None
    # The DFlash rule picks this many layers (a list of them is built): at most 256, as drafter.num_hidden_layers.
    num_draft_layers: Annotated[int, Range(1, 256)] = 1
    # "auto": bfloat16 on a GPU, float32 on the CPU (where bf16 matmuls are slow and inexact).
    dtype: TargetDtype = "auto"
    # "auto": cuda if available, else cpu; `dflash-ring target --device cuda:N` overrides it.
    device: str = "auto"
    # Also ship the final normed hidden state [tokens, hidden], for a KL loss or target-argmax labels through the
    # frozen LM head. None: shipped exactly when the run's drafter objective needs it (common/config/schema.py).
    ship_final_hidden: bool | None = None
    # The drafter's <|MASK|> row; must be a row of the target embedding. Only checked and fingerprinted here.
    mask_token_id: int | None = None
    # The model's own attention: padded batches and the conformance probe's reference run it; packed batches
    # keep its semantics (producer/packing.py). "auto": HF's choice (sdpa where the model supports it, else eager).
    attn_implementation: AttnImplementation = "auto"
    # "packed": sequences concatenated without padding, refused at start unless the conformance probe shows
    # features equal to each sequence's own forward; "auto": packed when the probe passes, padded (with a
    # warning naming the first layer that differs) otherwise; "padded": no probe, padded batches.
    packing: Packing = "auto"
    # Ranks of one host the target is sharded over with transformers' own tensor-parallel plan (the family's
    # base_model_tp_plan, `tp_plan="auto"`): the producer process leads the group and starts the other ranks
    # (producer/tensor_group.py), on GPUs device .. device + N - 1 (NCCL) or on the CPU (gloo). 1: no group.
    tensor_parallel: Annotated[int, Range(1, 64)] = 1
    # torch.compile each decoder layer on a GPU for packed batches (fuses norms, RoPE, SiLU and residual adds
    # around the matmuls; the first batches compile, later starts load from run.compile_cache_dir).
    compile: bool = True
    # Cursor files (<state_dir>/<run>/producer-<i>.json): where to resume when the ring is gone.
    state_dir: OutputDirectory = field(default_factory=lambda: home_path("~/.cache/dflash_ring/state"))

    def __post_init__(self) -> None:
        if self.layer_ids is not None and (not self.layer_ids or len(set(self.layer_ids)) != len(self.layer_ids)):
            raise TargetConfigError(f"target.layer_ids = {self.layer_ids}: need distinct non-negative layer ids")

    def geometry(self, hidden_size: int, num_hidden_layers: int, vocab_size: int) -> TargetGeometry:
        """The geometry of a target of these counts (read from its config.json: common/target_geometry.py), with
        these settings' layer ids and mask token checked against them."""
        ids = tuple(self.resolved_layer_ids(num_hidden_layers))
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < vocab_size:
            raise TargetConfigError(
                f"target.mask_token_id = {self.mask_token_id} is not a row of the {vocab_size}-row target embedding"
            )
        return TargetGeometry(
            hidden_size, num_hidden_layers, vocab_size, ids, self.mask_token_id, bool(self.ship_final_hidden)
        )

    def resolved_layer_ids(self, num_hidden_layers: int) -> list[int]:
        ids = (
            list(self.layer_ids)
            if self.layer_ids is not None
            else build_target_layer_ids(num_hidden_layers, self.num_draft_layers)
        )
        # HF's hidden_states[L] is the final *normed* state, not layer L-1's output, so id L-1 would
        # mean two different things; the final state has its own switch (ship_final_hidden).
        if max(ids) > num_hidden_layers - 2:
            raise TargetConfigError(
                f"target layer ids {ids} must lie in 0..{num_hidden_layers - 2} for a {num_hidden_layers}-layer "
                f"target (use target.ship_final_hidden for the final normed state)"
            )
        return ids
