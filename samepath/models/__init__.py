"""Model families: one descriptor per family and one registry (``config.model_type`` -> family).

A family is a module of this package defining ``FAMILY``, a :class:`ModelFamily`: its Hugging
Face and vLLM classes by name, its norm, activation, rope and MoE routing, its attention features.
:mod:`samepath.models.formulas` resolves a config into the formulas both sides run (and the model
part of :func:`samepath.fingerprint`); :mod:`samepath.integrations.hf` patches each family's
classes by its descriptor. :mod:`samepath.models.refused` lists the families samepath refuses, with
the reason. Adding a family is one file here and its tests.
"""

from samepath.models.descriptor import ModelFamily, UnsupportedModelError
from samepath.models.formulas import model_fingerprint, model_formulas, rope_formula, rope_formulas
from samepath.models.registry import families, family, find, refusal_reason, refusals, register, unregister

__all__ = [
    "ModelFamily",
    "UnsupportedModelError",
    "families",
    "family",
    "find",
    "model_fingerprint",
    "model_formulas",
    "refusal_reason",
    "refusals",
    "register",
    "rope_formula",
    "rope_formulas",
    "unregister",
]
