"""samepath's kernels: one Triton source per op, one frozen schedule per (op, device, dtype)."""

from samepath.kernels.attention import paged_attention, varlen_attention, write_kv_cache
from samepath.kernels.causal_conv1d import causal_conv1d  # noqa: F401  (registers its formula)
from samepath.kernels.config import AttentionConfig, MatmulConfig, attention_config, fingerprint, matmul_config
from samepath.kernels.gated_ops import GATED_OPS_FORMULA  # noqa: F401  (registers its formula)
from samepath.kernels.gelu_tanh_mul import geglu_tanh, gelu_tanh_mul
from samepath.kernels.logprobs import log_softmax, token_logprobs
from samepath.kernels.matmul import batch_invariant, linear, matmul, register_override
from samepath.kernels.reductions import REDUCTIONS_FORMULA  # noqa: F401  (registers softmax / sum / mean overrides)
from samepath.kernels.rms_norm import rms_norm
from samepath.kernels.rotary import apply_rotary, rotary_cos_sin
from samepath.kernels.swiglu import silu_mul, swiglu

__all__ = [
    "AttentionConfig",
    "MatmulConfig",
    "apply_rotary",
    "attention_config",
    "batch_invariant",
    "fingerprint",
    "geglu_tanh",
    "gelu_tanh_mul",
    "linear",
    "log_softmax",
    "matmul",
    "matmul_config",
    "paged_attention",
    "register_override",
    "rms_norm",
    "rotary_cos_sin",
    "silu_mul",
    "swiglu",
    "token_logprobs",
    "varlen_attention",
    "write_kv_cache",
]


def _refuse_shadowed_install() -> None:
    """Raise when ``samepath`` itself was imported as a namespace package (no ``__init__.py``).

    That happens when a folder named ``samepath`` without ``__init__.py`` (a clone of this
    repository, for one) sits in the current directory or the script's folder and the install is
    a setuptools editable finder, which Python consults only after every ``sys.path`` entry: the
    folder wins, ``samepath.logprobs`` and the rest of the package's top level are missing, while
    submodules such as this one still load from the install.
    """
    import os
    import sys

    top = sys.modules.get("samepath")
    if top is None or getattr(top, "__file__", None) is not None:
        return
    folders = ", ".join(str(p) for p in getattr(top, "__path__", [])) or "?"
    installed = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    raise ImportError(
        f"`import samepath` found the folder {folders} (a directory named 'samepath' without an "
        f"__init__.py, such as a clone of the samepath repository) instead of the installed package "
        f"{installed}: the folder shadows it and samepath's top level (samepath.logprobs, ...) is "
        "missing. Run from another directory, or move or rename that folder; or reinstall with "
        "`pip install -e .` from a current clone, whose editable install is found before such folders."
    )


_refuse_shadowed_install()
