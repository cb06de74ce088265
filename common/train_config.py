"""How a drafter trainer optimizes and where it keeps its checkpoints."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class TrainConfig:
    # AdamW with fp32 master weights (SpecForge's paper-aligned defaults).
    lr: float = 6e-4
    weight_decay: float = 0.0
    betas: list[float] | None = None  # None -> [0.9, 0.95]
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0
    # 0: estimate from the batches the producers plan, divided among the drafters.
    total_steps: int = 0
    grad_clip: float = 1.0
    grad_accum: int = 1
    seed: int = 0
    # "auto": cuda:<index of this drafter among visible GPUs> when CUDA is present, else cpu.
    device: str = "auto"
    # "flex": one block-sparse flex_attention call per layer (compiled; the GPU default under "auto").
    # "sdpa": masked SDPA per group of anchors_per_group blocks (eager; the CPU default under "auto").
    attention: Literal["auto", "flex", "sdpa"] = "auto"
    # torch.compile the decoder layers on a GPU (fuses the elementwise work; the first steps compile).
    compile: bool = True
    anchors_per_group: int = 64
    # Replicas on one host average parameters through shared memory every this many steps (0: never).
    average_every_steps: int = 50
    checkpoint_dir: str = "runs/default/checkpoints"
    checkpoint_every_steps: int = 200
    keep_checkpoints: int = 3
    # Copy the state to host memory in the step and write the checkpoint on a thread (consumer/async_checkpoint.py);
    # false: write it in the step. A kill mid-write loses up to two intervals of updates instead of one.
    async_checkpoints: bool = True
    log_every_steps: int = 10
    # Held-out items (data.eval_fraction, eval = true sources) are evaluated as they arrive (their slot is
    # released only then, so each is evaluated exactly once); their figures are reported every this many steps.
    eval_every_steps: int = 100

    def attention_for(self, device_type: str) -> str:
        if self.attention != "auto":
            return self.attention
        return "flex" if device_type == "cuda" else "sdpa"

    def __post_init__(self) -> None:
        if self.lr <= 0 or not 0 <= self.warmup_ratio < 1 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("need lr > 0, 0 <= warmup_ratio < 1 and 0 <= min_lr_ratio <= 1")
        if self.grad_accum < 1 or self.checkpoint_every_steps < 1 or self.keep_checkpoints < 1:
            raise ValueError("grad_accum, checkpoint_every_steps and keep_checkpoints must be >= 1")
        if self.eval_every_steps < 1:
            raise ValueError(f"train.eval_every_steps = {self.eval_every_steps}: must be >= 1 (how often the held-out "
                             "items' figures are reported)")
        if self.betas is not None and len(self.betas) != 2:
            raise ValueError(f"betas must be two numbers, got {self.betas}")
