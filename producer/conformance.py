"""The conformance probe: does this model's packed forward give each sequence its own features?

Run once per target process, after loading and before the first publish. A packed batch of
sequences of different lengths (one longer than any sliding window the model uses) goes through
the packed path; each sequence then goes alone through the model's own unmodified forward (its
own attention implementation, no packing arguments). Every decoder layer up to the deepest
captured one is compared, so an architecture nobody tested is judged by what it computes, not by
its name. A packed path that raises counts as a failure too.

The error of a sequence at a layer is ||packed - alone|| / ||alone|| over all its tokens' hidden
states (relative RMS error): bf16 kernels differ by a few 1e-3 per token and up to ~5e-2 on single
tokens deep in a real-shaped model, while a leak across sequences, a dropped sink or a missed window
moves whole sequences (or every token past the window: the long sequence runs half a window past it)
by 1e-1 and more. The tolerance depends on the dtype only (see TOLERANCE).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from .target import TargetModel
from dflash_ring.common.config.target import TargetConfigError

log = logging.getLogger(__name__)

# Relative RMS error allowed between packed and per-sequence features of a sequence. float32: CPU GEMMs
# round rows differently depending on how many rows a call has (measured up to ~2e-7 on the tiny
# targets); bfloat16/float16 on GPU: the varlen kernel and other GEMM shapes against the per-sequence
# forward (docs/benchmarks.md records the probe's figures on the H200).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}
# Deep bf16 models and MoE routers differ from themselves by more than the dtype tolerance: a near-tie
# routed to another expert in one of two legitimate computations, GEMMs of other shapes (random real
# shapes on the H200: Qwen3-8B's own padded forward differs from one sequence alone by ~4e-2 at layer
# 30, gpt-oss-20b's by up to 3e-1). The model's own padded forward of the same sequences measures that
# floor per layer, and packed may differ by at most NOISE_FACTOR times it. A leak across sequences, a
# dropped sink or a missed window shows where the floor is still low: from the first layers on.
NOISE_FACTOR = 2.0
BASE_LENGTHS = (23, 97, 7, 64, 41)


@dataclass
class LayerCheck:
    layer: int
    kind: str  # the layer type from the config (full_attention, sliding_attention, linear_attention, ...)
    max_error: float  # packed against each sequence alone
    noise_floor: float  # the model's own padded forward against each sequence alone
    allowed: float  # max(dtype tolerance, NOISE_FACTOR x noise floor)

    @property
    def passed(self) -> bool:
        """Every figure finite and the error within the allowance: a NaN compares as no error with `<=`, and an
        infinite allowance (a floor that was not finite) passes anything; a cached report is read through this too."""
        finite = all(map(math.isfinite, (self.max_error, self.noise_floor, self.allowed)))
        return finite and self.max_error <= self.allowed


@dataclass
class ProbeReport:
    model_type: str
    architecture: str
    attn_implementation: str
    dtype: str
    device: str
    lengths: list[int]
    tolerance: float
    layers: list[LayerCheck] = field(default_factory=list)
    error: str | None = None  # the packed path raised this

    @property
    def passed(self) -> bool:
        return self.error is None and all(c.passed for c in self.layers)

    @property
    def max_error(self) -> float | None:
        """The largest error; NaN if any is NaN (Python's max() keeps a NaN only where it comes first)."""
        errors = [c.max_error for c in self.layers]
        return math.nan if any(map(math.isnan, errors)) else max(errors, default=None)

    @property
    def first_bad(self) -> LayerCheck | None:
        return next((c for c in self.layers if not c.passed), None)

    def summary(self) -> str:
        head = f"{self.model_type} ({self.architecture}, {self.attn_implementation} attention, {self.dtype})"
        if self.error is not None:
            return f"{head}: the packed forward raised {self.error}"
        if self.passed:
            return f"{head}: packed features equal each sequence's own forward (max error {self.max_error:.2e})"
        bad = self.first_bad
        if not all(map(math.isfinite, (bad.max_error, bad.noise_floor, bad.allowed))):
            return (
                f"{head}: the probe's figures at layer {bad.layer} ({bad.kind}) are not finite: error "
                f"{bad.max_error:.2e}, the model's own padded forward {bad.noise_floor:.2e}, allowed {bad.allowed:.2e}"
            )
        return (
            f"{head}: packed features differ from each sequence's own forward from layer {bad.layer} "
            f"({bad.kind}) on: error {bad.max_error:.2e} > allowed {bad.allowed:.2e} (the model's own padded "
            f"forward differs by {bad.noise_floor:.2e})"
        )

    def to_json(self) -> dict:
        return {
            **asdict(self),
            "passed": self.passed,
            "max_error": self.max_error,
            "first_bad_layer": None if self.first_bad is None else self.first_bad.layer,
        }

    def table(self) -> str:
        rows = [
            f"{c.layer:>5}  {c.kind:<20} {c.max_error:.2e}   {c.noise_floor:.2e}   {c.allowed:.2e}"
            f"{'  <- differs' if not c.passed else ''}"
            for c in self.layers
        ]
        return "\n".join([f"{'layer':>5}  {'type':<20} {'error':<10} {'padded':<10} allowed", *rows])


def active_sliding_window(config) -> int | None:
    """The window of the model's sliding layers, if any layer uses one (Qwen2/3 carry an unused one)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window:
        return None
    if types is not None:
        return int(window) if "sliding_attention" in types else None
    return int(window) if getattr(config, "use_sliding_window", True) else None


def probe_lengths(config) -> list[int]:
    """Sequences of different lengths; the second runs half a window past any window (capped at the model's limit)."""
    window = active_sliding_window(config) or 0
    longest = min(
        max(BASE_LENGTHS[1], window + max(37, window // 2)), int(getattr(config, "max_position_embeddings", 1 << 30))
    )
    return [BASE_LENGTHS[0], longest, *BASE_LENGTHS[2:]]


def layer_kinds(config, count: int) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types:
        return [str(t) for t in types[:count]]
    return ["sliding_attention" if active_sliding_window(config) else "full_attention"] * count


@torch.inference_mode()
def probe(target: TargetModel, lengths: list[int] | None = None, seed: int = 0) -> ProbeReport:
    """Packed against one-at-a-time on random ids; leaves the target in the packing mode it had."""
    config = target.config
    lengths = list(lengths or probe_lengths(config))
    depth = target.deepest + 1
    report = ProbeReport(
        model_type=config.model_type,
        architecture=(config.architectures or [type(target.decoder).__name__])[0],
        attn_implementation=target.attn_implementation,
        dtype=str(target.dtype).removeprefix("torch."),
        device=str(target.device),
        lengths=lengths,
        tolerance=TOLERANCE.get(target.dtype, 1e-2),
    )
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, int(config.vocab_size), (sum(lengths),), generator=generator)
    bounds = torch.tensor([0, *lengths]).cumsum(0)
    spans = list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))
    was_packed = target.packed
    captured: dict[int, torch.Tensor] = {}
    hooks = [
        layer.register_forward_hook(
            lambda m, a, out, i=i: captured.__setitem__(i, out[0] if isinstance(out, tuple) else out), prepend=True
        )
        for i, layer in enumerate(list(target.decoder.layers)[:depth])
    ]
    try:
        device_ids = ids.to(target.device)
        positions = torch.cat([torch.arange(n) for n in lengths]).to(target.device)
        try:
            target.use_packing(True)  # refuses attention implementations it cannot mirror
            target.forward_packed(
                device_ids, positions, bounds.to(device=target.device, dtype=torch.int32), bounds.tolist()
            )
        except Exception as e:  # noqa: BLE001 - any failure of the packed path is a finding, not a crash
            report.error = f"{type(e).__name__}: {e}"
            return report
        packed = {i: captured[i][0] for i in range(depth)}
        target.use_packing(False)
        width = max(lengths)
        rows = torch.zeros(len(lengths), width, dtype=torch.long)
        mask = torch.zeros(len(lengths), width, dtype=torch.long)
        for r, (a, b) in enumerate(spans):
            rows[r, : b - a], mask[r, : b - a] = ids[a:b], 1
        captured.clear()
        target._run(
            input_ids=rows.to(target.device),
            attention_mask=mask.to(target.device),
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0).to(target.device),
        )
        padded = {i: captured[i] for i in range(depth)}
        errors = torch.zeros(depth, dtype=torch.float64)
        floor = torch.zeros(depth, dtype=torch.float64)
        for r, (a, b) in enumerate(spans):
            captured.clear()
            target._run(input_ids=device_ids[a:b][None])
            for i in range(depth):
                alone = captured[i][0]
                if not bool(torch.isfinite(alone).all()):
                    raise TargetConfigError(non_finite(report, i, layer_kinds(config, depth)[i]))
                # The padded batches are what "auto" falls back to, and their floor the allowance: not finite on a
                # sequence's own tokens, they would train NaN, and an infinite allowance pass any packed error.
                if not bool(torch.isfinite(padded[i][r, : b - a]).all()):
                    raise TargetConfigError(non_finite(report, i, layer_kinds(config, depth)[i], "padded forward"))
                errors[i] = max(errors[i], relative_error(packed[i][a:b], alone))
                floor[i] = max(floor[i], relative_error(padded[i][r, : b - a], alone))
        kinds = layer_kinds(config, depth)
        report.layers = [
            LayerCheck(
                i, kinds[i], float(errors[i]), float(floor[i]), max(report.tolerance, NOISE_FACTOR * float(floor[i]))
            )
            for i in range(depth)
        ]
        return report
    finally:
        for h in hooks:
            h.remove()
        target._captured.clear()
        target.use_packing(was_packed)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| over a whole sequence's hidden states (relative RMS error); infinite where the packed
    states are not finite (a NaN compared by max() or <= would read as no error at all)."""
    got, want = got.double(), want.double()
    if not bool(torch.isfinite(got).all()):
        return float("inf")
    return float((got - want).norm() / want.norm().clamp_min(1e-12))


def non_finite(report: ProbeReport, layer: int, kind: str, forward: str = "forward") -> str:
    """The refusal of a target whose own forward (or its own padded forward, `forward`) gives NaN or inf on a
    sequence's tokens: every batch would train on them."""
    return (
        f"target {report.model_type} ({report.architecture}, {report.dtype}): its own {forward} gives non-finite "
        f"hidden states (NaN or inf) at layer {layer} ({kind}) on the probe's random tokens: its weights or "
        "config.json (rope_theta, rms_norm_eps, a scale) are damaged; check the model directory"
    )


def choose_packing(
    target: TargetModel, mode: str, run_probe: Callable[[TargetModel], ProbeReport] | None = None
) -> ProbeReport | None:
    """Set the target's batch layout for `target.packing` = mode; refuse "packed" when the probe fails. `run_probe`:
    the probe to run, when not this module's own (producer/probe_cache.py's keeps its result for restarts)."""
    if mode == "padded":
        target.use_packing(False)
        return None
    report = (run_probe or probe)(target)
    if report.passed:
        log.info("conformance probe: %s; packed batches", report.summary())
        target.use_packing(True)
        return report
    if mode == "packed":
        raise TargetConfigError(
            f'target.packing = "packed" refused: {report.summary()}. Set target.packing = '
            f'"auto" or "padded" to train on padded batches, or report the model type.'
        )
    log.warning('conformance probe: %s; using padded batches (target.packing = "auto")', report.summary())
    target.use_packing(False)
    return report


def report_json(report: ProbeReport | None, mode: str, packed: bool) -> str:
    body = {
        "packing": mode,
        "chosen": "packed" if packed else "padded",
        "probe": None if report is None else report.to_json(),
    }
    return json.dumps(body, indent=2)
