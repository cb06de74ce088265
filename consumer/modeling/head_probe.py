"""Derive the target's head transforms from the target's own code instead of a hand-kept table.

The drafter embeds its block tokens and scores its drafts with the target's frozen embedding and lm_head,
so both must compute what the target computes: the rows its first decoder layer receives (Gemma scales
them by sqrt(hidden) rounded to the weight dtype, Granite and Falcon-H1 by an embedding multiplier) and the
logits it emits (Granite divides by logits_scaling, Cohere multiplies by logit_scale, Falcon-H1 by
lm_head_multiplier, Gemma softcaps). Rather than listing families, the probe builds the target's own
CausalLM class from its config on the meta device, materializes only what lies outside the decoder layers
(embeddings, final norm, rotary buffers, lm_head: never an expert), and runs the model's code:

- a forward pre-hook on the first decoder layer captures what it receives for sample ids, then stops
  the forward; its ratio to the plain lookup is the embedding scale;
- the base model's forward is replaced by one returning given final hidden states, so the CausalLM's
  own forward computes logits from them: small ones read the linear part (the logit multiplier), large
  ones read the cap (the softcap saturates there).

Then the head built from the derived values must reproduce both on fresh ids and hidden states at
float32 tolerance; a transform it does not model (per dimension, per position, nonlinear) is refused
with one line naming what differs and by how much. Everything runs in float32 on the CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dflash_ring.common.refusal import Refusal
from dflash_ring.consumer.modeling.target_head import FrozenTargetHead, HeadSpec

# float32 arithmetic: a head that does what the model does is exact or a few ulp off; a wrong scale,
# a missing multiplier or cap is off by far more (tests/test_drafter_families.py checks both).
TOLERANCE = 1e-5
_TOKENS = 32


class HeadProbeError(Refusal, ValueError):
    """The drafter's head cannot reproduce the target's (one line: which part, the measured error)."""


class _Captured(Exception):
    """Raised by the first layer's pre-hook: what it received; the rest of the forward never runs."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__("first decoder layer reached")
        self.hidden = hidden


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (relative RMS error), in float64."""
    got, want = got.double(), want.double()
    if got.shape != want.shape:
        return math.inf
    return float((got - want).norm() / want.norm().clamp_min(1e-300))


def decoder_layers(decoder: nn.Module) -> nn.ModuleList:
    """The decoder's layer stack: its longest ModuleList child (`layers` in every family we know)."""
    lists = [m for m in decoder.children() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise HeadProbeError(f"{type(decoder).__name__} has no list of decoder layers for the head probe")
    return max(lists, key=len)


class TargetHeadProbe:
    """The target's CausalLM with its decoder layers left on the meta device and the checkpoint's embedding
    and lm_head in place: enough to run its own code up to the first layer, and from the final hidden
    states to the logits."""

    def __init__(self, config, embed: torch.Tensor, lm_head: torch.Tensor | None):
        from transformers import AutoModelForCausalLM  # the modeling code: only when probing (not at a restart)

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.eval()
        self.model = model
        self.decoder = model.get_decoder()
        self.layers = decoder_layers(self.decoder)
        self.vocab, self.hidden = embed.shape
        in_layers = {id(m) for m in self.layers.modules()}
        head = model.get_output_embeddings()
        for module in [*self.decoder.modules(), head]:
            if id(module) not in in_layers:
                module.to_empty(device="cpu", recurse=False)
                model._init_weights(module)  # recomputes non-persistent buffers (rotary, Gemma's embed_scale)
        embedding = model.get_input_embeddings()
        embedding.weight = nn.Parameter(embed.float(), requires_grad=False)
        head.weight = embedding.weight if lm_head is None else nn.Parameter(lm_head.float(), requires_grad=False)

    def first_layer_input(self, ids: torch.Tensor) -> torch.Tensor:
        """What the first decoder layer receives for ids [T] ([T, H])."""

        def stop(module, args, kwargs):
            raise _Captured(args[0] if args else kwargs["hidden_states"])

        hook = self.layers[0].register_forward_pre_hook(stop, with_kwargs=True)
        try:
            with torch.no_grad():
                self.model(input_ids=ids[None], use_cache=False)
        except _Captured as captured:
            return captured.hidden.detach().reshape(-1, captured.hidden.shape[-1])
        finally:
            hook.remove()
        raise HeadProbeError(f"{type(self.model).__name__}'s forward never reached its first decoder layer")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits the CausalLM's own forward computes from final hidden states [T, H]."""
        from transformers.modeling_outputs import BaseModelOutputWithPast

        class Final(BaseModelOutputWithPast):
            def __getattr__(self, name):  # fields the wrapper reads but a text model's output lacks (rope_deltas)
                if name.startswith("__"):
                    raise AttributeError(name)
                return None

        base = self.model.base_model
        base.forward = lambda *args, **kwargs: Final(last_hidden_state=hidden[None])
        try:
            with torch.no_grad():
                ids = torch.zeros(1, hidden.shape[0], dtype=torch.long)
                return self.model(input_ids=ids, use_cache=False).logits[0].float()
        finally:
            del base.forward

    def sample(self, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Random ids [T] and unit-RMS hidden states [T, H]."""
        g = torch.Generator().manual_seed(seed)
        return (torch.randint(0, self.vocab, (_TOKENS,), generator=g), torch.randn(_TOKENS, self.hidden, generator=g))


def _float32(x: float) -> float:
    """x rounded to float32, written as the shortest decimal that rounds back to it (0.1, not 0.10000000149):
    the probe measures in float32, and the JSON it leaves is read by people."""
    return float(str(np.float32(x)))


def _fit(got: torch.Tensor, plain: torch.Tensor) -> float | None:
    """The least-squares scalar s in got = s * plain, as float32; None for 1 (no transform)."""
    got, plain = got.double().flatten(), plain.double().flatten()
    if got.shape != plain.shape:
        raise HeadProbeError(f"the probe's tensors have {got.numel()} and {plain.numel()} elements")
    s = _float32(float(got @ plain / (plain @ plain).clamp_min(1e-300)))
    return None if s == 1.0 else s


def _scaled(hidden: torch.Tensor, weight: torch.Tensor, target_max: float) -> torch.Tensor:
    """hidden rescaled so that its plain logits peak at target_max in magnitude."""
    return hidden * (target_max / F.linear(hidden, weight).abs().max().clamp_min(1e-30))


def derive(probe: TargetHeadProbe, tied: bool) -> HeadSpec:
    """The embedding scale, logit multiplier and softcap the target's own code applies."""
    ids, hidden = probe.sample(seed=0)
    weight = probe.model.get_output_embeddings().weight
    embed_scale = _fit(probe.first_layer_input(ids), F.embedding(ids, probe.model.get_input_embeddings().weight))
    small = _scaled(hidden, weight, 1e-6)  # tanh is linear here for any cap above ~1e-4
    multiplier = _fit(probe.logits(small), F.linear(small, weight))
    large = _scaled(hidden, weight, 1e6 / abs(multiplier or 1.0))
    got, linear = probe.logits(large), F.linear(large, weight) * (multiplier or 1.0)
    capped = relative_error(got, linear) > TOLERANCE
    softcap = _float32(float(got.abs().max())) if capped else None
    return HeadSpec(tied=tied, embed_scale=embed_scale, logit_multiplier=multiplier, logit_softcap=softcap)


@dataclass(frozen=True)
class HeadErrors:
    """The largest relative error of the drafter's head against the target's own code, per part."""

    embedding: float
    logits: float


def measure(probe: TargetHeadProbe, spec: HeadSpec) -> HeadErrors:
    """The head `spec` describes against the target's code, on fresh ids and hidden states: logits at small,
    unit and large scale (and, with a cap, where tanh bends)."""
    model = probe.model
    head = FrozenTargetHead(model.get_input_embeddings().weight, model.get_output_embeddings().weight, spec=spec)
    ids, hidden = probe.sample(seed=1)
    embedding = relative_error(head.embed(ids), probe.first_layer_input(ids))
    weight = head.lm_head_weight
    peaks = [1e-6, None, 1e6 / abs(spec.logit_multiplier or 1.0)]
    if spec.logit_softcap is not None:
        peaks.append(3 * spec.logit_softcap / abs(spec.logit_multiplier or 1.0))
    logits = max(
        relative_error(head.logits(h), probe.logits(h))
        for h in (hidden if p is None else _scaled(hidden, weight, p) for p in peaks)
    )
    return HeadErrors(embedding, logits)


def check(probe: TargetHeadProbe, spec: HeadSpec, where: str) -> HeadErrors:
    """measure, refusing with one line when either part is off by more than TOLERANCE."""
    errors = measure(probe, spec)
    for part, error in (
        ("embedding (what the first decoder layer receives)", errors.embedding),
        ("logits", errors.logits),
    ):
        if not error <= TOLERANCE:
            raise HeadProbeError(
                f"{where}: the drafter's frozen head does not reproduce the target's {part}: relative error "
                f"{error:.3g} > {TOLERANCE:g} with {spec.describe()}; the target applies a transform the head "
                "does not model (per dimension, per position or nonlinear)"
            )
    return errors


def probe_head(config, embed: torch.Tensor, lm_head: torch.Tensor | None, where: str) -> tuple[HeadSpec, HeadErrors]:
    """Derive the head of the target `config` (a transformers config) with its checkpoint's embedding and
    lm_head (None: tied), and verify it; HeadProbeError when the target's own code cannot be run this way or
    the derived head does not reproduce it."""
    spec, errors, _ = probe_head_recorded(config, embed, lm_head, where)
    return spec, errors


def probe_head_recorded(
    config, embed: torch.Tensor, lm_head: torch.Tensor | None, where: str
) -> tuple[HeadSpec, HeadErrors, dict[str, Any]]:
    """probe_head, and the target's own outputs it recorded (`record_outputs`) for the checks of later starts."""
    try:
        probe = TargetHeadProbe(config, embed, lm_head)
        spec = derive(probe, tied=lm_head is None)
        errors = check(probe, spec, where)
        return spec, errors, record_outputs(probe, spec)
    except HeadProbeError:
        raise
    except Exception as e:  # the target's own code failed on the skeleton: say so in one line
        first = str(e).splitlines()[0] if str(e) else ""
        raise HeadProbeError(f"{where}: the head probe could not run {type(e).__name__}: {first}") from e


# What a restart checks a cached head against (head_cache.py keeps it beside the values): the target's own outputs,
# recorded by the probe, for a few ids (the first dims of what its first layer receives) and for hidden states made
# from their embedding rows at each scale `measure` checks (a few vocabulary columns of its logits). The head built
# from the cached values on the checkpoint's tensors must reproduce them, with no modeling code: a digest proves a
# cache is what was written, this that what was written is what the target computes (a value changed and the digest
# recomputed, embed_scale 2.0, a softcap of 1e-30, a multiplier of -1, is off by 1e-1 and more).
_RECORDED_ROWS, _RECORDED_DIMS = 8, 16
# float32 products of other shapes (8 columns here, the whole vocabulary in the probe) round differently by ~1e-7.
RECORDED_TOLERANCE = 1e-4


def _unit_rows(rows: torch.Tensor) -> torch.Tensor:
    """Hidden states made from embedding rows, unit RMS each: no generator, so any start rebuilds them exactly."""
    rows = rows.double()
    return (rows / rows.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-30)).float()


def record_outputs(probe: TargetHeadProbe, spec: HeadSpec) -> dict[str, Any]:
    """The target's own outputs for `outputs_error` to check a cached head against (JSON, a few KB)."""
    ids = probe.sample(seed=2)[0][:_RECORDED_ROWS]
    embed, weight = probe.model.get_input_embeddings().weight, probe.model.get_output_embeddings().weight
    hidden = _unit_rows(embed[ids])
    peak = float(F.linear(hidden, weight).abs().max())
    multiplier = abs(spec.logit_multiplier or 1.0)
    peaks = [1e-6, 1e6 / multiplier, *([3 * spec.logit_softcap / multiplier] if spec.logit_softcap else [])]
    scales = [1.0, *(p / max(peak, 1e-30) for p in peaks)]
    return {
        "ids": ids.tolist(),
        "embedding": probe.first_layer_input(ids)[:, :_RECORDED_DIMS].tolist(),
        "scales": scales,
        "logits": [probe.logits(hidden * scale)[:, ids].tolist() for scale in scales],
    }


def outputs_error(recorded: dict[str, Any], embed: torch.Tensor, lm_head: torch.Tensor | None, spec: HeadSpec) -> float:
    """The largest relative error of the head `spec` describes, on the checkpoint's `embed` and `lm_head` (None:
    tied), against the target's outputs `record_outputs` recorded; inf where the record does not read as one. Only
    the recorded ids' rows are read (on whatever device the tensors are), and the products run in float32 on the
    CPU, as the probe's did."""
    try:
        ids = torch.tensor(recorded["ids"], dtype=torch.long)
        rows = embed[ids.to(embed.device)].float().cpu()
        columns = rows if lm_head is None else lm_head[ids.to(lm_head.device)].float().cpu()
        head = FrozenTargetHead(rows, columns, spec=spec)  # the head on those rows and vocabulary columns only
        hidden = _unit_rows(rows)
        wanted = [torch.tensor(recorded["embedding"], dtype=torch.float32)]
        got = [head.embed(torch.arange(len(ids)))[:, :_RECORDED_DIMS]]
        if len(recorded["scales"]) != len(recorded["logits"]) or not recorded["scales"]:
            return math.inf
        for scale, logits in zip(recorded["scales"], recorded["logits"]):
            wanted.append(torch.tensor(logits, dtype=torch.float32))
            got.append(head.logits(hidden * float(scale)))
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError):  # not a record of this target's outputs
        return math.inf
    errors = [relative_error(g, w) for g, w in zip(got, wanted)]
    return max(errors) if all(map(math.isfinite, errors)) else math.inf  # max() would drop a NaN
