"""``batch_invariant()``: torch's own ops routed to samepath's kernels while a block is open.

The ops' modules register their overrides here (:func:`register_override`): the matmul family
(``aten::mm`` / ``addmm`` / ``bmm``, :mod:`samepath.kernels.matmul`), ``aten::_log_softmax``
(:mod:`samepath.kernels.logprobs`), ``aten::_softmax``, ``aten::sum.dim_IntList`` and
``aten::mean.dim`` (:mod:`samepath.kernels.reductions`). :mod:`samepath.kernels.matmul`
re-exports these names.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

#: (aten op name, implementation) pairs registered by :func:`batch_invariant`, in order. The
#: matmul family comes first (:mod:`samepath.kernels.matmul` registers it at import); other ops'
#: modules append theirs through :func:`register_override` (e.g. ``("_log_softmax", fn)``).
OVERRIDES: list[tuple[str, Callable[..., torch.Tensor]]] = []


def register_override(op_name: str, fn: Callable[..., torch.Tensor]) -> None:
    """Add an ``aten`` op override to :func:`batch_invariant` (takes effect at the next outermost
    entry). ``fn`` receives the op's arguments below autograd, for CPU/CUDA/NPU tensors, and must
    handle (or hand back to torch's ``.out`` overload) every dtype the op accepts."""
    if not isinstance(op_name, str) or not callable(fn):
        raise ValueError("register_override takes an aten op name (str) and a callable")
    name = op_name.removeprefix("aten::")
    for existing, existing_fn in OVERRIDES:
        if existing == name:
            if existing_fn is fn:
                return
            raise ValueError(f"aten::{name} already has a batch-invariant override")
    OVERRIDES.append((name, fn))


def dispatch_keys() -> list[str]:
    """Dispatch keys the overrides are registered for: CPU, CUDA, and PrivateUse1 when a backend
    (torch_npu renames it to ``npu``) has claimed it."""
    keys = ["CPU", "CUDA"]
    if torch._C._get_privateuse1_backend_name() != "privateuseone":
        keys.append("PrivateUse1")
    return keys


_routing_lock = threading.RLock()
_routing_depth = 0
_routing_library: torch.library.Library | None = None
# Depth of routed functional overrides running on this thread: their fallbacks call torch's
# ``.out`` kernel through the (then overridden) ``.out`` overload, which must reach torch's kernel.
_inside = threading.local()
# torch >= 2.9 keeps torch's own kernel reachable once overridden (``torch.library.get_kernel``);
# older torch routes the functional overloads only.
_HAS_GET_KERNEL = hasattr(torch.library, "get_kernel")


def _arguments(schema) -> list[tuple[str, str]]:
    return [(a.name, str(a.type)) for a in schema.arguments if not (a.alias_info and a.alias_info.is_write)]


def variants(op_name: str) -> list[tuple[str, str]]:
    """The ``.out`` and in-place overloads of a routed functional ``aten`` op, as ``(name, kind)``
    with kind ``"out"`` or ``"inplace"``: the overloads of the same packet whose schema is the
    functional's plus written ``out`` arguments (``aten::mm.out``, ``aten::sum.IntList_out``), and
    the ``<op>_`` packet's overloads with the functional's arguments (``aten::addmm_``)."""
    base, _, overload = op_name.removeprefix("aten::").partition(".")
    functional = getattr(getattr(torch.ops.aten, base), overload or "default")._schema
    wanted = [(a.name, str(a.type)) for a in functional.arguments]
    found = []
    for packet, kind in ((base, "out"), (base + "_", "inplace")):
        ops = getattr(torch.ops.aten, packet, None)
        for name in ops.overloads() if ops is not None else ():
            schema = getattr(ops, name)._schema
            writes = [a for a in schema.arguments if a.alias_info and a.alias_info.is_write]
            if kind == "out" and writes and all(a.kwarg_only for a in writes) and _arguments(schema) == wanted:
                found.append((f"{packet}.{name}" if name != "default" else packet, kind))
            elif kind == "inplace" and [(a.name, str(a.type)) for a in schema.arguments] == wanted:
                found.append((f"{packet}.{name}" if name != "default" else packet, kind))
    return found


def _guarded(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def routed(*args, **kwargs):
        _inside.depth = getattr(_inside, "depth", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _inside.depth -= 1

    return routed


def _write(out: torch.Tensor, result: torch.Tensor) -> None:
    if out.shape != result.shape:
        if out.numel() != 0:
            warnings.warn(
                f"samepath.batch_invariant(): an out= tensor of shape {tuple(out.shape)} was resized to "
                f"{tuple(result.shape)} (torch resizes it too, with this warning)",
                UserWarning,
                stacklevel=3,
            )
        out.resize_(result.shape)
    out.copy_(result)  # same dtype: a bitwise copy


def _variant_impl(kind: str, variant: str, routed: Callable[..., torch.Tensor], key: str):
    """The ``.out`` / in-place overload: the routed functional's result written into ``out`` (or
    ``self``). A call samepath's functional does not cover in place (an ``out`` of another dtype or
    device than the result's) and the functional overrides' own fallbacks reach torch's kernel."""
    stock = torch.library.get_kernel(f"aten::{variant}", key)
    schema = getattr(getattr(torch.ops.aten, variant.partition(".")[0]), variant.partition(".")[2] or "default")._schema
    out_names = [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write and a.kwarg_only]

    def impl(keyset, *args, **kwargs):
        if getattr(_inside, "depth", 0):
            return stock.call_boxed(keyset, *args, **kwargs)
        if kind == "inplace":
            targets = [args[0]]
        else:
            targets = [kwargs.pop(name) for name in out_names]
        result = routed(*args, **kwargs)
        results = list(result) if isinstance(result, (tuple, list)) else [result]
        mismatched = any(
            t.dtype != r.dtype or t.device != r.device or (kind == "inplace" and t.shape != r.shape)
            for t, r in zip(targets, results, strict=True)
        )
        if mismatched:
            # torch's kernel decides (casts or refuses) an ``out`` of another dtype or device, or a
            # ``self`` an in-place op cannot hold the result in.
            if kind == "out":
                kwargs.update(zip(out_names, targets, strict=True))
            return stock.call_boxed(keyset, *args, **kwargs)
        for target, value in zip(targets, results, strict=True):
            _write(target, value)
        return targets[0] if len(targets) == 1 else tuple(targets)

    return impl


def _register() -> torch.library.Library:
    library = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            # torch warns that the stock kernel is overridden: that is the point, and it comes back on exit.
            warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
            for key in dispatch_keys():
                impls = []
                for op_name, fn in OVERRIDES:
                    routed = _guarded(fn)
                    impls.append((op_name, routed, False))
                    for variant, kind in variants(op_name) if _HAS_GET_KERNEL else ():
                        try:
                            impl = _variant_impl(kind, variant, routed, key)
                        except RuntimeError:  # this build has no kernel for the key (CUDA in a CPU wheel)
                            continue
                        impls.append((variant, impl, True))
                # Every stock kernel is looked up before the first registration replaces one.
                for name, impl, with_keyset in impls:
                    library.impl(name, impl, key, with_keyset=with_keyset)
    except BaseException:
        library._destroy()
        raise
    return library


class CompiledRoutingError(RuntimeError):
    """``torch.compile`` (Inductor) inside :func:`batch_invariant` of a graph in which Inductor
    would compute a routed op with a kernel of its own (its reductions, softmax, or a small matmul
    it decomposes into them): the compiled code would not reach samepath's kernel."""


# The ops Inductor hands to torch's ``.out`` kernels (``extern_kernels.mm`` / ``addmm`` / ``bmm``),
# which the routing reaches; every other routed op left in Inductor's graph gets Inductor's own code.
_EXTERN = ("mm", "addmm", "bmm")
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _check_inductor_graph(graph) -> None:
    """Inductor's post-grad pass inside the block: refuse a graph that still holds a routed op
    Inductor would generate code for (see :class:`CompiledRoutingError`)."""
    routed = {name for name, _ in OVERRIDES if name.partition(".")[0] not in _EXTERN}
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        name = target._schema.name.removeprefix("aten::")
        overload = target._overloadname
        if not (f"{name}.{overload}" in routed or (overload == "default" and name in routed)):
            continue
        value = getattr(node.args[0], "meta", {}).get("val") if node.args else None
        if isinstance(value, torch.Tensor) and value.dtype not in _FLOATS:
            continue  # integer / bool / fp64 reductions are torch's inside the block too
        where = (node.meta.get("stack_trace") or "").strip().splitlines()[-2:]
        raise CompiledRoutingError(
            f"samepath.batch_invariant(): torch.compile's Inductor would compute aten::{name}.{overload} "
            f"({'; '.join(s.strip() for s in where) or node.format_node()}) with a "
            "kernel of its own, not samepath's (a reduction, a softmax, or a small matmul it decomposes into one). "
            'Compile with torch.compile(..., backend="aot_eager") inside the block (every op then runs through '
            "the routed aten kernels), or compile only graphs whose routed ops are matmuls Inductor keeps whole."
        )
    if not _inductor_config.emulate_precision_casts:
        _check_rounding(graph)
    if _previous_pass is not None:
        _previous_pass(graph)


def _check_rounding(graph) -> None:
    """Without ``emulate_precision_casts`` Inductor fuses bf16 / fp16 elementwise chains in fp32
    with one rounding at the end (eager rounds after every op: a residual add feeding another, a
    gradient summed over three uses): refuse a graph with such an op."""
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if target.namespace != "aten" or torch.Tag.pointwise not in target.tags:
            continue
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and value.dtype in (torch.bfloat16, torch.float16):
            raise CompiledRoutingError(
                f"samepath.batch_invariant(): torch.compile's Inductor fuses {value.dtype} elementwise ops "
                f"({node.format_node()}) without rounding between them, unlike eager; "
                "torch._inductor.config.emulate_precision_casts was turned off inside the block (samepath turns it "
                'on while a block is open): turn it back on, or compile with backend="aot_eager"'
            )


_previous_pass = None
_previous_emulate = None
_inductor_config = None


def _install_inductor_check() -> None:
    global _previous_pass, _previous_emulate, _inductor_config
    import torch._inductor.config as inductor_config

    _inductor_config = inductor_config
    _previous_pass = inductor_config.post_grad_custom_pre_pass
    inductor_config.post_grad_custom_pre_pass = _check_inductor_graph
    # Inductor then rounds a bf16 / fp16 elementwise result to its dtype after every op, as eager does.
    _previous_emulate = inductor_config.emulate_precision_casts
    inductor_config.emulate_precision_casts = True


def _remove_inductor_check() -> None:
    global _previous_pass
    inductor_config = _inductor_config  # imported at entry: the exit may run at interpreter shutdown
    if inductor_config is not None and inductor_config.post_grad_custom_pre_pass is _check_inductor_graph:
        inductor_config.post_grad_custom_pre_pass = _previous_pass
        inductor_config.emulate_precision_casts = _previous_emulate
    _previous_pass = None


def batch_invariant_enabled() -> bool:
    """Whether torch's matmul ops are currently routed to the samepath kernel."""
    return _routing_depth > 0


@contextmanager
def batch_invariant() -> Iterator[None]:
    """Route ``aten::mm``, ``aten::addmm``, ``aten::bmm`` (and :data:`OVERRIDES`) to samepath.

    Inside the block, stock ``torch.mm``, ``F.linear``, ``x @ w`` (2-D and batched) and their
    autograd backward compute with the batch-invariant kernel for fp32/bf16/fp16 tensors on CPU,
    CUDA and NPU; anything else (fp64, integers, mixed dtypes) goes to torch's own ``.out``
    kernel unchanged; operands of different dtypes, which torch refuses, raise
    :class:`MixedDtypeError` (a ``RuntimeError``, as torch's refusal is) naming their dtypes.
    ``addmm``'s ``beta``/``alpha`` are honoured (applied in fp32 after the K loop). On exit of the
    outermost block the registrations are destroyed and torch's kernels are back exactly. Nesting
    is safe (reference counted). The registration is process-wide: other threads see the routing
    while any block is open. The other ops' modules add theirs: ``aten::_log_softmax``
    (:mod:`samepath.kernels.logprobs`), ``aten::_softmax``, ``aten::sum.dim_IntList`` and
    ``aten::mean.dim`` (:mod:`samepath.kernels.reductions`).

    Their ``.out`` and in-place overloads (:func:`variants`: ``aten::mm.out``, ``addmm_``, ...)
    are routed too (torch >= 2.9), which compiled code calls: Inductor's ``mm`` / ``addmm`` /
    ``bmm`` reach the kernel. A ``torch.compile`` inside the block whose graph would leave another
    routed op to Inductor's own code raises :class:`CompiledRoutingError` naming it. While a block
    is open Inductor's ``emulate_precision_casts`` is on (bf16 / fp16 elementwise results rounded
    after every op, as eager rounds them: the glue between samepath's ops keeps eager's bits);
    a compile inside the block with it turned off is refused.
    """
    global _routing_depth, _routing_library
    with _routing_lock:
        if _routing_depth == 0:
            _routing_library = _register()
            _install_inductor_check()
        _routing_depth += 1
    try:
        yield
    finally:
        with _routing_lock:
            _routing_depth -= 1
            if _routing_depth == 0 and _routing_library is not None:
                _routing_library._destroy()
                _routing_library = None
                _remove_inductor_check()


__all__ = [
    "OVERRIDES",
    "CompiledRoutingError",
    "batch_invariant",
    "batch_invariant_enabled",
    "dispatch_keys",
    "register_override",
]
