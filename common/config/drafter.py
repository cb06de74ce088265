"""What the trainer chooses for the drafter, and the DFlash rule for which target layers feed it.

Import-light (no torch, no transformers): every process reads it while loading the run's config.
The Hugging Face side (the exported config.json) is consumer/drafter_hf_config.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Annotated, Any, Literal

from dflash_ring.common.config.ranges import AtLeastOne, Fraction, Positive, Range

# Paper A.1: gamma for the exp(-(k-1)/gamma) position decay, per block size.
PAPER_LOSS_GAMMA: dict[int, float] = {16: 7.0, 10: 5.0, 8: 4.0}

ATTENTION_TYPES = ("full_attention", "sliding_attention")

Arch = Literal["dflash", "dspark", "dflash2"]
ARCHS = ("dflash", "dspark", "dflash2")
MarkovHeadType = Literal["vanilla", "gated", "rnn"]
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
Objective = Literal["ce", "dpace"]
LabelSource = Literal["data", "target_argmax"]
Precision = Literal["bf16", "fp8"]
# torchao's float8 recipes (consumer/fp8.py); the 27B ddtree step on the H200 (docs/benchmarks.md, issue 30):
# rowwise 0.979 s (all three GEMMs of a linear in FP8, rowwise scales: the one the quality guard ran on),
# rowwise_with_gw_hp 0.875 s (the weight gradient's GEMM in bf16), tensorwise 0.861 s (one scale per tensor).
Fp8Recipe = Literal["rowwise", "rowwise_with_gw_hp", "tensorwise"]
FP8_RECIPES = ("rowwise", "rowwise_with_gw_hp", "tensorwise")
# Fields that choose how the drafter's arithmetic is done, not which model it is (model_fields leaves them out).
NUMERIC_FORMAT_FIELDS = ("precision", "fp8_recipe")
# Fields added with DSpark, at the values every config had before them: model_fields leaves them out there, so a
# DFlash config's fingerprint (and a running DFlash run's checkpoints) stay what they were.
PRE_DSPARK_VALUES: dict[str, Any] = {
    "arch": "dflash",
    "ce_weight": 1.0,
    "tv_weight": 0.0,
    "confidence_weight": 0.0,
    "markov_rank": 0,
    "markov_head": None,
}
# Keys that only a DSpark drafter has: set on an arch = "dflash" drafter, they are refused.
DSPARK_ONLY_FIELDS = ("markov_rank", "markov_head", "confidence_weight")
# Fields added with DFlash2, at the values every other config has (0: no convolution, no selector): left out of
# model_fields there, so DFlash and DSpark fingerprints stay what they were; set on another arch, they are refused.
PRE_DFLASH2_VALUES: dict[str, Any] = {
    "conv_kernel_size": 0,
    "conv_group_size": 0,
    "selector_rank": 0,
    "selector_top_k": 0,
    "selector_weight": 0.0,
}
DFLASH2_ONLY_FIELDS = tuple(PRE_DFLASH2_VALUES)

# Named recipes: one line (`drafter.recipe = "ddtree"`) for the settings below; a key set explicitly wins.
# paper:  the DFlash paper's Qwen3-8B drafter: 5 full-attention layers, B16, 512 anchors, position-decayed CE.
# dpace:  the paper's drafter with D-PACE position weights (arXiv 2605.18810; the default objective of
#         NVIDIA Model-Optimizer and vLLM speculators).
# ddtree: the recipe of the pipeline this project replaces (`ddtree-g10-bs32-a1024-swa-kl15-cap01`): B32,
#         1024 anchors, gamma 10, 4 sliding-window layers (2048) + 1 full, soft KL 0.15, CAP 0.1.
# dspark: DeepSeek's DSpark (arXiv 2607.05147; DeepSpec config/dspark/dspark_qwen3_8b.py): the DFlash backbone
#         with the anchor as the first prediction (block 7 = 7 drafts), a vanilla Markov head of rank 256 and a
#         confidence head; loss 0.1 CE + 0.9 L1 (= 2 TV) + 1.0 BCE of the confidence, weights exp(-k/4).
# dflash2: z-lab's DFlash2 ("Keep Drafting Parallel"). From the released checkpoint's config.json
#         (incoai/Qwen3.8-27B-DFlash2, shared/reference/dspark-dflash2.md 2.1): 5 layers, all sliding_attention
#         with window 2048, block 8, dflash_config conv_kernel_size 2, conv_group_size 16, selector_rank 256,
#         selector_top_k 16. z-lab published no objective; from the peers' trainers (2.2): selector loss weight
#         1.0 (SpecForge/speculators/NeMo AM alpha_sel), 512 anchors (speculators' max_anchors). The backbone's
#         loss is the paper's position-decayed CE with its B8 gamma 4 (speculators' default is KL: set kl_weight).
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
    "dspark": {
        "arch": "dspark",
        "num_hidden_layers": 5,
        "block_size": 7,
        "num_anchors": 512,
        "loss": "ce",
        "loss_gamma": 4.0,
        "ce_weight": 0.1,
        "tv_weight": 0.9,
        "confidence_weight": 1.0,
        "kl_weight": 0.0,
        "cap_weight": 0.0,
        "markov_rank": 256,
        "markov_head": "vanilla",
    },
    "dflash2": {
        "arch": "dflash2",
        "num_hidden_layers": 5,
        "block_size": 8,
        "num_anchors": 512,
        "loss": "ce",
        "loss_gamma": 4.0,
        "kl_weight": 0.0,
        "cap_weight": 0.0,
        "sliding_window": 2048,
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 256,
        "selector_top_k": 16,
        "selector_weight": 1.0,
    },
}
# A recipe's layer pattern, for however many layers the drafter has (ddtree: all sliding but the last; dflash2: all
# sliding, as the released checkpoint).
RECIPE_LAYER_TYPES = {
    "ddtree": lambda n: ["sliding_attention"] * (n - 1) + ["full_attention"],
    "dflash2": lambda n: ["sliding_attention"] * n,
}


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
class DrafterConfig:
    """What the trainer chooses; everything else is copied from the target's config.

    A field left None takes the recipe's value, else its default; the constructor resolves them all, so
    the fingerprint, checkpoints and the export record the values trained with, never just a recipe name.
    """

    # None, or a name in RECIPES whose settings fill the fields not set explicitly.
    recipe: str | None = None
    # "dflash": the block is [anchor, MASK x (B-1)] and slots 1..B-1 draft (B - 1 drafts). "dspark": the same
    # backbone, but every slot drafts (slot k predicts anchor + k + 1: B drafts), with a low-rank Markov head over
    # the previous token's logits and a confidence head (consumer/dspark_heads.py).
    arch: Arch | None = None  # default "dflash"
    # At most 256: the drafter builds every layer (and a layer_types entry each) at start; DFlash drafters have 1 to
    # 8 and the largest targets fewer than 200, so more is a typo, not a model.
    num_hidden_layers: Annotated[int, Range(1, 256)] | None = None  # default 1
    block_size: Annotated[int, Range(low=2)] | None = None  # default 16
    num_anchors: AtLeastOne | None = None  # default 512
    # None -> paper rule for block_size (B16->7, B10->5, B8->4); other sizes must set it for loss "ce".
    loss_gamma: Positive | None = None
    # "ce": CE weighted by the position decay exp(-(k-1)/gamma), normalised by the weights' sum (the paper).
    # "dpace": D-PACE weights from the drafter's own detached acceptance (consumer/loss.py), normalised by
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
    # DSpark: BCE of the confidence head against the detached analytic acceptance 1 - TV, position-weighted.
    confidence_weight: float | None = None  # DSpark only; default 1
    # DSpark: the rank of the Markov head's factorisation (markov_w1 [V, r], markov_w2 [V, r]), and its kind.
    markov_rank: Annotated[int, Range(0, 4096)] | None = None  # DSpark only (>= 1 there; 0: none); default 256
    markov_head: MarkovHeadType | None = None  # DSpark only; default "vanilla"
    # DFlash2 (consumer/dflash2_blocks.py): the grouped dynamic causal convolution around every attention and MLP
    # sublayer (taps per channel, kernel_size of them, the dynamic part shared by conv_group_size channels), and the
    # candidate selector (codebooks of rank selector_rank rescoring the unary top selector_top_k), whose K-way CE
    # against the true predecessor's candidates weighs selector_weight (consumer/objectives/selector.py).
    conv_kernel_size: Annotated[int, Range(0, 64)] | None = None  # DFlash2 only; default 2
    conv_group_size: Annotated[int, Range(0, 1 << 16)] | None = None  # DFlash2 only; default 16
    selector_rank: Annotated[int, Range(0, 4096)] | None = None  # DFlash2 only; default 256
    selector_top_k: Annotated[int, Range(0, 4096)] | None = None  # DFlash2 only; default 16
    selector_weight: float | None = None  # DFlash2 only; default 1
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
    # None -> the target's RoPE (drafter_rope); set it for a plain RoPE of this base instead, e.g. for
    # targets whose RoPE a fixed Qwen3 rotary cannot express (dynamic NTK, longrope).
    rope_theta: Positive | None = None
    # The format of the trainable linears' GEMMs. "bf16": autocast over fp32 master weights. "fp8": torchao's
    # float8 training with rowwise scales (consumer/fp8.py), refused in one line where the GPU cannot run it
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
        if arch not in ARCHS:
            raise ValueError(f"arch {arch!r} must be one of {', '.join(map(repr, ARCHS))}")
        # A resolved DFlash config written back (a checkpoint's, the launcher's) holds their DFlash values: not a
        # refusal.
        for other, only, before in (
            ("dspark", DSPARK_ONLY_FIELDS, PRE_DSPARK_VALUES),
            ("dflash2", DFLASH2_ONLY_FIELDS, PRE_DFLASH2_VALUES),
        ):
            if arch != other and (set_here := [k for k in only if getattr(self, k) not in (None, before[k])]):
                name = {"dspark": "DSpark", "dflash2": "DFlash2"}[other]
                raise ValueError(
                    f"{', '.join(set_here)} {'is' if len(set_here) == 1 else 'are'} {name}-only; this "
                    f"drafter has arch = {arch!r} (set arch = {other!r} or recipe = {other!r}, or remove "
                    f"{'it' if len(set_here) == 1 else 'them'})"
                )
        defaults = {"dspark": _DSPARK_DEFAULTS, "dflash2": _DFLASH2_DEFAULTS}.get(arch, _DEFAULTS)
        for name, value in {**defaults, **recipe}.items():
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
        if self.markov_head is not None and self.markov_head not in MARKOV_HEAD_TYPES:
            raise ValueError(
                f"markov_head {self.markov_head!r} must be one of {', '.join(map(repr, MARKOV_HEAD_TYPES))}"
            )
        if min(self.ce_weight, self.tv_weight, self.kl_weight, self.cap_weight, self.confidence_weight) < 0:
            raise ValueError("ce_weight, tv_weight, kl_weight, cap_weight and confidence_weight must be >= 0")
        if self.arch == "dspark" and "sliding_attention" in self.layer_types:
            raise ValueError(
                "arch 'dspark' takes full_attention layers only: the engines that serve DSpark (vLLM, "
                "SGLang, llama.cpp) read no sliding window from its layout; remove layer_types or the "
                "sliding layers"
            )
        if self.arch == "dspark" and self.markov_rank < 1:
            raise ValueError("arch 'dspark' needs markov_rank >= 1 (the Markov head and the confidence head read it)")
        if (
            self.arch == "dflash2"
            and min(self.conv_kernel_size, self.conv_group_size, self.selector_rank, self.selector_top_k) < 1
        ):
            raise ValueError(
                "arch 'dflash2' needs conv_kernel_size, conv_group_size, selector_rank and selector_top_k >= 1"
            )
        if self.arch == "dflash2" and self.conv_kernel_size > self.block_size:
            raise ValueError(
                f"conv_kernel_size {self.conv_kernel_size} exceeds block_size {self.block_size}: its taps "
                "never cross a block, so the extra ones would read nothing"
            )
        if self.selector_weight < 0:
            raise ValueError("selector_weight must be >= 0")
        if self.confidence_weight > 0 and self.loss != "ce":
            raise ValueError(
                "confidence_weight > 0 needs loss = 'ce': the confidence's BCE is weighted by the "
                "position decay, which D-PACE replaces"
            )

    def model_fields(self) -> dict[str, Any]:
        """Every field but the numeric format: what the ring's and the replica group's fingerprints compare. A
        format is not another model (bf16 and fp8 replicas may average their weights, a drafter may resume in
        the other format), and leaving it out keeps the fingerprint of every bf16 config as it was before the
        field existed."""
        return {
            k: v
            for k, v in asdict(self).items()
            if k not in NUMERIC_FORMAT_FIELDS
            and not (k in PRE_DSPARK_VALUES and v == PRE_DSPARK_VALUES[k])
            and not (k in PRE_DFLASH2_VALUES and v == PRE_DFLASH2_VALUES[k])
        }

    @property
    def needs_target_logits(self) -> bool:
        """The objective reads the target's distribution (KL, or its argmax as the label): the producers must
        ship the final hidden state."""
        return self.kl_weight > 0 or self.tv_weight > 0 or self.confidence_weight > 0 or self.label == "target_argmax"

    @property
    def sample_from_anchor(self) -> bool:
        """Whether the anchor's slot drafts too (DSpark): the block then drafts B tokens, not B - 1."""
        return self.arch == "dspark"

    @property
    def drafts_per_block(self) -> int:
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    def resolved_target_layer_ids(self, num_target_layers: int) -> list[int]:
        ids = self.target_layer_ids or build_target_layer_ids(num_target_layers, self.num_hidden_layers)
        if not all(0 <= i < num_target_layers for i in ids):
            raise ValueError(f"target_layer_ids {ids} out of range for {num_target_layers} target layers")
        return list(ids)


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
    "confidence_weight": 0.0,
    "markov_rank": 0,
    **PRE_DFLASH2_VALUES,
}
_DSPARK_DEFAULTS: dict[str, Any] = {**_DEFAULTS, "confidence_weight": 1.0, "markov_rank": 256, "markov_head": "vanilla"}
_DFLASH2_DEFAULTS: dict[str, Any] = {
    **_DEFAULTS,
    "conv_kernel_size": 2,
    "conv_group_size": 16,
    "selector_rank": 256,
    "selector_top_k": 16,
    "selector_weight": 1.0,
}


def target_text_config(target_config: Any) -> dict[str, Any]:
    """The language-model part of a target config (multimodal targets nest it under text_config);
    a dict read from config.json or a transformers PretrainedConfig."""
    config = target_config.to_dict() if hasattr(target_config, "to_dict") else dict(target_config)
    text = config.get("text_config")
    return dict(text) if text else config
