"""Final logit soft-capping on the Hugging Face side: ``{Prefix}ForCausalLM.forward`` with the logits
capped by :func:`samepath.kernels.softcap.softcap_logits` (Gemma 2's ``final_logit_softcapping``).

Hugging Face's ``Gemma2ForCausalLM.forward`` caps in torch (``logits / cap``, ``tanh``, ``* cap``, each
rounded to the dtype); the replacement runs the same decoder and lm_head and caps with samepath's kernel,
the function vLLM's ``LogitsProcessor`` runs under samepath's plugin and the fused lm_head
(:func:`samepath.kernels.logprobs.linear_token_logprobs` with ``softcap``) applies. Its arguments are the
original forward's (bound to its signature, so the transformers version's names hold).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from samepath.kernels.softcap import softcap_logits
from samepath.models.formulas import final_logit_softcap


def _keep(hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    try:
        from transformers.modeling_utils import slice_logits_to_keep
    except ImportError:  # transformers < 5.2x: an int or a 1-D tensor of positions
        index = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return hidden[:, index, :]
    return slice_logits_to_keep(hidden, logits_to_keep)


def softcapped_causal_lm_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    """The ``forward`` of a causal LM class whose ``original`` forward soft-caps its logits in torch:
    the same decoder, lm_head and loss, with :func:`softcap_logits` of ``config.final_logit_softcapping``
    (no cap when it is ``None``). Marked ``samepath_softcap`` for the audit."""
    signature = inspect.signature(original)
    var_keyword = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)

    @functools.wraps(original)
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        bound = signature.bind(self, *args, **kwargs)
        params = {name: value for name, value in bound.arguments.items() if name != "self"}
        extra = dict(params.pop(var_keyword, {})) if var_keyword else {}
        labels = params.pop("labels", None)
        logits_to_keep = params.pop("logits_to_keep", 0)
        return_dict = extra.pop("return_dict", None)
        outputs = self.model(**params, **extra)
        logits = self.lm_head(_keep(outputs.last_hidden_state, logits_to_keep))
        cap = final_logit_softcap(self.config)
        if cap is not None:
            logits = softcap_logits(logits, cap)
        loss = None if labels is None else self.loss_function(logits, labels, self.vocab_size, **extra)
        rest = {key: value for key, value in outputs.items() if key != "last_hidden_state"}
        out = CausalLMOutputWithPast(loss=loss, logits=logits, **rest)
        return out.to_tuple() if return_dict is False else out

    forward.samepath_softcap = True
    return forward


def is_softcapped_forward(forward: Any) -> bool:
    """Whether ``forward`` is one :func:`softcapped_causal_lm_forward` made."""
    return getattr(forward, "samepath_softcap", False)


__all__ = ["is_softcapped_forward", "softcapped_causal_lm_forward"]
