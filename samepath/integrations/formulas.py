"""Moved to :mod:`samepath.models.formulas` (the model families' formulas live in the models room);
this name stays because the docs have shown ``samepath.integrations.formulas.model_formulas`` /
``rope_formula``. New code imports :mod:`samepath.models.formulas`."""

from samepath.models.formulas import (
    MOE_ROUTINGS,
    REFUSED,
    RopeFormula,
    UnsupportedModelError,
    embedding_scale,
    layer_types,
    model_fingerprint,
    model_formulas,
    rope_formula,
    rope_formulas,
    routing_weights_fp32,
    sqrt_hidden_scale,
    unsupported_reason,
)

__all__ = [
    "MOE_ROUTINGS",
    "REFUSED",
    "RopeFormula",
    "UnsupportedModelError",
    "embedding_scale",
    "layer_types",
    "model_fingerprint",
    "model_formulas",
    "rope_formula",
    "rope_formulas",
    "routing_weights_fp32",
    "sqrt_hidden_scale",
    "unsupported_reason",
]
