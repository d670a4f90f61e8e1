"""The Hugging Face RMSNorm forwards samepath installs, one per ``weight_mode`` (a family's
``norm_weight_mode``), and the refusal of ``torch.autocast`` over fp32 norm weights."""

from __future__ import annotations

import torch

from samepath.kernels.rms_norm import rms_norm


def refuse_autocast_over_fp32(weight: torch.Tensor) -> None:
    """A norm's fp32 weight under a lower-precision autocast: the model runs ``torch.autocast`` over
    fp32 modules, whose per-op cast points (fp32 embedding, norms, residual stream; bf16 matmul
    outputs) no lower-precision rollout computes. Refused by name before any mixed-dtype kernel."""
    device = weight.device.type
    if weight.dtype == torch.float32 and torch.is_autocast_enabled(device):
        low = torch.get_autocast_dtype(device)
        if low != torch.float32:
            raise ValueError(
                f"torch.autocast({low}) over fp32 weights is refused: autocast casts only each matmul's operands, "
                "the embedding, norms, residual stream and rotary stay fp32, which no rollout on the weights' "
                f"{low} cast computes. Run the forward on that cast of the weights (fp32 masters: "
                "samepath.rl.Trainer(precision='fp32_master'), functional_call over p.to(dtype))"
            )


def rms_norm_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    refuse_autocast_over_fp32(self.weight)
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def one_plus_weight_rms_norm_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``Gemma3RMSNorm``: the fp32 row times ``1 + weight.float()``, one rounding (its ``eps``)."""
    refuse_autocast_over_fp32(self.weight)
    return rms_norm(hidden_states, self.weight, self.eps, weight_mode="fp32_one_plus_weight")


def fp32_weight_rms_norm_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``GptOssRMSNorm``: ``(weight * fp32 row).to(dtype)``, one rounding. A weight kept in fp32
    (transformers' ``_keep_in_fp32_modules``) runs in the activations' dtype when that holds its
    values exactly (``weight.float()`` is then the same), and is refused otherwise (the rollout holds
    the weight in the model dtype)."""
    weight = self.weight
    if weight.dtype != hidden_states.dtype:
        narrowed = weight.detach().to(hidden_states.dtype)
        if not torch.equal(narrowed.float(), weight.detach().float()):
            raise ValueError(
                f"{type(self).__name__}.weight is {weight.dtype} with values that {hidden_states.dtype} does not hold "
                "exactly; samepath's norm multiplies the weight as the model dtype holds it (as the rollout does)"
            )
        weight = weight.to(hidden_states.dtype)
    return rms_norm(hidden_states, weight, self.variance_epsilon, weight_mode="fp32_weight")


#: ``weight_mode`` (a family's ``norm_weight_mode``) -> the norm forward samepath installs.
RMS_NORM_FORWARDS = {
    "cast_then_weight": rms_norm_forward,
    "fp32_one_plus_weight": one_plus_weight_rms_norm_forward,
    "fp32_weight": fp32_weight_rms_norm_forward,
}


__all__ = [
    "RMS_NORM_FORWARDS",
    "fp32_weight_rms_norm_forward",
    "one_plus_weight_rms_norm_forward",
    "refuse_autocast_over_fp32",
    "rms_norm_forward",
]
