"""Compile the kernels that real launches used, for a device this machine does not have.

A CPU machine runs samepath's kernels under Triton's interpreter, which accepts some programs the
compilers reject. :func:`record_launches` captures the (kernel, arguments) of interpreted
launches; :func:`compile_launch` compiles the same specialization ahead of time for a target such
as Hopper (``GPUTarget("cuda", 90, 32)``, with the ``ptxas`` bundled in the Triton wheel), so
compiled-mode errors show up in CI without a GPU. :func:`lower_for_ascend` does the same with
Triton-Ascend up to its linalg MLIR (the last step needs CANN).

The compile report (``python -m samepath.kernels.compile_check --target sm_90 --json OUT``) runs
every op's launcher at realistic shapes (:data:`REPORT_CASES`: head size 128 bf16 with 32 query
and 8 KV heads, 4096 x 4096 matmuls, a 151936-column vocabulary) without running a kernel
(:func:`dry_launches`: the launchers see the CUDA tables and grids), compiles each launch with the
specialization — 16-byte alignment and divisibility hints, arguments equal to 1 folded — that
Triton's own launcher would give it (:func:`compile_specialized`), and reports per kernel the
registers, spills, shared memory, ``num_warps`` / ``num_stages``, the MMA instructions of the PTX
(``wgmma`` or ``mma.sync``), whether it loads through the tensor memory accelerator (TMA:
``cp.async.bulk.tensor`` in the PTX, :func:`uses_tma`) and the grid. No GPU is needed.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # Triton-Ascend (Triton 3.2): no host tensor descriptors
    TensorDescriptor = ()

from samepath.kernels import config as config_module
from samepath.kernels import grid as grid_module
from samepath.kernels.dispatch import FP_FUSION, DualJITFunction

_POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.int32: "*i32",
    torch.int64: "*i64",
    torch.int8: "*i8",
    torch.uint8: "*u8",
    torch.bool: "*i1",
}
_COMPILE_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")

HOPPER = GPUTarget("cuda", 90, 32)
#: An Atlas A2 training chip, for Triton-Ascend (which replaces the ``triton`` package).
ASCEND_910B = GPUTarget("npu", "Ascend910B3", 0)
#: What Triton-Ascend says once the kernel is lowered to its linalg MLIR and only the CANN
#: toolchain (absent here) is left to turn it into a binary.
_NEEDS_CANN = "ASCEND_HOME_PATH is not set"


@dataclass
class Launch:
    kernel: DualJITFunction
    args: tuple
    kwargs: dict = field(default_factory=dict)
    grid: tuple | None = None

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__


@contextmanager
def record_launches() -> Iterator[list[Launch]]:
    """Record every launch of a samepath kernel in the block (the launches still run)."""
    launches: list[Launch] = []
    original = DualJITFunction.run

    def recording_run(self: DualJITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        launches.append(Launch(self, args, kwargs, tuple(grid)))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    DualJITFunction.run = recording_run  # type: ignore[method-assign]
    try:
        yield launches
    finally:
        DualJITFunction.run = original  # type: ignore[method-assign]


def _scalar_type(value: Any) -> str:
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"cannot type kernel argument {value!r}")


def compile_launch(launch: Launch, target: GPUTarget = HOPPER) -> Any:
    """Compile ``launch``'s specialization for ``target``; raises on any compiler error."""
    kernel = launch.kernel
    bound = dict(zip(kernel.arg_names, launch.args, strict=False))
    bound.update({k: v for k, v in launch.kwargs.items() if k in kernel.arg_names})
    if any(isinstance(value, TensorDescriptor) for value in bound.values()):
        return compile_specialized(launch, target)  # Triton's binder types descriptors
    signature, constexprs = {}, {}
    for param in kernel.params:
        value = bound[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = _POINTER_TYPES[value.dtype]
        else:
            signature[param.name] = _scalar_type(value)
    options = {k: v for k, v in launch.kwargs.items() if k in _COMPILE_OPTIONS}
    options.setdefault("enable_fp_fusion", FP_FUSION)
    return triton.compile(ASTSource(kernel, signature, constexprs), target=target, options=options)


def lower_for_ascend(launch: Launch, target: GPUTarget = ASCEND_910B) -> str:
    """Lower ``launch``'s specialization with Triton-Ascend as far as this machine allows.

    Returns ``"binary"`` when CANN is installed and the kernel compiled, ``"mlir"`` when it was
    lowered through TTIR to Triton-Ascend's linalg MLIR and stopped only for want of CANN
    (``ASCEND_HOME_PATH``). Any other failure — a real lowering error — is raised.
    """
    try:
        compile_launch(launch, target)
    except Exception as error:  # Triton-Ascend raises its own MLIRCompilationError
        if _NEEDS_CANN in str(error):
            return "mlir"
        raise
    return "binary"


# ----------------------------------------------------------------------------------------------
# The compile report
# ----------------------------------------------------------------------------------------------


def target_of(name: str) -> GPUTarget:
    """``"sm_90"`` (or ``"sm90"``, ``"sm_90a"``) as a CUDA ``GPUTarget``; ``ValueError`` otherwise."""
    match = re.fullmatch(r"sm_?(\d+)a?", name)
    if not match:
        raise ValueError(f"target must be a CUDA architecture such as sm_90, got {name!r}")
    return GPUTarget("cuda", int(match.group(1)), 32)


@contextmanager
def dry_launches(
    device_kind: str = "cuda", programs_at_once: int = grid_module.DEFAULT_CUDA_SMS
) -> Iterator[list[Launch]]:
    """Record every launch of a samepath kernel in the block **without running it**, while the
    launchers see the frozen tables and grids of ``device_kind`` (``"cuda"``: persistent grids of
    ``programs_at_once`` SMs) for CPU tensors. Outputs stay uninitialised; inputs that launchers
    read on the host (sequence lengths, labels) must be real."""
    if device_kind != "cuda":
        raise ValueError(f"device_kind must be 'cuda' (the report compiles for CUDA), got {device_kind!r}")
    launches: list[Launch] = []
    original_run = DualJITFunction.run
    saved = (config_module.device_kind, grid_module.device_kind, grid_module.cuda_sm_count)

    def recording_run(self: DualJITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        launches.append(Launch(self, args, kwargs, tuple(grid)))

    def kind(device: torch.device | str) -> str:
        saved[0](device)  # still refuses unsupported devices
        return device_kind

    DualJITFunction.run = recording_run  # type: ignore[method-assign]
    config_module.device_kind = kind
    grid_module.device_kind = kind
    grid_module.cuda_sm_count = lambda index: programs_at_once
    try:
        yield launches
    finally:
        DualJITFunction.run = original_run  # type: ignore[method-assign]
        config_module.device_kind, grid_module.device_kind, grid_module.cuda_sm_count = saved


def compile_specialized(launch: Launch, target: GPUTarget = HOPPER) -> Any:
    """Compile ``launch`` for ``target`` with the specialization Triton's launcher computes from
    the arguments: pointers and integers divisible by 16 carry ``tt.divisibility = 16`` (what
    vectorised, pipelined loads need) and integer arguments equal to 1 become constants. Raises
    on any compiler error."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = {k: v for k, v in launch.kwargs.items() if k in kernel.arg_names or k in _COMPILE_OPTIONS}
    kwargs.setdefault("enable_fp_fusion", FP_FUSION)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


_PTXAS_USAGE = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads.*?Used (\d+) registers", re.S
)


def ptxas_usage(ptx: str, target: GPUTarget) -> dict[str, int]:
    """Registers and spills of ``ptx`` by the bundled ``ptxas -v`` (the flags Triton uses)."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        done = subprocess.run(
            [
                get_ptxas(target.arch).path,
                "-v",
                "--fmad=false",
                "--regAllocOptLevel=2",
                f"--gpu-name={sm_arch_from_capability(target.arch)}",
                str(source),
                "-o",
                str(Path(tmp) / "kernel.o"),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
    match = _PTXAS_USAGE.search(done.stdout + done.stderr)
    if not match:
        raise RuntimeError(f"unexpected ptxas -v output: {done.stdout + done.stderr}")
    stack, stores, loads, registers = map(int, match.groups())
    return {"registers": registers, "spill_stores": stores, "spill_loads": loads, "stack_bytes": stack}


def uses_tma(ptx: str) -> bool:
    """Whether a kernel's PTX copies tiles with the tensor memory accelerator (``cp.async.bulk.tensor``)."""
    return "cp.async.bulk.tensor" in ptx


def _mma(ptx: str) -> str:
    if "wgmma.mma_async" in ptx:
        return "wgmma"
    if "mma.sync" in ptx:
        return "mma.sync"
    return "none"


@dataclass(frozen=True)
class ReportCase:
    """One realistic use of the ops: a name, the shapes in words, and a function that runs the
    launchers (under :func:`dry_launches`)."""

    name: str
    shapes: str
    run: Callable[[], None]


def _empty(*shape: int, dtype: torch.dtype = torch.bfloat16, grad: bool = False) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype).requires_grad_(grad)


def _backward(outputs: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...]) -> None:
    cotangents = tuple(torch.empty_like(o) for o in outputs)
    torch.autograd.grad(outputs, inputs, cotangents, allow_unused=True)


def _attention_training() -> None:
    from samepath.kernels.attention import varlen_attention

    q, k, v = _empty(4096, 32, 128, grad=True), _empty(4096, 8, 128, grad=True), _empty(4096, 8, 128, grad=True)
    cu_seqlens = torch.tensor([0, 2048, 4096], dtype=torch.int32)
    _backward((varlen_attention(q, k, v, cu_seqlens),), (q, k, v))


def _gpt_oss_attention() -> None:
    """GPT-OSS's attention: sinks in training (fwd+bwd) and in a split decode (the merge kernel's sinks)."""
    from samepath.kernels.attention import paged_attention, varlen_attention

    q, k, v = _empty(4096, 64, 64, grad=True), _empty(4096, 8, 64, grad=True), _empty(4096, 8, 64, grad=True)
    sinks = _empty(64, grad=True)
    cu_seqlens = torch.tensor([0, 2048, 4096], dtype=torch.int32)
    _backward((varlen_attention(q, k, v, cu_seqlens, sliding_window=128, sinks=sinks),), (q, k, v, sinks))
    key_cache, value_cache = _empty(64 * 256, 16, 8, 64), _empty(64 * 256, 16, 8, 64)
    block_table = torch.arange(64 * 256, dtype=torch.int32).view(64, 256)
    seq_lens = torch.full((64,), 4096, dtype=torch.int32)
    query_start_loc = torch.arange(0, 65, dtype=torch.int32)
    args = (key_cache, value_cache, block_table, query_start_loc, seq_lens, 64**-0.5)
    paged_attention(_empty(64, 64, 64), *args, sinks=sinks.detach(), split_kv=True)


def _clamped_swiglu() -> None:
    from samepath.kernels.clamped_swiglu import clamped_swiglu

    gate_up = _empty(4096, 2 * 2880, grad=True)
    _backward((clamped_swiglu(gate_up, 7.0, 1.702),), (gate_up,))


def _paged(batch: int, new_tokens: int, context: int) -> None:
    from samepath.kernels.attention import paged_attention, write_kv_cache

    page = 16
    pages = triton.cdiv(context, page)
    key_cache, value_cache = _empty(batch * pages, page, 8, 128), _empty(batch * pages, page, 8, 128)
    block_table = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    query_start_loc = torch.arange(0, batch * new_tokens + 1, new_tokens, dtype=torch.int32)
    positions = torch.arange(context - new_tokens, context)
    slots = (block_table[:, positions // page].long() * page + positions % page).reshape(-1)
    tokens = batch * new_tokens
    write_kv_cache(_empty(tokens, 8, 128), _empty(tokens, 8, 128), key_cache, value_cache, slots)
    paged_attention(_empty(tokens, 32, 128), key_cache, value_cache, block_table, query_start_loc, seq_lens, 128**-0.5)


def _linear(m: int, n: int, k: int, grad: bool) -> Callable[[], None]:
    def run() -> None:
        from samepath.kernels.matmul import linear

        x, w = _empty(m, k, grad=grad), _empty(n, k, grad=grad)
        y = linear(x, w)
        if grad:
            _backward((y,), (x, w))

    return run


def _token_logprobs() -> None:
    from samepath.kernels.logprobs import log_softmax, token_logprobs

    logits = _empty(1024, 151936, grad=True)
    labels = torch.zeros(1024, dtype=torch.int64)
    _backward(token_logprobs(logits, labels, 0.7, return_entropy=True), (logits,))
    out = log_softmax(logits, 0.7)
    torch.autograd.grad(out, logits, torch.empty(out.shape, dtype=torch.float32))


def _lm_head_training() -> None:
    from samepath.kernels.logprobs import linear_token_logprobs

    hidden, weight = _empty(1024, 4096, grad=True), _empty(151936, 4096, grad=True)
    labels = torch.zeros(1024, dtype=torch.int64)
    _backward(linear_token_logprobs(hidden, weight, labels, 0.7, return_entropy=True), (hidden, weight))


def _vocab_parallel() -> None:
    from samepath.kernels.vocab_parallel import merge_shard_lse, shard_lse

    logits, labels = _empty(1024, 151936), torch.zeros(1024, dtype=torch.int64)
    states = [shard_lse(logits[:, s * 75968 : (s + 1) * 75968], labels, s * 75968, 0.7) for s in range(2)]
    merge_shard_lse(torch.stack([s[0] for s in states]), torch.stack([s[1] for s in states]), labels, 75968)


def _rms_norm(rows: int, hidden: int) -> Callable[[], None]:
    def run() -> None:
        from samepath.kernels.rms_norm import rms_norm

        x, residual, w = _empty(rows, hidden, grad=True), _empty(rows, hidden, grad=True), _empty(hidden, grad=True)
        _backward((rms_norm(x, w, 1e-6),), (x, w))
        _backward(rms_norm(x, w, 1e-6, residual=residual), (x, residual, w))

    return run


def _silu_mul() -> None:
    from samepath.kernels.swiglu import silu_mul

    gate, up = _empty(4096, 12288, grad=True), _empty(4096, 12288, grad=True)
    _backward((silu_mul(gate, up),), (gate, up))


def _rotary() -> None:
    from samepath.kernels.rotary import apply_rotary, rotary_cos_sin

    cos, sin = rotary_cos_sin(torch.arange(4096)[None], 128, 1_000_000.0, torch.bfloat16)
    q, k = _empty(1, 32, 4096, 128, grad=True), _empty(1, 8, 4096, 128, grad=True)
    _backward(apply_rotary(q, k, cos, sin), (q, k))


def _moe_grouped() -> None:
    from samepath.kernels.grouped_matmul import GroupedExpertsFunction

    tokens, experts, top_k = 4096, 128, 8
    index = torch.arange(tokens * top_k).reshape(tokens, top_k) % experts
    hidden, weights = _empty(tokens, 2048, grad=True), _empty(tokens, top_k, grad=True)
    gate_up, down = _empty(experts, 1536, 2048, grad=True), _empty(experts, 2048, 768, grad=True)
    out = GroupedExpertsFunction.apply(hidden, gate_up, down, index, weights)
    _backward((out,), (hidden, gate_up, down, weights))


def _reductions() -> None:
    from samepath.kernels.matmul import batch_invariant

    with batch_invariant():
        torch.softmax(_empty(4096, 128, dtype=torch.float32), -1)  # a MoE router
        _empty(4096, 4096).mean(-1)
        _empty(4096, 4096).sum(0)  # a bias gradient
        torch.var_mean(_empty(4096, 4096), -1)  # a layer norm written with torch ops
        _empty(4096, 4096).norm(dim=-1)


def _gated_delta(lengths: list[int], tail: int) -> Callable[[], None]:
    """Gated DeltaNet at Qwen3-Next's shapes (16 q/k heads, 32 value heads, head 128), bf16: a prefill
    with its backward (``tail`` 0) or a continuation through the slot buffers of ``tail`` cached
    tokens per sequence (vLLM's decode)."""

    def run() -> None:
        from samepath.kernels.gated_delta import GatedDeltaSlots, chunk_gated_delta, gated_delta_continue_slots

        total, n = sum(lengths), len(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        grad = not tail
        q, k, v = (
            _empty(total, 16, 128, grad=grad),
            _empty(total, 16, 128, grad=grad),
            _empty(total, 32, 128, grad=grad),
        )
        g = _empty(total, 32, dtype=torch.float32, grad=grad)
        beta = _empty(total, 32, dtype=torch.float32, grad=grad)
        if not tail:
            _backward((chunk_gated_delta(q, k, v, g, beta, cu)[0],), (q, k, v, g, beta))
            return
        slots = GatedDeltaSlots.allocate(n, 16, 32, 128, 128, torch.bfloat16)
        slots.tail_len.fill_(tail)
        gated_delta_continue_slots(q, k, v, g, beta, cu, slots, torch.arange(n, dtype=torch.int32))

    return run


def _causal_conv1d(lengths: list[int], with_state: bool) -> Callable[[], None]:
    """The Gated DeltaNet layer's conv1d at Qwen3-Next's shapes (conv dim 2 * 16 * 128 + 32 * 128, 4 taps), bf16."""

    def run() -> None:
        from samepath.kernels.causal_conv1d import causal_conv1d

        total, n, dim = sum(lengths), len(lengths), 8192
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        state = _empty(n, dim, 3) if with_state else None
        x, weight = _empty(total, dim, grad=not with_state), _empty(dim, 4, grad=not with_state)
        out, _ = causal_conv1d(x, weight, None, cu, state, "silu")
        if not with_state:  # training: forward and backward
            _backward((out,), (x, weight))

    return run


#: The report's workloads: a Qwen3-8B-like layer (hidden 4096, 32 query / 8 KV heads of 128,
#: intermediate 12288, vocabulary 151936) in bf16, training and rollout.
REPORT_CASES: tuple[ReportCase, ...] = (
    ReportCase(
        "attention-training", "varlen fwd+bwd, 2 x 2048 tokens, 32 q / 8 KV heads, head 128", _attention_training
    ),
    ReportCase(
        "attention-decode", "paged, 64 sequences x 1 new token, context 4096, page 16", lambda: _paged(64, 1, 4096)
    ),
    ReportCase(
        "attention-prefill", "paged, 4 sequences x 512 new tokens, context 4096, page 16", lambda: _paged(4, 512, 4096)
    ),
    ReportCase("matmul-training", "linear fwd+bwd, 4096 tokens, 4096 x 4096 weight", _linear(4096, 4096, 4096, True)),
    ReportCase("matmul-decode", "linear, 64 tokens, 4096 x 4096 weight", _linear(64, 4096, 4096, False)),
    ReportCase("lm-head-decode", "linear, 64 tokens, 151936 x 4096 weight", _linear(64, 151936, 4096, False)),
    ReportCase("logprobs", "token_logprobs (+entropy) and log_softmax fwd+bwd, 1024 x 151936", _token_logprobs),
    ReportCase(
        "lm-head-training",
        "linear_token_logprobs (+entropy) fwd+bwd, 1024 tokens, 151936 x 4096 weight",
        _lm_head_training,
    ),
    ReportCase("logprobs-vocab-parallel", "shard_lse x 2 shards + merge, 1024 x 151936", _vocab_parallel),
    ReportCase("rms-norm-hidden", "rms_norm fwd+bwd (and with residual), 4096 x 4096", _rms_norm(4096, 4096)),
    ReportCase(
        "rms-norm-head", "q-norm fwd+bwd (and with residual), 4096 tokens x 32 heads x 128", _rms_norm(131072, 128)
    ),
    ReportCase("silu-mul", "silu_mul fwd+bwd, 4096 x 12288", _silu_mul),
    ReportCase(
        "attention-sinks",
        "GPT-OSS: varlen fwd+bwd with sinks and window 128, 2 x 2048 tokens, 64 q / 8 KV heads of 64; "
        "paged split decode with sinks, 64 sequences x context 4096",
        _gpt_oss_attention,
    ),
    ReportCase("clamped-swiglu", "GPT-OSS clamped SwiGLU fwd+bwd, 4096 x 2 * 2880 interleaved", _clamped_swiglu),
    ReportCase("rotary", "apply_rotary fwd+bwd, 4096 positions, 32 q / 8 KV heads, head 128", _rotary),
    ReportCase(
        "moe-grouped",
        "grouped expert GEMMs fwd+bwd, 4096 tokens x top-8 of 128 experts, hidden 2048, intermediate 768",
        _moe_grouped,
    ),
    ReportCase(
        "gated-delta-prefill",
        "Gated DeltaNet fwd+bwd, 2 x 2048 tokens, 16 q/k / 32 value heads, head 128",
        _gated_delta([2048, 2048], 0),
    ),
    ReportCase(
        "gated-delta-decode",
        "Gated DeltaNet decode (slot buffers), 64 sequences x 1 new token after 40 cached tokens of the chunk",
        _gated_delta([1] * 64, 40),
    ),
    ReportCase(
        "causal-conv1d",
        "Gated DeltaNet conv1d + SiLU fwd+bwd, 2 x 2048 tokens; 64 x 1 decode with the state; 8192 channels, 4 taps",
        lambda: (_causal_conv1d([2048, 2048], False)(), _causal_conv1d([1] * 64, True)()),
    ),
    ReportCase(
        "reductions",
        "batch_invariant softmax 4096 x 128 fp32; mean(-1), sum(0), var_mean(-1), norm(-1) of 4096 x 4096",
        _reductions,
    ),
)

#: Constexpr arguments shown per kernel in the report (the ones that pick a variant or a tile).
_SHOWN_CONSTEXPRS = re.compile(
    r"^(BLOCK|TILE|K_|PAGED|HAS_|SLOTS|STORE_|PARTIALS|GROUP|BACKWARD|NUM_|ROWS|CHUNK|ENTROPY|SEG|GQA|A_T$|B_T$|SCALED|BATCH)"
)


def compile_report(
    target: GPUTarget = HOPPER, cases: list[str] | None = None, log: Callable[[str], None] | None = None
) -> dict:
    """Run each case's launchers dry with the CUDA tables, compile every launch for ``target`` and
    return the report (see the module docstring). ``cases`` selects :data:`REPORT_CASES` by name."""
    selected = [case for case in REPORT_CASES if cases is None or case.name in cases]
    if cases is not None and len(selected) != len(set(cases)):
        known = ", ".join(case.name for case in REPORT_CASES)
        raise ValueError(f"cases must be among {known}, got {cases}")
    compiled_cache: dict[str, dict] = {}
    report_cases = []
    for case in selected:
        with _enable_grad(), dry_launches() as launches:
            case.run()
        kernels = []
        for launch in launches:
            compiled = compile_specialized(launch, target)
            key = compiled.hash
            if key not in compiled_cache:
                ptx = compiled.asm["ptx"]
                compiled_cache[key] = {
                    **ptxas_usage(ptx, target),
                    "shared_bytes": compiled.metadata.shared,
                    "num_warps": compiled.metadata.num_warps,
                    "num_stages": compiled.metadata.num_stages,
                    "mma": _mma(ptx),
                    "wgmma": _mma(ptx) == "wgmma",
                    # Also mma.sync: a kernel whose dots with M < 64 fall back (the backward's).
                    "mma_sync": "mma.sync" in ptx,
                    "tma": uses_tma(ptx),
                }
            shown = {k: _jsonable(v) for k, v in launch.kwargs.items() if _SHOWN_CONSTEXPRS.match(k)}
            kernels.append(
                {"kernel": launch.name, "constexprs": shown, "grid": list(launch.grid), **compiled_cache[key]}
            )
            if log:
                log(_row(case.name, kernels[-1]))
        report_cases.append({"case": case.name, "shapes": case.shapes, "kernels": kernels})
    return {
        "target": f"sm_{target.arch}",
        "triton": triton.__version__,
        "numerics_version": config_module.NUMERICS_VERSION,
        "fingerprint": config_module.fingerprint(),
        "device_kind": "cuda",
        "sms_assumed": grid_module.DEFAULT_CUDA_SMS,
        "cases": report_cases,
    }


@contextmanager
def _enable_grad() -> Iterator[None]:
    with torch.enable_grad():
        yield


def _jsonable(value: Any) -> Any:
    return value if isinstance(value, (bool, int, float, str)) or value is None else str(value)


def _row(case: str, kernel: dict) -> str:
    spills = kernel["spill_stores"] + kernel["spill_loads"]
    return (
        f"{case:24s} {kernel['kernel']:28s} regs {kernel['registers']:3d}  spills {spills:5d}  "
        f"smem {kernel['shared_bytes']:6d}  warps {kernel['num_warps']}  stages {kernel['num_stages']}  "
        f"{kernel['mma']:8s}  {'tma' if kernel['tma'] else '   '}  grid {tuple(kernel['grid'])}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m samepath.kernels.compile_check",
        description="Compile every samepath kernel at realistic shapes for a CUDA target (no GPU needed) and "
        "report registers, spills, shared memory, warps/stages, wgmma, TMA and grids.",
    )
    parser.add_argument("--target", default="sm_90", help="CUDA architecture (default: sm_90)")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--cases", nargs="+", help="only these cases: " + ", ".join(c.name for c in REPORT_CASES))
    args = parser.parse_args(argv)
    report = compile_report(target_of(args.target), args.cases, log=print)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    spilled = [
        f"{case['case']}:{k['kernel']}"
        for case in report["cases"]
        for k in case["kernels"]
        if k["spill_stores"] or k["spill_loads"]
    ]
    if spilled:
        print(f"kernels that spill: {', '.join(sorted(set(spilled)))}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
