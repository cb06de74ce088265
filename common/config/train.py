"""How a drafter trainer optimizes and where it keeps its checkpoints."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from dflash_ring.common.config.paths import OutputDirectory
from dflash_ring.common.config.ranges import AtLeastOne, Fraction, Positive, Range, Share

# The most optimizer steps a drafter takes (train.total_steps' bound, see there); a step read back from a file
# (the record file, consumer/reporting/tracking.py) past it was not written by a drafter.
MAX_STEPS = 1_000_000_000


@dataclass
class TrainConfig:
    # AdamW with fp32 master weights (SpecForge's paper-aligned defaults).
    lr: Positive = 6e-4
    weight_decay: float = 0.0
    betas: list[Share] | None = None  # None -> [0.9, 0.95]; AdamW takes each in [0, 1)
    warmup_ratio: Share = 0.04
    min_lr_ratio: Fraction = 0.0
    # 0: estimate from the batches the producers plan, divided among the drafters. The LR schedule's length: real
    # runs take 1e4 to 1e6 steps; 1e9 is far past any run (days at a step a millisecond) and keeps the schedule's
    # step / total_steps arithmetic exact in a float.
    total_steps: Annotated[int, Range(0, MAX_STEPS)] = 0
    # 0: no clipping.
    grad_clip: float = 1.0
    # A loss or gradient norm that is not finite for this many optimizer steps in a row ends the drafter with
    # EXIT_DIVERGED (common/lifecycle/diverged.py); such a step's update is skipped. One bad batch is survived; a run
    # whose lr or weight decay blew it up, or a target whose features are NaN, stops within a few steps.
    max_nonfinite_steps: Annotated[int, Range(1, 1_000_000)] = 3
    grad_accum: AtLeastOne = 1
    seed: int = 0
    # "auto": cuda:<index of this drafter among visible GPUs> when CUDA is present, else cpu.
    device: str = "auto"
    # "flex": one block-sparse flex_attention call per layer (compiled; the GPU default under "auto").
    # "sdpa": masked SDPA per group of anchors_per_group blocks (eager; the CPU default under "auto").
    attention: Literal["auto", "flex", "sdpa"] = "auto"
    # torch.compile the decoder layers on a GPU (fuses the elementwise work; the first steps compile).
    compile: bool = True
    anchors_per_group: AtLeastOne = 64
    # Replicas on one host average parameters through shared memory every this many steps (0: never).
    average_every_steps: int = 50
    checkpoint_dir: OutputDirectory = "runs/default/checkpoints"
    checkpoint_every_steps: AtLeastOne = 200
    keep_checkpoints: AtLeastOne = 3
    # Copy the state to host memory in the step and write the checkpoint on a thread
    # (consumer/training/async_checkpoint.py); false: write it in the step. A kill mid-write loses up to two intervals
    # of updates instead of one.
    async_checkpoints: bool = True
    log_every_steps: AtLeastOne = 10
    # Held-out items (data.eval_fraction, eval = true sources) are evaluated as they arrive (their slot is
    # released only then, so each is evaluated exactly once); their figures are reported every this many steps.
    eval_every_steps: AtLeastOne = 100

    def attention_for(self, device_type: str) -> str:
        if self.attention != "auto":
            return self.attention
        return "flex" if device_type == "cuda" else "sdpa"

    def __post_init__(self) -> None:
        if self.betas is not None and len(self.betas) != 2:
            raise ValueError(f"betas must be two numbers, got {self.betas}")
