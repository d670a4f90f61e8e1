"""The model-loader hook and the load-time audit rules of the vLLM integrations.

Every vLLM model loader's ``load_model`` (:func:`patch_model_loader`) refuses the V2 model runner's
config, then runs :func:`check_loaded_model` on the model it built:
:func:`samepath.audit.audit_vllm_model` classifies every module (the platform's
:class:`~samepath.audit.ModuleRules`: :func:`vllm_rules` here, vllm-ascend's
:func:`samepath.integrations.vllm_ascend.ascend_rules`; each open module by
:func:`classify_module`), and an uncovered one refuses the load by name unless
``SAMEPATH_ALLOW_UNCOVERED`` opts out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from samepath.audit import (
    COVERED,
    NEUTRAL,
    UNCOVERED,
    UNRESOLVED_LAYER_ROPE,
    ModuleRules,
    audit_vllm_model,
    enforce,
    module_entry,
)
from samepath.integrations.patcher import Patcher
from samepath.integrations.vllm.attention import ORIGINAL_FORWARD, check_supported, decoder_attention
from samepath.integrations.vllm.attention import softcap as attention_softcap
from samepath.integrations.vllm.common import has_dense_weight, optional_module
from samepath.integrations.vllm.env import check_v1_model_runner
from samepath.integrations.vllm.gdn import gdn_audit_entry
from samepath.integrations.vllm.layers import (
    UnsupportedRopeError,
    check_plain_routing,
    family_rotary_classes,
    plain_gemma_norm,
    rotary_forward,
    routed_scaling_factor,
    vllm_rope,
    vllm_rope_layout,
)
from samepath.integrations.vllm.mla import hugging_face_config, mla_entry
from samepath.integrations.vllm.sampler import logits_processor_forward
from samepath.integrations.vllm.state import expected_fingerprint, expert_parallel, installed
from samepath.kernels.config import assert_same_numerics
from samepath.kernels.rotary import rotary_inv_freq, rotary_position_limit
from samepath.models.descriptor import FP32_WEIGHT_NORM, SIGMOID_GROUPED_TOPK
from samepath.models.registry import find

logger = logging.getLogger("samepath.integrations.vllm")

#: vLLM linear classes :data:`LINEAR_CLASSES` names.
LINEAR_NAMES = (
    "ReplicatedLinear",
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "RowParallelLinear",
)

#: GateLinear's GEMM tiers other than its plain linear (each a kernel samepath does not run).
ROUTER_GEMM_FLAGS = (
    "allow_ll_bf16_gemm",
    "allow_rocm_bf16x3_router_gemm",
    "allow_fp32_router_gemm",
    "allow_bf16x3_router_gemm",
    "allow_cublas_router_gemm",
    "_use_min_latency_gemm",  # DeepSeek's fused q/kv A projection on Hopper / Blackwell
)


def moe_formula_problem(experts: Any, formulas: dict | None, runner: Any = None) -> str | None:
    """Why the experts' routing (``samepath_routing_fp32`` / ``samepath_routing``, recorded at weight
    processing) differs from the config's family's router (the trainer's, by its descriptor), or
    ``None``; with the ``runner``, a grouped router's parameters are compared with the config's too."""
    if formulas is None or formulas["moe"] is None:
        return None
    family = find(formulas["model_type"])
    want_fp32 = family is not None and family.routing_weights_fp32
    if bool(getattr(experts, "samepath_routing_fp32", False)) != want_fp32:
        return f"routing weights {'not ' if want_fp32 else ''}kept in fp32, unlike the config's router"
    routing = getattr(experts, "samepath_routing", None)
    if family is not None and routing is not None and routing != family.moe:
        return f"routing {routing} differs from the config's {family.moe}"
    if runner is not None and routing == SIGMOID_GROUPED_TOPK:
        moe, router = formulas["moe"], runner.router
        mine = {
            "top_k": router.top_k,
            "n_group": router.num_expert_group,
            "topk_group": router.topk_group,
            "renormalize": bool(router.renormalize),
            "routed_scaling_factor": routed_scaling_factor(runner),
        }
        differ = {key: value for key, value in mine.items() if value != moe[key]}
        if differ:
            return f"router {differ} differs from the config's ({ {key: moe[key] for key in differ} })"
    swiglu = getattr(experts, "samepath_swiglu", None)
    activation = formulas["activation"]
    want = (activation["limit"], activation["alpha"]) if isinstance(activation, dict) else None
    if swiglu != want:
        return f"experts' clamped SwiGLU (limit, alpha) {swiglu} differ from the config's {want} (the trainer's)"
    return None


def attention_impl_problems(impl: Any, patched: bool, check_supported: Callable[[Any], None]) -> list[str]:
    """Why an ``Attention`` layer's ``impl`` is not samepath's: its class not ``patched``, not
    decoder self-attention, or a feature ``check_supported`` refuses (``NotImplementedError``)."""
    problems = []
    if not patched:
        problems.append(f"attention backend {type(impl).__name__} is not patched")
    elif not decoder_attention(impl):
        problems.append("not decoder self-attention")
    try:
        check_supported(impl)
    except NotImplementedError as exc:
        problems.append(str(exc))
    return problems


def vllm_attention_problems(impl: Any) -> list[str]:
    return attention_impl_problems(impl, type(impl) in ORIGINAL_FORWARD, check_supported)


def vllm_moe_entry(name: str, module: torch.nn.Module, formulas: dict | None):
    if type(module).__name__ != "MoERunner" or type(module) is not moe_runner_class():
        return None
    experts = module.routed_experts
    if not getattr(experts, "samepath_experts", False):
        method = getattr(experts, "quant_method", None)
        if method is not None and "Unquantized" not in type(method).__name__:
            detail = f"a quantised MoE ({type(method).__name__}): samepath's experts run unquantised weights only"
            return module_entry(name, module, "moe", UNCOVERED, detail)
        return module_entry(name, module, "moe", UNCOVERED, "experts left on vLLM's fused kernel")
    try:
        shared = bool(getattr(experts, "samepath_shared", False))
        check_plain_routing(module, getattr(experts, "samepath_routing", None), shared)
    except NotImplementedError as exc:
        return module_entry(name, module, "moe", UNCOVERED, str(exc))
    problem = moe_formula_problem(experts, formulas, module)
    if problem is not None:
        return module_entry(name, module, "moe", UNCOVERED, problem)
    kind, size = getattr(experts, "samepath_parallel", ("plain", 1))
    layout = "" if kind == "plain" else f" ({kind}-parallel over {size} ranks)"
    return module_entry(name, module, "moe", COVERED, f"samepath.integrations.moe routing and experts{layout}")


def vllm_rules() -> ModuleRules:
    """vLLM's own classes, as this plugin patches them."""
    from vllm.model_executor.layers.activation import GeluAndMul, SiluAndMul
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    return ModuleRules(
        platform="vLLM plugin",
        installed=installed,
        rms_norm=(RMSNorm,),
        silu_mul=(SiluAndMul,),
        embedding=(VocabParallelEmbedding,),
        lm_head=(ParallelLMHead,),
        logits=(LogitsProcessor,),
        attention=(Attention,),
        linear_methods=(UnquantizedLinearMethod,),
        linear_classes=LINEAR_CLASSES,
        linear_problems=lambda module: [],
        attention_problems=vllm_attention_problems,
        moe=vllm_moe_entry,
        classify=classify_module,
        gemma_rms_norm=(GemmaRMSNorm,),
        gelu_tanh_mul=(GeluAndMul,),
    )


def classify_module(
    name: str,
    module: torch.nn.Module,
    formulas: dict | None,
    hf_rope: tuple | None,
    rules: ModuleRules | None = None,
):
    """The :class:`samepath.audit.AuditEntry` of one module of a model vLLM built,
    as samepath runs it on ``rules``' platform (default :func:`vllm_rules`, this plugin; exact
    classes only; a class without a rule is uncovered).

    ``formulas`` / ``hf_rope`` are the Hugging Face side's resolution of the model's config
    (:func:`samepath.models.formulas.model_formulas`; ``(inv_freq, attention_scaling,
    position_limit)`` of its rope), ``None`` when it could not be resolved: a rotary layer or norm
    that resolves differently from them is uncovered."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    rules = rules or vllm_rules()
    kind = type(module)
    if not rules.installed():
        return module_entry(name, module, "unknown", UNCOVERED, f"samepath's {rules.platform} is not installed")
    entry = gdn_audit_entry(name, module)  # Qwen3-Next's Gated DeltaNet layer and its parts
    if entry is not None:
        return entry
    if kind in rules.lm_head or kind in rules.embedding:
        op = "lm_head" if kind in rules.lm_head else "embedding"
        if type(module.quant_method) is not UnquantizedEmbeddingMethod:
            return module_entry(name, module, op, UNCOVERED, f"{type(module.quant_method).__name__} weights")
        if op == "embedding":
            return module_entry(name, module, op, NEUTRAL, "a row lookup")
        return module_entry(name, module, op, COVERED, "samepath.linear")
    if isinstance(module, LinearBase):
        problems = []
        if type(module.quant_method) not in rules.linear_methods or not has_dense_weight(module):
            problems.append(f"{type(module.quant_method).__name__} / non-dense weights")
        problems += [flag for flag in ROUTER_GEMM_FLAGS if getattr(module, flag, False)]
        if f"{kind.__module__}.{kind.__qualname__}" not in rules.linear_classes:
            problems.append("a linear layer class samepath has not checked")
        problems += rules.linear_problems(module)
        if problems:
            return module_entry(name, module, "linear", UNCOVERED, ", ".join(problems))
        return module_entry(name, module, "linear", COVERED, "samepath.linear")
    if kind in rules.rms_norm:
        plain = (
            module.variance_size_override is None
            and module.has_weight
            and getattr(module, "bias", None) is None
            and module.weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
        )
        if not plain:
            return module_entry(name, module, "rms_norm", UNCOVERED, "a variant samepath's norm does not implement")
        return norm_entry(name, module, formulas, getattr(module, "samepath_weight_mode", "cast_then_weight"))
    if kind in rules.gemma_rms_norm:
        if not plain_gemma_norm(module, module.weight.dtype):
            return module_entry(name, module, "rms_norm", UNCOVERED, "a variant samepath's norm does not implement")
        return norm_entry(name, module, formulas, "fp32_one_plus_weight")
    if kind in rules.silu_mul:
        return module_entry(name, module, "silu_mul", COVERED, "samepath.swiglu")
    if kind in rules.gelu_tanh_mul:
        if module.approximate != "tanh":
            detail = f"GELU approximate={module.approximate!r} (samepath implements the tanh approximation)"
            return module_entry(name, module, "gelu_tanh_mul", UNCOVERED, detail)
        return module_entry(name, module, "gelu_tanh_mul", COVERED, "samepath.geglu_tanh")
    if isinstance(module, (RotaryEmbeddingBase, *family_rotary_classes())):
        if kind.forward is not rotary_forward:
            return module_entry(name, module, "rotary", UNCOVERED, "its own forward (not samepath's rotary)")
        try:
            rotary_dim, base, scaling = vllm_rope(module)
        except UnsupportedRopeError as exc:
            return module_entry(name, module, "rotary", UNCOVERED, str(exc))
        rope = (formulas or {}).get("rope") or {}
        interleaved, mrope_section, _ = vllm_rope_layout(module)
        mla_interleaved = bool((((formulas or {}).get("attention") or {}).get("mla") or {}).get("rope_interleave"))
        if (interleaved and not mla_interleaved) or mrope_section is not None:
            # samepath computes these as Hugging Face's GLM-4 / Qwen-VL do, but no family of
            # samepath.models uses them yet: no trainer resolution to compare with.
            layout = "GPT-J (interleaved) pairs" if interleaved else f"multimodal rope {list(mrope_section)}"
            detail = f"{layout}: no supported model family resolves its rope this way"
            return module_entry(name, module, "rotary", UNCOVERED, detail)
        if rotary_dim != module.head_size and rope.get("rotary_dim") != rotary_dim:
            # Partial rotary only where the trainer's config rotates the same part (GLM-4.5).
            return module_entry(
                name, module, "rotary", UNCOVERED, f"partial rotary ({rotary_dim} of {module.head_size})"
            )
        if hf_rope is UNRESOLVED_LAYER_ROPE:
            detail = "not inside a decoder layer: cannot tell which layer type's rope it must equal"
            return module_entry(name, module, "rotary", UNCOVERED, detail)
        if hf_rope is not None:
            mine = (*rotary_inv_freq(rotary_dim, base, scaling), rotary_position_limit(scaling))
            same = torch.equal(mine[0], hf_rope[0]) and mine[1:] == tuple(hf_rope[1:])
            if not same:
                detail = (
                    f"vLLM resolved the rope as {scaling} (base {base}), which differs from the Hugging Face "
                    "side's resolution of the same config"
                )
                return module_entry(name, module, "rotary", UNCOVERED, detail)
        return module_entry(name, module, "rotary", COVERED, f"samepath.rotary_cos_sin ({scaling['rope_type']})")
    if kind in rules.attention:
        impl = module.impl
        problems = rules.attention_problems(impl)
        scale = formulas["attention"]["scale"] if formulas else None
        if scale is not None and getattr(impl, "scale", scale) != scale:
            problems.append(f"scale {impl.scale} differs from the config's {scale} (the trainer's)")
        if formulas and attention_softcap(impl) != (formulas["attention"]["softcap"] or {}).get("cap"):
            problems.append(
                f"attention logit soft-cap {attention_softcap(impl)} differs from the config's (the trainer's) "
                f"{(formulas['attention']['softcap'] or {}).get('cap')}"
            )
        if problems:
            return module_entry(name, module, "attention", UNCOVERED, "; ".join(problems))
        return module_entry(name, module, "attention", COVERED, "samepath.paged_attention / write_kv_cache")
    entry = rules.moe(name, module, formulas)
    if entry is not None:
        return entry
    entry = mla_entry(name, module, formulas)
    if entry is not None:
        return entry
    if kind in rules.logits:
        if module.soft_cap is not None and module.scale == 1.0:
            return softcap_logits_entry(name, module, formulas)
        if module.soft_cap is not None or module.scale != 1.0:
            detail = f"soft_cap={module.soft_cap}, scale={module.scale}"
            return module_entry(name, module, "logits", UNCOVERED, detail)
        return module_entry(name, module, "logits", NEUTRAL, "the lm_head's logits, gathered")
    return module_entry(name, module, "unknown", UNCOVERED, "samepath has no rule for this module class")


def softcap_logits_entry(name: str, module: torch.nn.Module, formulas: dict | None):
    """A ``LogitsProcessor`` with ``soft_cap`` (Gemma 2's final logits): covered when samepath's forward
    runs it (:func:`samepath.kernels.softcap.softcap_logits`) with the config's cap (the trainer's)."""
    want = ((formulas or {}).get("final_logit_softcap") or {}).get("cap")
    if type(module).forward is not logits_processor_forward:
        detail = f"soft_cap={module.soft_cap} with this logits processor's own tanh (not samepath's)"
        return module_entry(name, module, "logits", UNCOVERED, detail)
    if formulas is not None and module.soft_cap != want:
        detail = f"soft_cap={module.soft_cap} differs from the config's final_logit_softcapping {want} (the trainer's)"
        return module_entry(name, module, "logits", UNCOVERED, detail)
    return module_entry(name, module, "logits", COVERED, f"samepath.kernels.softcap.softcap_logits (cap {want})")


def norm_entry(name: str, module: torch.nn.Module, formulas: dict | None, weight_mode: str):
    """A norm this plugin runs with ``weight_mode``: covered when the config's formulas (the
    trainer's) have the same epsilon and weight mode."""
    if formulas is not None:
        eps, want = formulas["norm"]["eps"], formulas["norm"]["weight_mode"]
        if module.variance_epsilon != eps:
            detail = f"eps {module.variance_epsilon} differs from the config's {eps} (the trainer's)"
            return module_entry(name, module, "rms_norm", UNCOVERED, detail)
        if weight_mode != want:
            detail = f"weight mode {weight_mode} differs from the config's {want} (the trainer's)"
            return module_entry(name, module, "rms_norm", UNCOVERED, detail)
    return module_entry(name, module, "rms_norm", COVERED, f"samepath.rms_norm ({weight_mode}; add, then norm)")


def mark_norm_weight_modes(model: torch.nn.Module, hf_config: Any) -> None:
    """Mark each of vLLM's plain ``RMSNorm`` modules of a family whose norms multiply the weight in
    fp32 (GPT-OSS: ``samepath_weight_mode = "fp32_weight"``), which this plugin's norm then runs and
    the audit checks against the config's formulas."""
    from vllm.model_executor.layers.layernorm import RMSNorm

    family = find(getattr(hf_config, "model_type", None))
    if family is None or family.norm_weight_mode != FP32_WEIGHT_NORM:
        return
    for module in model.modules():
        if type(module) is RMSNorm:
            module.samepath_weight_mode = FP32_WEIGHT_NORM


#: vLLM's ``model_config.hf_config`` of the model loaded in this process (set by the load audit).
LOADED_MODEL_CONFIG: Any = None


def check_loaded_model(
    model: torch.nn.Module,
    hf_config: Any,
    side: str = "vllm",
    rules: Callable[[], ModuleRules] | None = None,
    expected: Callable[[], str | None] | None = None,
) -> None:
    """The load-time gate: audit the model vLLM built (:func:`samepath.audit.audit_vllm_model`
    with ``rules()``, default :func:`vllm_rules`) and refuse uncovered parts
    (:func:`samepath.audit.enforce`, opt-out ``SAMEPATH_ALLOW_UNCOVERED``); then, when
    the trainer's fingerprint (``expected()``; default: the ``SAMEPATH_EXPECT_FINGERPRINT`` this
    plugin's :func:`~samepath.integrations.vllm.install` read) carries a model part, compare it
    with this side's resolution of
    ``hf_config``."""
    global LOADED_MODEL_CONFIG

    hf_config = hugging_face_config(hf_config)  # DeepSeek: the rope_type vLLM renamed in place, back
    if rules is None:  # this plugin's norms (not another platform's)
        mark_norm_weight_modes(model, hf_config)
    report = audit_vllm_model(model, hf_config, rules=(rules or vllm_rules)())
    report.side = side
    enforce(report)
    trainer = (expected or expected_fingerprint)()
    if trainer is not None and not report.problems:
        from vllm.distributed import get_tensor_model_parallel_world_size

        size = get_tensor_model_parallel_world_size()
        assert_same_numerics(trainer, size, model_config=hf_config, expert_parallel=expert_parallel())
    LOADED_MODEL_CONFIG = hf_config
    logger.info("samepath: %s model audited (%s)", side, report.counts())


def patch_model_loader(
    patcher: Patcher,
    side: str = "vllm",
    rules: Callable[[], ModuleRules] | None = None,
    engine: str = "vLLM",
    expected: Callable[[], str | None] | None = None,
) -> bool:
    """Every vLLM model loader's ``load_model`` (``BaseModelLoader`` and the subclasses that
    override it) refuses the V2 model runner's config before loading
    (:func:`~samepath.integrations.vllm.env.check_v1_model_runner`) and runs
    :func:`check_loaded_model` (``side``, ``rules``, ``expected``) on the model it returns, once."""
    loader_module = optional_module("vllm.model_executor.model_loader")
    base_module = optional_module("vllm.model_executor.model_loader.base_loader")
    if loader_module is None or base_module is None:
        return False

    def wrap(original):
        def load_model(self, *args, **kwargs):
            check_v1_model_runner(kwargs.get("vllm_config", args[0] if args else None), engine)
            model = original(self, *args, **kwargs)
            model_config = kwargs.get("model_config", args[1] if len(args) > 1 else None)
            if model_config is not None and not getattr(model, "_samepath_audited", False):
                check_loaded_model(model, model_config.hf_config, side, rules, expected)
                model._samepath_audited = True
            return model

        return load_model

    pending = [base_module.BaseModelLoader]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if "load_model" in vars(cls):
            patcher.set(cls, "load_model", wrap(vars(cls)["load_model"]))
    return True


#: vLLM linear classes whose forward only calls ``quant_method.apply`` (and the TP collectives;
#: GateLinear's other GEMM tiers are checked by their flags).
LINEAR_CLASSES = frozenset(
    [f"vllm.model_executor.layers.linear.{name}" for name in LINEAR_NAMES]
    + ["vllm.model_executor.layers.fused_moe.router.gate_linear.GateLinear"]
    + ["vllm.model_executor.models.deepseek_v2.DeepSeekV2FusedQkvAProjLinear"]
)


def moe_runner_class() -> type | None:
    module = optional_module("vllm.model_executor.layers.fused_moe.runner.moe_runner")
    return getattr(module, "MoERunner", None)


__all__ = [
    "LINEAR_CLASSES",
    "LINEAR_NAMES",
    "LOADED_MODEL_CONFIG",
    "ROUTER_GEMM_FLAGS",
    "attention_impl_problems",
    "check_loaded_model",
    "classify_module",
    "mark_norm_weight_modes",
    "moe_formula_problem",
    "moe_runner_class",
    "norm_entry",
    "patch_model_loader",
    "vllm_attention_problems",
    "vllm_moe_entry",
    "vllm_rules",
]
