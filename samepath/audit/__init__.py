"""Coverage audit, shared by every integration: the report, the shared module rules and the refusal.

:mod:`samepath.audit.report` holds the report (:class:`AuditReport` of :class:`AuditEntry`), the
rules every side shares and :func:`enforce` (fail closed, opt-out ``SAMEPATH_ALLOW_UNCOVERED``);
:mod:`samepath.audit.engine` the walk of a model an inference engine built
(:func:`audit_vllm_model`, with the platform's :class:`ModuleRules`). The platform rules themselves
come from the integrations: the Hugging Face side's in :mod:`samepath.integrations.hf_audit`
(:func:`~samepath.integrations.hf_audit.audit_hf_model`), vLLM's and vllm-ascend's in their
``loader`` modules. Nothing here imports an integration.
"""

from __future__ import annotations

from samepath.audit.engine import VLLM_ATTENTION_MLP, VLLM_STRUCTURE, ModuleRules, audit_vllm_model
from samepath.audit.report import (
    ALLOW_ENV_VAR,
    COVERED,
    NEUTRAL,
    UNCOVERED,
    UNRESOLVED_LAYER_ROPE,
    AuditEntry,
    AuditReport,
    UncoveredOpsError,
    allowed_names,
    embedding_scale_entry,
    enforce,
    generic_entry,
    inside,
    module_entry,
    qualname,
)

__all__ = [
    "ALLOW_ENV_VAR",
    "COVERED",
    "NEUTRAL",
    "UNCOVERED",
    "UNRESOLVED_LAYER_ROPE",
    "VLLM_ATTENTION_MLP",
    "VLLM_STRUCTURE",
    "AuditEntry",
    "AuditReport",
    "ModuleRules",
    "UncoveredOpsError",
    "allowed_names",
    "audit_vllm_model",
    "embedding_scale_entry",
    "enforce",
    "generic_entry",
    "inside",
    "module_entry",
    "qualname",
]
