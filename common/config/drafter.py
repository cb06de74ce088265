"""What the trainer chooses for the drafter, and the DFlash rule for which target layers feed it.

Import-light (no torch, no transformers): every process reads it while loading the run's config.
The Hugging Face side (the exported config.json) is consumer/layouts/drafter_hf_config.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Annotated, Any, Literal

from dflash_ring.common.config.families import FAMILIES, DFlash2Keys, DSparkKeys, Eagle3Keys
from dflash_ring.common.config.ranges import AtLeastOne, Fraction, Positive, Range

# Paper A.1: gamma for the exp(-(k-1)/gamma) position decay, per block size.
PAPER_LOSS_GAMMA: dict[int, float] = {16: 7.0, 10: 5.0, 8: 4.0}

ATTENTION_TYPES = ("full_attention", "sliding_attention")

Arch = Literal["dflash", "dspark", "dflash2", "eagle3"]  # a name in common/config/families FAMILIES
Objective = Literal["ce", "dpace"]
LabelSource = Literal["data", "target_argmax"]
Precision = Literal["bf16", "fp8"]
# torchao's float8 recipes (consumer/modeling/fp8.py); the 27B ddtree step on the H200 (docs/benchmarks.md, issue 30):
# rowwise 0.979 s (all three GEMMs of a linear in FP8, rowwise scales: the one the quality guard ran on),
# rowwise_with_gw_hp 0.875 s (the weight gradient's GEMM in bf16), tensorwise 0.861 s (one scale per tensor).
Fp8Recipe = Literal["rowwise", "rowwise_with_gw_hp", "tensorwise"]
FP8_RECIPES = ("rowwise", "rowwise_with_gw_hp", "tensorwise")
# Fields that choose how the drafter's arithmetic is done, not which model it is (model_fields leaves them out).
NUMERIC_FORMAT_FIELDS = ("precision", "fp8_recipe")
# Shared fields added with DSpark, at the values every config had before them: model_fields leaves them out there,
# as it leaves out each family's own keys at their absent value (FamilyConfig.own_keys), so a DFlash config's
# fingerprint (and a running DFlash run's checkpoints) stay what they were.
ADDED_WITH_DSPARK: dict[str, Any] = {"arch": "dflash", "ce_weight": 1.0, "tv_weight": 0.0}
# The drafter's own attention geometry, added later at None (the target's heads, as before): model_fields leaves
# them out while None, so every config that sets none keeps its fingerprint.
GEOMETRY_FIELDS = ("num_attention_heads", "num_key_value_heads", "head_dim")

# Named recipes: one line (`drafter.recipe = "ddtree"`) for the settings below; a key set explicitly wins. The shared
# ones here; each family adds its own (FamilyConfig.recipes: dspark, dflash2).
# paper:  the DFlash paper's Qwen3-8B drafter: 5 full-attention layers, B16, 512 anchors, position-decayed CE.
# dpace:  the paper's drafter with D-PACE position weights (arXiv 2605.18810; the default objective of
#         NVIDIA Model-Optimizer and vLLM speculators).
# ddtree: the recipe of the pipeline this project replaces (`ddtree-g10-bs32-a1024-swa-kl15-cap01`): B32,
#         1024 anchors, gamma 10, 4 sliding-window layers (2048) + 1 full, soft KL 0.15, CAP 0.1.
RECIPES: dict[str, dict[str, Any]] = {
    "paper": {
        "num_hidden_layers": 5,
        "block_size": 16,
        "num_anchors": 512,
        "loss": "ce",
        "kl_weight": 0.0,
        "cap_weight": 0.0,
    },
    "dpace": {
        "num_hidden_layers": 5,
        "block_size": 16,
        "num_anchors": 512,
        "loss": "dpace",
        "dpace_alpha": 0.5,
        "kl_weight": 0.0,
        "cap_weight": 0.0,
    },
    "ddtree": {
        "num_hidden_layers": 5,
        "block_size": 32,
        "num_anchors": 1024,
        "loss": "ce",
        "loss_gamma": 10.0,
        "kl_weight": 0.15,
        "cap_weight": 0.1,
        "sliding_window": 2048,
    },
}
# A recipe's layer pattern, for however many layers the drafter has (ddtree: all sliding but the last).
RECIPE_LAYER_TYPES = {"ddtree": lambda n: ["sliding_attention"] * (n - 1) + ["full_attention"]}
for _family in FAMILIES.values():
    RECIPES.update({name: dict(values) for name, values in _family.recipes.items()})
    RECIPE_LAYER_TYPES.update(_family.layer_types)


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers whose outputs feed the drafter: spread evenly over 1..L-3.

    Must equal the rule in z-lab/SpecForge/SGLang, because serving stacks
    recompute it from num_target_layers when dflash_config omits the list.
    """
    if num_target_layers < 1 or num_draft_layers < 1:
        raise ValueError(f"need >= 1 target and draft layer, got {num_target_layers}, {num_draft_layers}")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    # Small targets get repeated ids (e.g. [1, 1] for 4 layers): kept, as the reference rule does.
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass
class DrafterConfig(Eagle3Keys, DFlash2Keys, DSparkKeys):
    """What the trainer chooses; everything else is copied from the target's config.

    A field left None takes the recipe's value, else its default; the constructor resolves them all, so
    the fingerprint, checkpoints and the export record the values trained with, never just a recipe name.
    The keys below are every family's; a family's own keys are its dataclass's (common/config/families/), all in
    the one flat [drafter] table that configs and checkpoints have always written.
    """

    # None, or a name in RECIPES whose settings fill the fields not set explicitly.
    recipe: str | None = None
    # The family (common/config/families/: "dflash", "dspark", "dflash2", "eagle3"); a recipe of a family selects it.
    arch: Arch | None = None  # default "dflash"
    # At most 256: the drafter builds every layer (and a layer_types entry each) at start; DFlash drafters have 1 to
    # 8 and the largest targets fewer than 200, so more is a typo, not a model.
    num_hidden_layers: Annotated[int, Range(1, 256)] | None = None  # default 1
    block_size: Annotated[int, Range(low=2)] | None = None  # default 16
    num_anchors: AtLeastOne | None = None  # default 512
    # None -> paper rule for block_size (B16->7, B10->5, B8->4); other sizes must set it for loss "ce".
    loss_gamma: Positive | None = None
    # "ce": CE weighted by the position decay exp(-(k-1)/gamma), normalised by the weights' sum (the paper).
    # "dpace": D-PACE weights from the drafter's own detached acceptance (consumer/training/loss.py), normalised by
    # the number of supervised positions.
    loss: Objective | None = None  # default "ce"
    dpace_alpha: Fraction | None = None  # default 0.5: q~ = (1 - alpha) q + alpha
    # Soft KL to the target's distribution, through the frozen head on the shipped final hidden state.
    kl_weight: float | None = None  # default 0
    # CAP: -cap_weight * mean over blocks of the expected accepted length / (B - 1), gradients through it.
    cap_weight: float | None = None  # default 0
    # The weight of the position-weighted CE term (DSpark: 0.1).
    ce_weight: float | None = None  # default 1
    # The L1 distance between the draft's and the target's distributions (= 2 TV), position-weighted like CE.
    tv_weight: float | None = None  # default 0 (DSpark: 0.9)
    # What each position is trained to predict: the data's token, or the target's own greedy next token.
    label: LabelSource | None = None  # default "data"
    mask_token_id: int | None = None
    # None -> build_target_layer_ids(num_target_layers, num_hidden_layers).
    target_layer_ids: list[int] | None = None
    # None -> every layer "full_attention"; "sliding_attention" layers need sliding_window.
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    # Rows of [rows, vocab] logits alive at once in the loss; bounds peak memory.
    loss_chunk_tokens: AtLeastOne = 1024
    # None -> derived from the target (drafter_mlp_width); set it to choose the drafter's MLP width.
    intermediate_size: AtLeastOne | None = None
    # The drafter's attention geometry; None -> the target's (num_key_value_heads: the target's, head_dim: the
    # target's head width). The drafter's K/V of the context come from its own projections of the target's
    # features, so its heads need not be the target's: the released 27B-class drafters use 32 heads of 128 with 8
    # KV heads beside targets of 24 x 256 and 4. Bounded as the largest published models' attention is.
    num_attention_heads: Annotated[int, Range(1, 1024)] | None = None
    num_key_value_heads: Annotated[int, Range(1, 1024)] | None = None
    head_dim: Annotated[int, Range(2, 1024)] | None = None
    # A released or exported drafter directory (ours, z-lab's DFlash/DFlash2, DeepSeek's flat DSpark, or speculators'
    # save_pretrained) whose weights initialise this drafter instead of a fresh initialisation (fine-tuning a
    # released drafter for a fine-tuned target). Read once, at the first start of a run: a drafter that resumes
    # from its checkpoint takes the checkpoint's weights. Its family, width, vocabulary, layers and geometry must be
    # this drafter's (refused in one line otherwise); the checkpoints record it.
    init_from: str | None = None
    # None -> the target's RoPE (drafter_rope); set it for a plain RoPE of this base instead, e.g. for
    # targets whose RoPE a fixed Qwen3 rotary cannot express (dynamic NTK, longrope).
    rope_theta: Positive | None = None
    # The format of the trainable linears' GEMMs. "bf16": autocast over fp32 master weights. "fp8": torchao's
    # float8 training with rowwise scales (consumer/modeling/fp8.py), refused in one line where the GPU cannot run it
    # (compute capability < 8.9) or torchao is missing. The same model either way: the weights, checkpoints and
    # export are laid out alike, so a run may resume in the other format (see model_fields).
    precision: Precision = "bf16"
    # With precision = "fp8": the float8 recipe of the trainable linears (Fp8Recipe above).
    fp8_recipe: Fp8Recipe = "rowwise"

    def __post_init__(self) -> None:
        if self.recipe is not None and self.recipe not in RECIPES:
            raise ValueError(f"recipe {self.recipe!r} is not one of {', '.join(map(repr, RECIPES))}")
        recipe = RECIPES.get(self.recipe, {})
        arch = self.arch or recipe.get("arch", "dflash")
        if arch not in FAMILIES:
            raise ValueError(f"arch {arch!r} must be one of {', '.join(map(repr, FAMILIES))}")
        # A resolved config written back (a checkpoint's, the launcher's) holds the other families' keys at their
        # absent values: not a refusal.
        for other in FAMILIES.values():
            if other.name != arch and (
                set_here := [k for k, absent in other.own_keys.items() if getattr(self, k) not in (None, absent)]
            ):
                raise ValueError(
                    f"{', '.join(set_here)} {'is' if len(set_here) == 1 else 'are'} {other.display}-only; this "
                    f"drafter has arch = {arch!r} (set arch = {other.name!r} or recipe = {other.name!r}, or remove "
                    f"{'it' if len(set_here) == 1 else 'them'})"
                )
        family = FAMILIES[arch]
        # A key set here wins over the recipe's (recipe_note says which did, so a recipe never loses in silence).
        self._recipe_overrides = {
            name: (getattr(self, name), value)
            for name, value in recipe.items()
            if name != "arch" and getattr(self, name) is not None and getattr(self, name) != value
        }
        for name, value in {**_DEFAULTS, **family.defaults, **recipe}.items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        self.arch = arch
        if self.loss_gamma is None and (self.block_size in PAPER_LOSS_GAMMA or self.loss == "ce"):
            if self.block_size not in PAPER_LOSS_GAMMA:
                raise ValueError(
                    f"no paper loss_gamma for block_size={self.block_size} "
                    f"(known: {PAPER_LOSS_GAMMA}); set loss_gamma explicitly"
                )
            self.loss_gamma = PAPER_LOSS_GAMMA[self.block_size]
        if self.layer_types is None:
            pattern = RECIPE_LAYER_TYPES.get(self.recipe, lambda n: ["full_attention"] * n)
            self.layer_types = pattern(self.num_hidden_layers)
        self._validate()

    def recipe_note(self) -> str | None:
        """One line naming the recipe's values that keys set beside it replaced (`dflash-ring run --set
        drafter.recipe=dspark` over the embedded default's block_size 8: DSpark's 7 loses), or None. Said by the
        launcher and check-config: both values are legitimate, so it is a note, not a refusal."""
        if not self._recipe_overrides:
            return None
        mine = ", ".join(f"{k} = {v!r}" for k, (v, _) in self._recipe_overrides.items())
        theirs = ", ".join(f"{k} = {r!r}" for k, (_, r) in self._recipe_overrides.items())
        return (
            f"drafter.recipe {self.recipe!r} sets {theirs}; this config sets {mine}, which win (remove them from "
            "[drafter] to train the recipe's)"
        )

    def _validate(self) -> None:
        """The checks one field against another; each number's own range is its field's (common/config/ranges.py)."""
        if self.loss not in ("ce", "dpace") or self.label not in ("data", "target_argmax"):
            raise ValueError(
                f"loss {self.loss!r} must be 'ce' or 'dpace', label {self.label!r} 'data' or 'target_argmax'"
            )
        if self.precision not in ("bf16", "fp8"):
            raise ValueError(f"precision {self.precision!r} must be 'bf16' or 'fp8'")
        if self.fp8_recipe not in FP8_RECIPES:
            raise ValueError(f"fp8_recipe {self.fp8_recipe!r} must be one of {', '.join(map(repr, FP8_RECIPES))}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if unknown := set(self.layer_types) - set(ATTENTION_TYPES):
            raise ValueError(f"unknown layer_types {sorted(unknown)}; expected {ATTENTION_TYPES}")
        if "sliding_attention" in self.layer_types and (self.sliding_window or 0) < self.block_size:
            raise ValueError("sliding_attention layers need sliding_window >= block_size")
        if min(self.ce_weight, self.tv_weight, self.kl_weight, self.cap_weight) < 0:
            raise ValueError("ce_weight, tv_weight, kl_weight and cap_weight must be >= 0")
        # Every `*_weight` key weighs a term of the loss (the shared ones and a family's own); all 0, the loss is 0 at
        # every step and the run trains to its end learning nothing.
        others = {k for f in FAMILIES.values() if f.name != self.arch for k in f.own_keys}
        weights = {k: v for k, v in vars(self).items() if k.endswith("_weight") and k not in others}
        if not any(weights.values()):
            raise ValueError(
                f"every loss weight is 0 ({', '.join(weights)}): the loss is 0 at every step and the drafter learns "
                "nothing; set ce_weight > 0 (its default is 1) or another term's weight"
            )
        FAMILIES[self.arch].check(self)
        heads, kv_heads = self.num_attention_heads, self.num_key_value_heads
        if heads is not None and kv_heads is not None and heads % kv_heads:
            raise ValueError(
                f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}: each key/value "
                "head serves a whole group of query heads"
            )
        if self.head_dim is not None and self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} is odd: RoPE rotates a head in pairs of channels")
        if self.init_from is not None and not self.init_from.strip():
            raise ValueError("init_from is empty: name a drafter directory, or remove the key")

    def model_fields(self) -> dict[str, Any]:
        """Every field but the numeric format and the warm start's source: what the ring's and the replica group's
        fingerprints compare. A format is not another model (bf16 and fp8 replicas may average their weights, a
        drafter may resume in the other format), and leaving it out keeps the fingerprint of every bf16 config as it
        was before the field existed; where the first weights came from does not change the model either. A key
        naming a file the model is made of (FamilyConfig.digests) stands for the file's digest, not its path."""
        digests = FAMILIES[self.arch].digests
        return {
            k: digests[k](v) if k in digests and v is not None else v
            for k, v in asdict(self).items()
            if k not in NUMERIC_FORMAT_FIELDS
            and k != "init_from"  # where the first weights came from, not which model trains
            and not (k in GEOMETRY_FIELDS and v is None)
            and not (k in _ABSENT and v == _ABSENT[k])
        }

    @property
    def needs_target_logits(self) -> bool:
        """The objective reads the target's distribution (KL, or its argmax as the label): the producers must
        ship the final hidden state."""
        return self.kl_weight > 0 or self.tv_weight > 0 or self.confidence_weight > 0 or self.label == "target_argmax"

    @property
    def sample_from_anchor(self) -> bool:
        """Whether the anchor's slot drafts too (DSpark): the block then drafts B tokens, not B - 1."""
        return FAMILIES[self.arch].drafts_from_anchor

    @property
    def drafts_per_block(self) -> int:
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    def resolved_target_layer_ids(self, num_target_layers: int) -> list[int]:
        rule = FAMILIES[self.arch].target_layer_ids or build_target_layer_ids
        ids = self.target_layer_ids or rule(num_target_layers, self.num_hidden_layers)
        if not all(0 <= i < num_target_layers for i in ids):
            raise ValueError(f"target_layer_ids {ids} out of range for {num_target_layers} target layers")
        return list(ids)


# The shared defaults; a family's own keys default to their absent value (FamilyConfig.own_keys) unless the family's
# defaults say otherwise.
_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 1,
    "block_size": 16,
    "num_anchors": 512,
    "loss": "ce",
    "dpace_alpha": 0.5,
    "kl_weight": 0.0,
    "cap_weight": 0.0,
    "label": "data",
    "ce_weight": 1.0,
    "tv_weight": 0.0,
    **{k: v for family in FAMILIES.values() for k, v in family.own_keys.items()},
}
# What model_fields leaves out: fields at the value every config had before they were added.
_ABSENT: dict[str, Any] = {**ADDED_WITH_DSPARK, **{k: v for f in FAMILIES.values() for k, v in f.own_keys.items()}}


def target_text_config(target_config: Any) -> dict[str, Any]:
    """The language-model part of a target config (multimodal targets nest it under text_config);
    a dict read from config.json or a transformers PretrainedConfig."""
    config = target_config.to_dict() if hasattr(target_config, "to_dict") else dict(target_config)
    text = config.get("text_config")
    return dict(text) if text else config
