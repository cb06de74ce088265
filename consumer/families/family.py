"""What a drafter family is to the drafter process, the export and the evaluation: one record per family,
registered once in consumer/families/__init__.py. Nothing outside the families and that registry asks which
architecture a drafter is; it asks the family (tests/test_drafter_family_registry.py pins it).

The family's config keys, defaults, recipes and checks are its half in common/config/families/ (config is data, read
by every process); this half holds what only the drafter side runs: the model class, the layout its export writes
and its import reads (config.json keys, the code shipped beside the weights, the target tensors the file carries)
and its draft function for the offline evaluation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_ring.common.config.families import FamilyConfig
from dflash_ring.consumer.training.objective import block_objective

if TYPE_CHECKING:
    import torch

    from dflash_ring.common.config.drafter import DrafterConfig
    from dflash_ring.consumer.modeling.draft import Draft
    from dflash_ring.consumer.training.loss import DFlashLoss
    from dflash_ring.consumer.training.objective import ObjectiveInputs, StepObjective
    from dflash_ring.consumer.modeling.model import DFlashDraftModel
    from dflash_ring.consumer.modeling.target_head import FrozenTargetHead, HeadSpec


def _nothing(*args: Any) -> None:
    return None


@dataclass(frozen=True)
class DrafterFamily:
    config: FamilyConfig  # its [drafter] keys (common/config/families/<name>.py)
    model: type[DFlashDraftModel]  # the training model, built from drafter_hf_config's keys
    architectures: tuple[str, ...]  # config.json's `architectures`: how an export names the family
    # The model code an export ships ((name in the export, source)), first the file auto_map names; the rest are
    # the files it imports (relative imports, which transformers' trust_remote_code copies along).
    code: tuple[tuple[str, Path], ...]
    # config.json's family part for (drafter config, the target's layer count): architectures, auto_map, and the
    # block, mask and target-layer keys where the layout keeps them.
    layout: Callable[[DrafterConfig, int], dict[str, Any]]
    # (block_size, mask_token_id, target_layer_ids) read back from a config.json of this layout.
    settings: Callable[[Mapping[str, Any]], tuple[int, int, list[int]]]
    # One round's drafts of the exported drafter for the offline evaluation:
    # (model, head, committed ids, target features, temperature, generator) -> Draft, or ids when greedy.
    draft: Callable[
        [DFlashDraftModel, FrozenTargetHead, torch.Tensor, torch.Tensor, float, torch.Generator | None],
        Draft | torch.Tensor,
    ]
    # config.json keys of the family's own modules (top-level or in dflash_config), with the drafter setting that
    # chooses each: what a released drafter must share with this one to warm-start it (consumer/training/warm_start.py).
    model_keys: Mapping[str, str] = field(default_factory=dict)
    # The objective's settings recorded in config.json's dflash_training beside the shared ones.
    training_keys: tuple[str, ...] = ()
    # The layout's last touches on the whole config.json (DSpark: the RoPE in transformers 5's spelling too).
    finish_config: Callable[[dict[str, Any]], None] = _nothing
    # The target head's transforms where the layout's own readers take them (DFlash2: in dflash_config).
    write_head_spec: Callable[[dict[str, Any], HeadSpec], None] = _nothing
    # The target's (embedding, lm_head) under the names the export's file carries them (DSpark: embed_tokens.weight
    # and lm_head.weight, which SGLang requires); none for layouts that share the target's at serve time.
    head_tensors: tuple[str, ...] = ()
    # Refuses a target head the layout cannot describe (DSpark: a plain head only), before anything trains.
    check_head: Callable[[HeadSpec], None] = _nothing

    # The family's DrafterConfig keys from a vLLM speculators save_pretrained config.json: (its config, a reader of
    # a key it must set, a refusal for what the family's model has no equivalent of) -> keyword arguments
    # (consumer/layouts/drafter_import.py). block_size, mask_token_id and target_layer_ids among them replace the
    # block families' keys of those settings (EAGLE-3's layout keeps them otherwise: eagle3/speculators.py).
    speculators_keys: Callable[
        [Mapping[str, Any], Callable[[str], Any], Callable[[str], Exception]], dict[str, Any]
    ] = lambda source, key, refuse: {}
    # `dflash-ring export --layout speculators`: (the config.json of the family's own layout, as export writes it;
    # speculators' verifier {name_or_path, architectures}) -> the config.json of speculators' save_pretrained layout
    # of the family, whose tensor names are the model's own (consumer/layouts/export.py). None: no such writer.
    speculators_layout: Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any]] | None = None
    # Tensor names a released file may give the family's tensors -> ours (z-lab DFlash2's save_pretrained).
    released_names: Mapping[str, str] = field(default_factory=dict)
    # Why a draft tree (independent slots, consumer/evaluation/draft_tree.py) cannot serve the family's drafter; None:
    # it can.
    no_draft_tree: str | None = None
    # Whether the model reads drafter.mask_token_id (a block's unknown slots); EAGLE-3 drafts from its own hidden
    # state and reads none, so a warm start does not compare its release's (speculators' layout records none).
    reads_mask_token: bool = True
    # The training objective on one packed batch: (model, inputs, head, drafter config) -> StepObjective
    # (consumer/training/objective.py). The trainer, the held-out evaluation and the benches call this and nothing else.
    objective: Callable[[torch.nn.Module, ObjectiveInputs, FrozenTargetHead, DrafterConfig], StepObjective] = (
        block_objective
    )
    # The family's own named figures of a step from its objective's output, under the step record's keys
    # (consumer/reporting/step_record.py passes them on as they are to the log, the gauges, the trackers and the record
    # file).
    figures: Callable[[DFlashLoss], dict[str, float]] = lambda out: {}
    # The model FLOPs of one training step, where the family's objective is not the block forward (bench drafter's
    # MFU: bench/drafter.py step_flops counts the block families'): (target config, the drafter's geometry, drafter
    # config, target layers read, tokens, the objective's blocks, supervised drafts, teacher positions) -> FLOPs.
    step_flops: Callable[..., float] | None = None
    # What a run's freshly built drafter takes from files its settings name: (model, drafter config). Only the run's
    # (consumer/training/process.py build): a resume restores its checkpoint over it, a warm start its release, and an
    # export
    # or a bench reads none of those files (EAGLE-3: drafter.draft_vocab's maps).
    initialise: Callable[[torch.nn.Module, DrafterConfig], None] = _nothing

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def display(self) -> str:
        return self.config.display

    def describe(self) -> str:
        """How messages name an export of this family: 'a DSpark drafter (architectures ['Qwen3DSparkModel'])'."""
        return f"a {self.display} drafter (architectures {list(self.architectures)})"
