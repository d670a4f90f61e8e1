"""The Triton attention backend (the default): the kernels of ``forward.py``, ``merge.py`` and
``backward.py`` on every device, registered as ``triton``. Its fingerprint rows are its name: the
Triton kernels' formula and tables are the fingerprint's own (``config.ATTENTION_FORMULA``, ...)."""

from __future__ import annotations

from samepath.kernels.attention.backend import AttentionBackend, register_backend
from samepath.kernels.attention.backward import launch_backward
from samepath.kernels.attention.forward import launch_forward

NAME = "triton"


def fingerprint() -> dict[str, object]:
    """What ``samepath.fingerprint()`` hashes about this backend."""
    return {"name": NAME}


register_backend(AttentionBackend(NAME, forward=launch_forward, backward=launch_backward, fingerprint=fingerprint))
