"""One drafter's optimization: a training step on a packed batch, the LR schedule, state to checkpoint.

Kept free of the ring so the same step runs in the drafter process and in the
in-process reference loop the pipeline is checked against.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from dflash_ring.consumer.training.checkpoint import Checkpoint
from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.common.layout import Counter, Role
from dflash_ring.common.slot_contract import item_sources
from dflash_ring.consumer.families import family
from dflash_ring.consumer.modeling.fp8 import check_precision, convert_to_fp8
from dflash_ring.consumer.modeling.model import Anchors, DFlashDraftModel, FrozenTargetHead, sample_anchors
from dflash_ring.consumer.training.objective import ObjectiveInputs, StepObjective
from dflash_ring.consumer.reporting.source_metrics import SourceLabels, SourceStats, add_sources, by_source
from dflash_ring.common.config.train import TrainConfig

if TYPE_CHECKING:
    from dflash_ring.common.ring import ConsumerPort

log = logging.getLogger(__name__)


@dataclass
class DeviceBatch:
    """One ring item on the training device."""

    features: torch.Tensor  # [T, n*H]
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool
    cu_seqlens: torch.Tensor  # [S+1] int64
    final_hidden: torch.Tensor | None = None  # [T, H], only for the KL loss
    meta: dict[str, Any] = field(default_factory=dict)
    source_ids: torch.Tensor | None = None  # [S]: each sequence's source, an index into meta["sources"]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def is_eval(self) -> bool:
        """Held-out rows: evaluated (`Trainer.evaluate`), never trained."""
        return bool(self.meta.get("eval"))


@dataclass
class StepMetrics:
    step: int
    loss: float
    ce: float  # the loss's terms (consumer/training/loss.py): weighted CE, weighted KL, CAP's mean A / (B - 1)
    kl: float
    cap: float
    accuracy_per_position: list[float]
    accept_len: float  # teacher-forced: mean accepted prefix + 1
    accept_len_prob: float  # probabilistic: 1 + expected accepted drafts under the drafter's distribution
    lr: float
    grad_norm: float  # total gradient norm before clipping
    tokens: int
    step_s: float
    # Per data source, summed over the step's micro-batches (empty when items carry no sources).
    by_source: dict[str, SourceStats] = field(default_factory=dict)
    # The family's own named figures (its DrafterFamily.figures: DSpark's tv, tau_probabilistic, accept_rate/pos_k and
    # confidence; DFlash2's selector), under the step record's keys.
    figures: dict[str, float] = field(default_factory=dict)


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warmup then cosine decay to min_lr_ratio * lr; total may grow as estimates improve."""
    total = max(total, step + 1, 1)
    warmup = max(1, int(cfg.warmup_ratio * total))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class StepSchedule:
    """The optimizer steps `lr_at` runs over: train.total_steps when set, else estimated again every step.

    Drafters take items as they come, so an even split of the plan (planned // consumers) was off by
    however unevenly they got them: `step 170/167`, and an LR schedule that ended early. Instead: steps so
    far, plus this batch, the ones prefetched (`pending`) and an even share of the items no drafter has
    taken yet. Re-estimated every step, it reaches the exact final step as the ring runs dry (who takes the
    last few items is a race, so per drafter it cannot be known earlier). A producer that has not announced
    its plan yet counts as planning what the others do.

    Held-out items take no step: the items left are counted at the plans' share of training items (held-out
    batches are spread evenly through every epoch, so what is left holds about that share too, and the
    estimate is still exact as the ring runs dry); a prefetched held-out item is not counted in `pending`.
    """

    def __init__(
        self,
        trainer: Trainer,
        total_steps: int,
        port: ConsumerPort,
        producers: int,
        consumers: int,
        pending: Callable[[], int],
    ):
        self.trainer, self.total_steps, self.port, self.pending = trainer, total_steps, port, pending
        self.producers, self.consumers = producers, consumers

    def total(self) -> int:
        """Optimizer steps this drafter will have taken at the run's end, counting the batch about to train."""
        return self.total_steps or self._estimated()

    def _estimated(self) -> int:
        port, trainer = self.port, self.trainer
        rows = port.rows()
        producers = rows["role"] == Role.PRODUCER
        plans = rows["planned_items"][producers]
        announced = int((plans > 0).sum())
        if announced == 0:
            return max(1, trainer.step + 1)
        planned = int(plans.sum()) * self.producers // announced
        training_share = 1.0 - int(rows["planned_eval_items"][producers].sum()) / int(plans.sum())
        # Released (trained) items are counted; claimed ones (READING: this batch, the prefetched ones, and what
        # other drafters are training) will be trained by their holders, so they are not shared out again.
        left = max(0, planned - port.counter(Counter.CONSUMED) - port.slot_counts()["reading"])
        # Rounded down: the last few items race, the other drafters take them.
        share = int(left * training_share) // self.consumers
        micro = trainer.accumulated + 1 + self.pending() + share  # micro-batches still to train
        return max(trainer.step + 1, trainer.step + micro // trainer.cfg.grad_accum)


class Trainer:
    def __init__(
        self,
        model: DFlashDraftModel,
        head: FrozenTargetHead,
        drafter: DrafterConfig,
        train: TrainConfig,
        device: torch.device,
        sources: SourceLabels | None = None,
    ):
        self.family = family(drafter.arch)
        self.family.check_head(head.spec)  # a target head its layout cannot describe: refused before a step
        self.model = model.to(device)  # fp32 master weights; bf16 only inside autocast on GPU
        fp8 = drafter.precision == "fp8"
        if fp8:  # before compiling (the casts are traced into the layers) and before the optimizer takes the weights
            check_precision(drafter.precision, device)
            convert_to_fp8(self.model, drafter.fp8_recipe)
            head.quantize_fp8()  # and the frozen head's products of the draft in the loss
            # (consumer/modeling/fp8_head.py)
        self.cfg, self.device = train, device
        if self.compiled:  # sdpa groups vary
            self.model.compile_layers(include_fc=fp8)
        elif fp8:
            log.warning(
                "fp8 with eager layers (train.compile = false or attention sdpa): the casts to FP8 are not "
                "fused, so a step may well be slower than in bf16"
            )
        self.head = head
        self.drafter = drafter
        self.cfg = train
        self.device = device
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=train.lr,
            weight_decay=train.weight_decay,
            betas=tuple(train.betas or (0.9, 0.95)),
            fused=device.type == "cuda",
        )
        self.anchor_rng = torch.Generator(device=device).manual_seed(train.seed)
        # Source names as items carry them, mapped onto the configured ones (None: taken as they come).
        self.sources = sources
        self._step_sources: dict[str, SourceStats] = {}
        self.step = 0
        self._micro = 0
        self._hold: torch.cuda.Event | None = None

    @property
    def micro_batches(self) -> int:
        """Micro-batches whose gradient went into the model so far (a batch with nothing to supervise adds none)."""
        return self._micro

    @property
    def accumulated(self) -> int:
        """Micro-batches already in the gradient of the optimizer step under way (0..grad_accum-1)."""
        return self._micro % self.cfg.grad_accum

    def train_step(self, batch: DeviceBatch, total_steps: int) -> StepMetrics | None:
        """Forward, backward and (every grad_accum micro-batches) an optimizer step."""
        t0 = time.perf_counter()
        self.model.train()
        anchors = sample_anchors(batch.loss_mask, batch.cu_seqlens, self.drafter.num_anchors, self.anchor_rng)
        if anchors.num_blocks == 0:
            return None  # nothing supervisable in this batch (e.g. all prompt)
        step = self._forward(batch, anchors)
        out = step.out
        (out.loss / self.cfg.grad_accum).backward()
        add_sources(self._step_sources, self._by_source(batch, step))
        self._micro += 1
        if self._micro % self.cfg.grad_accum:
            return None
        lr, grad_norm = self._update(total_steps)
        step_sources, self._step_sources = self._step_sources, {}
        return StepMetrics(
            step=self.step,
            loss=float(out.loss.detach()),
            ce=float(out.ce),
            kl=float(out.kl),
            cap=float(out.cap),
            accuracy_per_position=[round(float(a), 4) for a in out.accuracy_per_position],
            accept_len=float(out.accept_len),
            accept_len_prob=float(out.accept_len_prob),
            lr=lr,
            grad_norm=float(grad_norm),
            tokens=batch.num_tokens,
            step_s=time.perf_counter() - t0,
            by_source=step_sources,
            figures=self.family.figures(out),
        )

    def _update(self, total_steps: int) -> tuple[float, torch.Tensor]:
        """The optimizer step on the gradient accumulated so far: (its learning rate, the gradient's norm)."""
        lr = lr_at(self.step, total_steps, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        # The norm is computed either way (it is logged); clipping to inf leaves the gradient as it is.
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
        )
        if self._hold is not None:  # a checkpoint snapshot still copying these weights and moments out
            torch.cuda.current_stream(self.device).wait_event(self._hold)
            self._hold = None
        # A gradient that is not finite updates nothing: AdamW would write it into both moments and every weight
        # (consumer/training/nonfinite.py counts such steps and ends a drafter that keeps taking them). The norm's one
        # host sync is the step's figures' own, taken a little earlier.
        if math.isfinite(float(grad_norm)):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return lr, grad_norm

    def flush(self, total_steps: int) -> int:
        """At the end, the micro-batches of an unfinished accumulation become one last, smaller optimizer step (their
        mean gradient): a checkpoint holds no gradient, so without it they would be in no saved state. Returns how
        many micro-batches it applied."""
        pending = self.accumulated
        if pending:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(self.cfg.grad_accum / pending)
            self._update(total_steps)
            self._micro += self.cfg.grad_accum - pending
            self._step_sources = {}
        return pending

    def evaluate(self, batch: DeviceBatch) -> dict[str, SourceStats]:
        """The teacher-forced figures of a held-out item, per source: no gradient, no update, and none of the
        training stream's state moves (its anchors come from a generator seeded by the item's identity, not
        from `anchor_rng`), so a run's training is the same with or without a held-out split's items in
        between, and an item's figures are the same whichever drafter evaluates it, whenever."""
        meta = batch.meta
        key = f"{self.cfg.seed}/{meta.get('producer')}/{meta.get('epoch')}/{meta.get('position')}".encode()
        rng = torch.Generator(device=self.device).manual_seed(
            int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
        )
        anchors = sample_anchors(batch.loss_mask, batch.cu_seqlens, self.drafter.num_anchors, rng)
        if anchors.num_blocks == 0:
            return {}
        with torch.no_grad():  # the drafter has no dropout: train mode is kept (no recompile of compiled layers)
            step = self._forward(batch, anchors)
        return self._by_source(batch, step)

    def _forward(self, batch: DeviceBatch, anchors: Anchors) -> StepObjective:
        """The family's objective on the batch (consumer/training/objective.py)."""
        inputs = ObjectiveInputs(
            features=batch.features,
            input_ids=batch.input_ids,
            loss_mask=batch.loss_mask,
            cu_seqlens=batch.cu_seqlens,
            final_hidden=batch.final_hidden if self.drafter.needs_target_logits else None,
            anchors=anchors,
            attention=self.cfg.attention_for(self.device.type),
            anchors_per_group=self.cfg.anchors_per_group,
        )
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            return self.family.objective(self.model, inputs, self.head, self.drafter)

    def _by_source(self, batch: DeviceBatch, step: StepObjective) -> dict[str, SourceStats]:
        if batch.source_ids is None:
            return {}
        names = item_sources(batch.meta)
        labels = self.sources.of(names) if self.sources is not None else names
        return by_source(step.out, step.blocks, batch.source_ids, batch.loss_mask, labels)

    @property
    def compiled(self) -> bool:
        """Whether the first steps compile (train.compile with flex attention on a GPU: consumer/modeling/model.py)."""
        return self.cfg.compile and self.device.type == "cuda" and self.cfg.attention_for("cuda") == "flex"

    def precompile(self, max_tokens: int, max_length: int, force: bool = False) -> float:
        """Compile what the first steps compile, before any item arrives: forward and backward on two synthetic
        packed batches of real batches' widths (`max_tokens` tokens in sequences of at most `max_length`; two token
        counts, so that the graphs torch.compile makes dynamic on its second shape are made too). Nothing that
        training depends on moves: the gradients are dropped, no optimizer step is taken, the anchors come from a
        generator of their own and the RNG states are put back, so a step after this is the step it would have been.
        A warm standby does it while it waits, a restarted drafter while its checkpoint loads; with the persistent
        compile cache (common/compile_cache.py) it loads graphs rather than compiles them. No-op when nothing compiles
        (`force`: run it anyway, as the CPU tests do). Returns the seconds it took."""
        if not (self.compiled or force):
            return 0.0
        t0 = time.perf_counter()
        self.model.train()  # as train_step runs it (a mode change would recompile)
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        rng = torch.Generator(device=self.device).manual_seed(0)
        width, hidden = self.model.fc.in_features, self.model.config.hidden_size
        dtype = self.head.embed_weight.dtype
        for tokens in (max_tokens, max(2, max_tokens * 3 // 4)):
            lengths = [min(max_length, tokens - start) for start in range(0, tokens, max_length)]
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.long, device=self.device)
            # Every sequence's second half is its reply: the part the loss supervises.
            position = torch.arange(tokens, device=self.device) - torch.repeat_interleave(
                cu[:-1], torch.tensor(lengths, device=self.device)
            )
            batch = DeviceBatch(
                features=torch.randn(tokens, width, generator=rng, device=self.device).to(dtype),
                input_ids=torch.randint(
                    0, self.head.embed_weight.shape[0], (tokens,), generator=rng, device=self.device
                ),
                loss_mask=position
                >= torch.repeat_interleave(
                    torch.tensor(lengths, device=self.device) // 2, torch.tensor(lengths, device=self.device)
                ),
                cu_seqlens=cu,
                final_hidden=(
                    torch.randn(tokens, hidden, generator=rng, device=self.device).to(dtype)
                    if self.drafter.needs_target_logits
                    else None
                ),
            )
            anchors = sample_anchors(batch.loss_mask, batch.cu_seqlens, self.drafter.num_anchors, rng)
            if anchors.num_blocks:
                self._forward(batch, anchors).out.loss.backward()
        for p in self.model.parameters():
            p.grad = None
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, self.device)
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def hold_updates(self, copied: torch.cuda.Event | None) -> None:
        """The next optimizer step waits, on the device and not the host, until `copied` has passed: a checkpoint
        snapshot's copy of the weights and moments overlaps the next forward and backward, never their update.
        (Replica averaging writes the weights only after an optimizer step, so it waits too.)"""
        self._hold = copied

    def state(self, info: dict[str, Any]) -> Checkpoint:
        """The state to checkpoint, by reference: the live weights and optimizer state, fresh RNG states."""
        tensors = {"rng.torch": torch.get_rng_state(), "rng.anchors": self.anchor_rng.get_state()}
        if self.device.type == "cuda":
            tensors["rng.cuda"] = torch.cuda.get_rng_state(self.device)
        return Checkpoint(
            self.step, self.model.state_dict(), self.optimizer.state_dict(), tensors, dict(info, micro=self._micro)
        )

    def restore(self, ckpt: Checkpoint) -> None:
        self.model.load_state_dict(ckpt.model)
        self.optimizer.load_state_dict(ckpt.optimizer)
        torch.set_rng_state(ckpt.tensors["rng.torch"])
        self.anchor_rng.set_state(ckpt.tensors["rng.anchors"])
        if self.device.type == "cuda" and "rng.cuda" in ckpt.tensors:
            torch.cuda.set_rng_state(ckpt.tensors["rng.cuda"], self.device)
        self.step = ckpt.step
        self._micro = int(ckpt.info.get("micro", ckpt.step * self.cfg.grad_accum))
