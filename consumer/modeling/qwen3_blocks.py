"""The Qwen3 pieces the drafter is built from: RMSNorm, the SwiGLU MLP, rotate_half and the RoPE frequencies.

The same code and parameter names as transformers' modeling_qwen3 (tests/test_drafter_model.py checks
them against it), written here because importing that module costs a drafter more than a second of
start-up on a small box (generation, masking and tensor-parallel machinery it never uses): a drafter
restarted after a kill trains that much sooner. The default RoPE is computed here as transformers computes
it; every other rope type comes from transformers' modeling_rope_utils (on a Qwen3Config), so it means what HF
means.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen3RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class Qwen3MLP(nn.Module):
    """SwiGLU; the drafter's config always says silu (consumer/layouts/drafter_hf_config.py)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"drafter hidden_act {config.hidden_act!r}: a Qwen3 drafter MLP is SwiGLU (silu)")
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rope_frequencies(config: PretrainedConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2], attention scaling) as Qwen3RotaryEmbedding(config) computes them."""
    params = config.rope_parameters
    if params["rope_type"] != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # of a Qwen3Config (model_config)

        return ROPE_INIT_FUNCTIONS[params["rope_type"]](config)
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


def rope_parameters(theta: float, scaling: Mapping[str, Any] | None) -> dict[str, Any]:
    """The rotary as transformers 5 writes it (`rope_parameters`: rope_type and rope_theta inside), from the legacy
    rope_theta/rope_scaling pair: the same RoPE in the spelling transformers-5 readers and the third-party DSpark
    loaders' schema (rope_parameters.rope_type) read."""
    rest = {k: v for k, v in (scaling or {}).items() if k not in ("rope_type", "type")}
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    return {"rope_type": rope_type, "rope_theta": theta, **rest}
