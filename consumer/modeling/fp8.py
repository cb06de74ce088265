"""FP8 training of the drafter's linears (`drafter.precision = "fp8"`): where it can run, and the conversion.

The drafter's GEMMs run ~1.7x faster in FP8 (e4m3, rowwise scales, torch._scaled_mm) on the H200, but an eager
rowwise cast of each activation to FP8 costs about what the GEMM saves: the casts must be fused into the code
around them. torchao's float8 training does that under torch.compile (Float8Linear's casts and scales are traced
into the compiled decoder layers), so the drafter uses it rather than its own kernels.

Where it cannot run (no CUDA device, compute capability below 8.9, torchao missing) a drafter, `check-config`
and `dflash-ring run` refuse in one line; never a silent bf16 run.

Import-light until used: torchao is imported only by `convert_to_fp8`.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

# FP8 tensor cores: Ada (8.9), Hopper (9.0) and later.
FP8_CAPABILITY = (8, 9)
# torch._scaled_mm takes operands whose dims are multiples of 16.
GEMM_MULTIPLE = 16
INSTALL = "pip install 'dflash-ring[fp8]'"


class Fp8Unavailable(RuntimeError):
    """`drafter.precision = "fp8"` where it cannot run; the message says why and what to do."""


def fp8_refusal(device: torch.device | str) -> str | None:
    """Why FP8 training cannot run on `device` ("auto": the GPU if there is one), as one line that says what to do;
    None if it can. Every unmet need is named, so one try shows all that is missing."""
    device = _resolved(device)
    gpu = (
        f"a GPU of compute capability >= {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} "
        "(FP8 tensor cores: Ada, Hopper or later)"
    )
    problems = []
    if not torch.cuda.is_available():
        problems.append(f"no CUDA device here: FP8 training needs {gpu}")
    elif device.type != "cuda":
        problems.append(f"this drafter trains on {device} (train.device, --device): FP8 training needs {gpu}")
    elif device.index is not None and device.index >= torch.cuda.device_count():
        problems.append(f"{device} is not a device here ({torch.cuda.device_count()} visible)")
    elif (capability := torch.cuda.get_device_capability(device)) < FP8_CAPABILITY:
        problems.append(
            f"{torch.cuda.get_device_name(device)} has compute capability {capability[0]}.{capability[1]}: "
            f"FP8 training needs {gpu}"
        )
    if importlib.util.find_spec("torchao") is None:
        problems.append(f"torchao is not installed ({INSTALL})")
    if not problems:
        return None
    return f'drafter.precision = "fp8" cannot run here: {"; ".join(problems)}; or set drafter.precision = "bf16"'


def check_precision(precision: str, device: torch.device | str) -> None:
    """Raise Fp8Unavailable where `precision` cannot run on `device`; bf16 runs anywhere."""
    if precision == "fp8" and (why := fp8_refusal(device)) is not None:
        raise Fp8Unavailable(why)


def _resolved(device: torch.device | str) -> torch.device:
    """train.device "auto" as a drafter resolves it (the GPU when there is one), else the device named."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def fits_fp8(linear: nn.Linear) -> bool:
    return linear.in_features % GEMM_MULTIPLE == 0 and linear.out_features % GEMM_MULTIPLE == 0


def convert_to_fp8(model: nn.Module, recipe: str = "rowwise") -> list[str]:
    """Swap, in place, every nn.Linear of the drafter whose dims fit torch._scaled_mm for torchao's Float8Linear
    with the named float8 recipe (drafter.fp8_recipe); returns the names of those left in bf16 (logged).

    Call before compiling and before building the optimizer. Float8Linear keeps the same weight Parameter, so the
    state_dict's names and shapes and the parameters' order are those of the bf16 model: checkpoints, replica
    averaging and the export see no difference. A linear that does not fit is skipped rather than refused: it
    still trains (in bf16), and the drafter widths of real targets (multiples of 128) all fit; only if none fits
    is it refused, since that would be a bf16 run under the fp8 name.
    """
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise Fp8Unavailable(
            f'drafter.precision = "fp8" needs torchao\'s float8 training, which does not import ({e}): {INSTALL}'
        ) from None
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    skipped = [name for name, m in linears.items() if not fits_fp8(m)]
    if len(skipped) == len(linears):
        raise Fp8Unavailable(
            f'drafter.precision = "fp8": none of the drafter\'s {len(linears)} linears has dims '
            f"that are multiples of {GEMM_MULTIPLE} (torch._scaled_mm needs them): set "
            'drafter.precision = "bf16"'
        )
    convert_to_float8_training(
        model,
        config=Float8LinearConfig.from_recipe_name(recipe),
        module_filter_fn=lambda m, _name: isinstance(m, nn.Linear) and fits_fp8(m),
    )
    if skipped:
        log.warning(
            "fp8: %d of %d linears stay in bf16, their dims not multiples of %d: %s",
            len(skipped),
            len(linears),
            GEMM_MULTIPLE,
            ", ".join(skipped),
        )
    log.info("fp8: %d linears train in FP8 (torchao float8, %s)", len(linears) - len(skipped), recipe)
    return skipped
