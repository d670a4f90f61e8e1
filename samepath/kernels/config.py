"""The frozen numerics table: every constant that changes the bits of a result lives here.

Each entry is keyed by (op, device kind, dtype, padded head size). Trainer and rollout must run with
the same table; :func:`fingerprint` hashes it (and the formula flags) so that the two sides can
compare a short string and refuse to mix numerics. Changing any value below changes the
fingerprint; bump :data:`NUMERICS_VERSION` when a kernel's formula changes without a table change.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from samepath.kernels.dispatch import device_kind

#: Bumped whenever a kernel's arithmetic changes in a way the table does not show.
#: 2: GQA-packed attention query tiles and fixed KV segments (``seg``) for every caller; matmul K
#: in ``k_split`` pieces (CUDA); RMSNorm dweight as a two-level reduction; the Hugging Face rotary
#: module computes cos/sin with rotary_cos_sin from the config (not from its inv_freq buffer, which
#: ``model.to(dtype)`` rounds); rope types beyond default and llama3.
#: 3: the attention backward is one pass per KV tile (GQA-packed query tiles, dK/dV in registers,
#: dQ partials added in ascending KV-tile order through fp32 row sums).
#: 4: the backward computes key-major (S^T = K Q^T, dP^T = V dO^T, dQ^T = K^T dS^T: the same products
#: and sums per element) and ``delta = rowsum(dO * O)`` in its own preprocessing kernel (one fp32
#: ``tl.sum`` over the padded head per row) instead of the generic row sum; CUDA 16-bit tiles: forward
#: 128 query rows, backward 128-key tiles with 32 packed query rows.
#: 5: RMSNorm dweight's partials summed in spans of 8, then the span sums (a second level over many
#: CTAs); the fused lm_head's dweight as one GEMM over all tokens.
NUMERICS_VERSION = 5

#: dtypes the kernels accept, by the name used in the table.
SUPPORTED_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
}

#: Attention head sizes: multiples of 8 from 16 to 256 (padded to the next power of two in-kernel).
MIN_HEAD_SIZE = 16
MAX_HEAD_SIZE = 256
HEAD_SIZE_MULTIPLE = 8

#: How the attention kernels compute softmax(QK^T * scale) V. Documented in docs/numerics.md.
ATTENTION_FORMULA = {
    "score": "fp32 dot(Q, K^T), then * (scale * log2(e)) in fp32",
    "mask": "select -inf before the row max",
    "exp": "exp2",
    "row_sum": "fp32 P before the cast",
    "p_cast": "P cast to the input dtype before dot(P, V)",
    "accumulator": "fp32, rescaled by exp2(m_old - m_new) each tile",
    "fp32_dot_precision": "ieee",
    "fp_fusion": "disabled",
    "finish": "acc / l, then one cast to the output dtype",
    "kv_tiles": "anchored at position 0 of each sequence, visited in ascending order within a segment",
    "kv_segments": "seg positions anchored at position 0, each from a fresh (-inf, 0, 0) state",
    "segment_merge": "ascending; m = max(m, m_s), l = l * exp2(m_old - m) + l_s * exp2(m_s - m), "
    "acc likewise; a segment with m_s = -inf is skipped by select",
    "query_tile": "GQA-packed: row r = (query r // head_chunk, head r % head_chunk of one KV group), "
    "head_chunk = min(group, block_m)",
    "backward": "one item per KV tile: dK, dV in fp32 registers over GQA-packed query tiles (head chunks, then "
    "query blocks ascending); dQ = scale * (fp32 sum of dot(dS, K) partials in ascending KV-tile order)",
    "backward_orientation": "key-major: S^T = dot(K, Q^T), dP^T = dot(V, dO^T), dV += dot(cast(P^T), dO), "
    "dK += dot(cast(dS^T), Q), dQ partial^T = dot(K^T, cast(dS^T))",
    "backward_delta": "delta = 0 + tl.sum(fp32(dO) * fp32(O)) over the zero-padded head, one row at a time, "
    "in the backward's preprocessing kernel",
}


@dataclass(frozen=True)
class AttentionConfig:
    """Tile sizes of the attention kernels for one (device kind, dtype, padded head size).

    ``block_m`` rows form one query tile (GQA-packed: the query heads of one KV group share it);
    ``tile_n`` KV positions form one tile and ``seg`` positions (a multiple of ``tile_n``) one
    segment, both anchored at sequence position 0. A segment's softmax state starts fresh and the
    segments are merged in ascending order. Every caller — training, prefill, chunked prefill,
    decode — uses the same triple, which is what makes their rows bit-identical. The backward's
    query tiles have ``bwd_block_m`` GQA-packed rows and its KV tiles ``bwd_block_n`` keys; they fix
    the order of its sums (determinism only: the backward has no second caller to match).
    """

    block_m: int
    tile_n: int
    seg: int = 1024
    num_warps: int = 4
    num_stages: int = 2
    bwd_block_m: int = 16
    bwd_block_n: int = 16

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"AttentionConfig.{field.name} must be a positive int, got {value!r}")
        for name in ("block_m", "tile_n", "bwd_block_m", "bwd_block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"AttentionConfig.{name} must be a power of two >= 16, got {value}")
        if self.seg % self.tile_n:
            raise ValueError(f"AttentionConfig.seg = {self.seg} must be a multiple of tile_n = {self.tile_n}")


def _attention_rows() -> dict[tuple[str, str, int], AttentionConfig]:
    rows: dict[tuple[str, str, int], AttentionConfig] = {}
    for dtype in SUPPORTED_DTYPES.values():
        for block_d in (16, 32, 64, 128, 256):
            # CPU (interpreter): small tiles keep numpy's work per program low; a short segment so
            # that the tests' sequences cross segment boundaries.
            rows["cpu", dtype, block_d] = AttentionConfig(block_m=16, tile_n=32, seg=64)
            # CUDA: 16-bit inputs get 128-row query tiles in 8 warps: Hopper's wgmma splits a chained
            # dot's M over every warp (4 warps per 64 rows), so 128 rows put each warp on its own 16
            # rows (a 64-row tile ran the same rows in both warpgroups) and a row's max and sum stay
            # inside one warp; no spills for sm_90 (every caller, decode included, uses this tile,
            # which is what keeps their rows bit-identical on the GPU). The backward works key-major:
            # its 128-key tiles are the M of the S^T, dP^T, dV and dK dots and the head that of dQ^T
            # (all five on wgmma), 32 packed query rows their N / K (64 spill). fp32 dots are IEEE
            # (no tensor cores) and keep small tiles, as do 256-wide heads (registers and shared memory).
            small = dtype == "float32" or block_d == 256
            rows["cuda", dtype, block_d] = AttentionConfig(
                block_m=16 if small else 128,
                tile_n=32 if small else 64,
                seg=256,
                num_warps=4 if small else 8,
                num_stages=2 if small else 3,
                bwd_block_m=16 if small else 32,
                bwd_block_n=16 if small else 128,
            )
            # Ascend (Triton-Ascend): cube units work on 16x16 fractals; tiles sized for ~192 KB UB.
            rows["npu", dtype, block_d] = AttentionConfig(
                block_m=16,
                tile_n=32 if block_d == 256 else 64,
                seg=256,
                num_warps=1,
                num_stages=1,
            )
    return rows


ATTENTION_TABLE: dict[tuple[str, str, int], AttentionConfig] = _attention_rows()


@dataclass(frozen=True)
class MatmulConfig:
    """Tiles of the batch-invariant matmul for one (device kind, dtype).

    ``block_k``, ``k_split`` and the ascending K loop fix every output element's reduction order,
    so a row of ``x @ w`` does not depend on the other rows (M): K is cut into ``k_split`` pieces
    (each a multiple of ``block_k``) for every M, each piece folded serially into its own fp32
    partial, the partials added in piece order. A decode GEMM with few output tiles runs the pieces
    as parallel programs, a large one serially per tile — the same sums either way.
    ``group_m`` (rows of tiles that consecutive programs share) only orders the work: neutral.
    ``block_m`` / ``block_n`` are frozen until a test proves them numerics-neutral.
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2
    k_split: int = 1
    group_m: int = 8


@dataclass(frozen=True)
class RowReduceConfig:
    """Row-wise reductions (token logprobs / log-softmax / entropy over the vocabulary, RMSNorm).

    ``vocab_chunk`` columns of a logits row are folded into an fp32 online log-sum-exp at a time,
    in ascending order. ``norm_block_max`` is the largest hidden size RMSNorm takes; a row of up
    to ``norm_chunk`` columns is held whole (padded to the next power of two), a longer one is
    folded in chunks of ``norm_chunk`` columns (``samepath/kernels/rms_norm.py``).
    """

    vocab_chunk: int
    norm_block_max: int = 16384
    norm_chunk: int = 16384
    num_warps: int = 4


def _matmul_rows() -> dict[tuple[str, str], MatmulConfig]:
    rows: dict[tuple[str, str], MatmulConfig] = {}
    for dtype in SUPPORTED_DTYPES.values():
        rows["cpu", dtype] = MatmulConfig(block_m=16, block_n=32, block_k=32)
        # CUDA: 128x128x64 tiles in 8 warps (wgmma on Hopper); K in 4 pieces, so a decode GEMM
        # (one row of output tiles) still fills the SMs. fp32 (IEEE, no tensor cores) keeps
        # smaller tiles.
        if dtype == "float32":
            rows["cuda", dtype] = MatmulConfig(64, 64, 32, num_warps=4, num_stages=3, k_split=4)
        else:
            rows["cuda", dtype] = MatmulConfig(128, 128, 64, num_warps=8, num_stages=3, k_split=4)
        rows["npu", dtype] = MatmulConfig(block_m=64, block_n=64, block_k=64, num_warps=1, num_stages=1)
    return rows


MATMUL_TABLE: dict[tuple[str, str], MatmulConfig] = _matmul_rows()

#: How the matmul loads its operand tiles, per (device kind, dtype): ``"tma"`` (tensor descriptors:
#: Hopper's tensor memory accelerator, where the device has one and the operands allow it;
#: ``samepath.kernels.matmul_tma``) or ``"pointer"`` (masked pointer loads: the CPU's interpreter,
#: Ascend, fp32's IEEE dots). The same tiles reach the same dots in the same order either way, so
#: this is not part of the fingerprint.
MATMUL_LOADS: dict[tuple[str, str], str] = {
    (kind, dtype): "tma" if kind == "cuda" and dtype != "float32" else "pointer"
    for kind in ("cpu", "cuda", "npu")
    for dtype in SUPPORTED_DTYPES.values()
}

ROW_REDUCE_TABLE: dict[str, RowReduceConfig] = {
    "cpu": RowReduceConfig(vocab_chunk=4096),
    "cuda": RowReduceConfig(vocab_chunk=4096, num_warps=8),
    # An A2 core's 192 KB unified buffer holds the chunked RMSNorm backward's buffers (with the
    # residual's gradient) for 2048 columns: samepath.kernels.ub_fit.
    "npu": RowReduceConfig(vocab_chunk=4096, norm_chunk=2048, num_warps=1),
}


def matmul_config(dtype: torch.dtype, device: torch.device | str) -> MatmulConfig:
    """The frozen matmul tiles for inputs of this dtype on this device (or device type)."""
    key = (device_kind(device), dtype_name(dtype))
    return _with_tuned("matmul", key, MATMUL_TABLE[key])


def matmul_loads(dtype: torch.dtype, device: torch.device | str) -> str:
    """``"tma"`` or ``"pointer"``: how the matmul loads operand tiles of this dtype on this device
    kind (:data:`MATMUL_LOADS`; numerics-neutral)."""
    return MATMUL_LOADS[device_kind(device), dtype_name(dtype)]


def row_reduce_config(device: torch.device | str) -> RowReduceConfig:
    """The frozen vocabulary chunk and norm block for this device (or device type)."""
    key = (device_kind(device),)
    return _with_tuned("row_reduce", key, ROW_REDUCE_TABLE[key[0]])


#: Launch parameters a tuning sweep may change: proven bitwise neutral per candidate by
#: samepath.kernels.tuning before they are accepted, and never part of the fingerprint.
NEUTRAL_PARAMS: dict[str, tuple[str, ...]] = {
    "attention": ("num_warps", "num_stages"),
    "matmul": ("num_warps", "num_stages", "group_m"),
    "row_reduce": ("num_warps",),
}
_tuned: dict[tuple, dict[str, int]] = {}
_Config = TypeVar("_Config")


def set_tuned_overrides(overrides: dict[tuple, dict[str, int]]) -> None:
    """Install verified tuning results: ``{(op, *table key): {neutral param: value}}``.

    Only :data:`NEUTRAL_PARAMS` may be set; the frozen tables and the fingerprint stay as they are.
    Pass ``{}`` to go back to the frozen values.
    """
    for (op, *_), params in overrides.items():
        if op not in NEUTRAL_PARAMS or set(params) - set(NEUTRAL_PARAMS[op]):
            raise ValueError(
                f"tuned overrides for {op!r} may only set {NEUTRAL_PARAMS.get(op, ())}, got {sorted(params)}"
            )
    _tuned.clear()
    _tuned.update(overrides)


def _with_tuned(op: str, key: tuple, cfg: _Config) -> _Config:
    tuned = _tuned.get((op, *key))
    return dataclasses.replace(cfg, **tuned) if tuned else cfg


def padded_head_size(head_size: int) -> int:
    """The power-of-two block the kernels load a head of ``head_size`` into."""
    return max(16, 1 << (head_size - 1).bit_length())


def check_head_size(head_size: int, argument: str = "head_size") -> None:
    if not MIN_HEAD_SIZE <= head_size <= MAX_HEAD_SIZE or head_size % HEAD_SIZE_MULTIPLE:
        raise ValueError(
            f"{argument} = {head_size} is not a supported head size: samepath attention takes "
            f"multiples of {HEAD_SIZE_MULTIPLE} from {MIN_HEAD_SIZE} to {MAX_HEAD_SIZE}"
        )


def dtype_name(dtype: torch.dtype, argument: str = "dtype") -> str:
    try:
        return SUPPORTED_DTYPES[dtype]
    except KeyError:
        names = ", ".join(f"torch.{n}" for n in SUPPORTED_DTYPES.values())
        raise ValueError(f"{argument} must be one of {names}, got {dtype}") from None


def attention_config(head_size: int, dtype: torch.dtype, device: torch.device | str) -> AttentionConfig:
    """The frozen attention tiles for tensors of this head size, dtype and device (or device type)."""
    check_head_size(head_size)
    key = (device_kind(device), dtype_name(dtype), padded_head_size(head_size))
    return _with_tuned("attention", key, ATTENTION_TABLE[key])


#: Formula flags of the ops other than attention, registered by each op's module at import.
OP_FORMULAS: dict[str, dict[str, str]] = {}


def register_formula(op: str, flags: dict[str, str]) -> None:
    """Declare how ``op`` computes (cast points, accumulation dtype, ...); part of the fingerprint."""
    if op in OP_FORMULAS and OP_FORMULAS[op] != flags:
        raise ValueError(f"formula of {op!r} registered twice with different flags")
    OP_FORMULAS[op] = dict(flags)


#: How a tensor-parallel rollout of S ranks and the one-process trainer that reproduces it compute
#: (``samepath.distributed`` runs it; the kernels are :mod:`samepath.kernels.matmul`'s
#: ``k_slices`` and :mod:`samepath.kernels.logprobs`' vocabulary shards).
DISTRIBUTED_FORMULA = {
    "row_parallel": "fp32 partial per rank (matmul out_dtype=fp32), all_gather, partials summed in ascending "
    "rank order in fp32 (first taken as is), bias after, one cast == matmul(k_slices=S)",
    "column_parallel": "no reduction; all_gather concatenates the ranks' columns in rank order",
    "vocab_parallel": "S equal contiguous vocab shards; per shard fp32 chunked online lse (chunks from the "
    "shard's first column) and fp32 x[label]/T or -inf; merged in ascending shard order: "
    "c = m == -inf ? 0 : m with m = max(lse, lse_s); lse = c + log(exp(lse - c) + exp(lse_s - c)); "
    "logprob = zlab - lse",
    "collective": "all_gather and all_to_all_single; no all_reduce",
    "row_parallel_backward": "no collective; dX_r = dY @ W_r, dW_r = dY^T @ X_r, db = 1^T @ dY, plain kernel",
    "column_parallel_backward": "dX: fp32 partials dY_r @ W_r, all_gather, summed in ascending rank order in fp32, "
    "one cast == matmul(dY, W, k_slices=S); dW_r = dY_r^T @ X, db_r = 1^T @ dY_r, plain kernel",
    "vocab_parallel_backward": "no collective; per shard token_logprobs' backward kernel with the merged lse: "
    "((onehot - exp(z - lse)) * g) / T, 0 for ignore_index rows",
    "moe_tensor_parallel": "S > 1: each expert's intermediate dim in S contiguous slices (rank r: gate and up rows "
    "r*I/S..(r+1)*I/S-1, down columns the same); per slice the grouped per-expert gate_up and silu_mul in the "
    "activation dtype, down as an fp32 accumulator times fp32(weight), each token's pairs added in ascending "
    "expert order in fp32; the S fp32 partials all_gathered, summed in ascending rank order (first as is), one "
    "cast; S = 1: the plain layer",
    "expert_parallel": "E/k contiguous experts per rank; tokens replicated: each rank its experts' pairs with the "
    "per-expert linear's bits, all_to_all_single of the expert_out rows (raw bytes) to the rank that combines "
    "the token (tensor_split chunks in rank order), the moe combine there, all_gather of the combined rows; "
    "tokens local: all_to_all_single of the pairs' hidden rows and expert ids to the owner, expert_out rows "
    "back, the moe combine on the token's rank == the one-process experts",
    "expert_parallel_backward": "each pair's dexpert_out and dweight by the moe combine's backward on the "
    "token's rank (replicated: its chunk), the experts' backward on the owner, the pairs' input-gradient rows "
    "all_to_all back and added in ascending expert order in fp32, one cast; dW per expert folded in plan "
    "order (local tokens: per source rank, the sources' dW added in rank order in the parameter dtype) "
    "== the one-process grouped backward (local tokens: accumulated over the ranks' micro-batches)",
}
register_formula("distributed", DISTRIBUTED_FORMULA)

#: The routed experts of a MoE layer (``samepath.kernels.grouped_matmul``), the same on every
#: device and expert-parallel layout.
MOE_FORMULA = {
    "pair": "expert_out = down(silu·mul(gate_up(x))) with the per-expert linear's bits (grouped == loop)",
    "combine": "each token's pair terms fp32(expert_out) * fp32(weight) added in ascending expert order "
    "(stable) in fp32 from 0, one cast to the activation dtype",
    "backward": "dexpert_out = (fp32(dY) * fp32(weight)).to(dtype); dweight = fp32 row sum of fp32(dY) * "
    "fp32(expert_out); input-gradient rows added in ascending expert order in fp32, one cast; dW per expert "
    "folded in plan order in fp32, one cast",
}
register_formula("moe", MOE_FORMULA)

#: Gated DeltaNet's frozen chunk: the recurrent state exists only at multiples of it from each
#: sequence's first token (``samepath.kernels.gated_delta``).
GATED_DELTA_CHUNK = 64

#: Gated DeltaNet (``samepath.kernels.gated_delta``), one schedule for prefill, chunked prefill,
#: packed sequences and decode.
GATED_DELTA_FORMULA = {
    "anchor": f"chunks of {GATED_DELTA_CHUNK} tokens from each sequence's first token; the fp32 state [Dk, Dv] "
    "exists only at chunk boundaries; decode recomputes its partial chunk from the boundary state",
    "inputs": "q, k widened to fp32, x * (1 / sqrt(sum(x * x) + 1e-6)) per token, q then * Dk**-0.5; g (log "
    "decay) and beta fp32",
    "chunk": "gc = cumsum(g); D = exp(where(i >= j, gc_i - gc_j, 0)); A = strict_lower((k*beta) @ k^T * D); "
    "T = (I + A)^-1 by forward substitution (row i = e_i - column sum of A[i, :, None] * T, i ascending); "
    "u = T @ (v*beta); "
    "w = T @ (k*beta*exp(gc)); vnew = u - w @ S; o = (tril(q @ k^T * D)) @ vnew + (q*exp(gc)) @ S",
    "update": "on a full chunk S = (k*exp(gc_C - gc))^T @ vnew + S * exp(gc_C)",
    "dot": "fp32 operands, tf32x3 on NVIDIA, ieee on Ascend (fp32 products in the interpreter and the replay), "
    "fp32 accumulation; one cast of o to the input dtype",
    "backward": "Triton, no atomics: the forward rerun stores the state at each chunk start and each chunk's T; "
    "the other chunk quantities recomputed by the forward's ops; kernel 1 per (sequence, value head, 32 value "
    "columns), chunks in reverse: "
    "vnew = T (v*beta) - w S, dvnew = attn^T dO + kdec dS', dS = (q*exp(gc))^T dO + dS' * exp(gc_C) - w^T dvnew "
    "(fp32 in registers), dv = (T^T dvnew) * beta, row sums of (T^T dvnew) * v per block; kernel 2 per (sequence, "
    "value head): partials dO S^T, dO vnew^T, vnew dS'^T, dvnew S^T, dvnew (v*beta)^T over the value blocks "
    "ascending, then dT, dA = -strict(T^T dT T^T), the decays, dg as a masked column sum of dgc, dbeta (block "
    "sums ascending first), the L2 norms' backward; dq, dk summed over a q/k head's value heads ascending",
}
register_formula("gated_delta", GATED_DELTA_FORMULA)


def tensor_parallel_numerics(tensor_parallel_size: int, expert_parallel: bool = False) -> dict[str, int | str]:
    """The TP-dependent numerics constants for a rollout of TP degree ``S`` (the fingerprint's
    ``tensor_parallel`` entry): the row-parallel ``k_slices``, the vocabulary shards of the
    logprobs and the slices of the column-parallel input gradient, all ``S``. ``S = 1`` is the
    unsharded schedule. A one-process trainer passes the ``S`` it runs ``k_slices`` with.
    ``expert_parallel`` (``S > 1``): the MoE experts are placed whole across the ranks (vLLM's
    ``enable_expert_parallel``; the plain layer) instead of sliced along their intermediate
    dimension (the ``moe_tensor_parallel`` formula) — an extra ``moe_experts`` entry."""
    if not isinstance(tensor_parallel_size, int) or isinstance(tensor_parallel_size, bool) or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {tensor_parallel_size!r}")
    size = tensor_parallel_size
    entry: dict[str, int | str] = {
        "tensor_parallel_size": size,
        "k_slices": size,
        "vocab_shards": size,
        "grad_input_slices": size,
    }
    if expert_parallel and size > 1:
        entry["moe_experts"] = "expert_parallel"
    return entry


#: side ("hf", "vllm", "vllm_ascend") -> the parts off samepath's contract that the user allowed
#: (samepath.audit.enforce): part of the fingerprint while recorded.
_UNCOVERED_ALLOWED: dict[str, tuple[str, ...]] = {}


def record_uncovered(side: str, parts: tuple[str, ...]) -> None:
    """Record (or, with ``()``, clear) the opted-out uncovered parts of one side's model."""
    if parts:
        _UNCOVERED_ALLOWED[side] = tuple(parts)
    else:
        _UNCOVERED_ALLOWED.pop(side, None)


def uncovered_allowed() -> dict[str, tuple[str, ...]]:
    """The opted-out uncovered parts recorded in this process, by side."""
    return dict(_UNCOVERED_ALLOWED)


#: What the fingerprint hashes about the selected attention backend: registered by
#: ``samepath.kernels.attention.backend`` when it is imported (``import samepath`` imports it).
_attention_backend_rows: list[Callable[[], dict[str, object]]] = []


def register_attention_backend_rows(rows: Callable[[], dict[str, object]]) -> None:
    """Declare the function whose result is the fingerprint's ``attention_backend`` entry (the selected
    backend's name, formula and schedule); one registration, the attention backend registry's."""
    _attention_backend_rows[:] = [rows]


def _table_payload() -> dict:
    # Every op module registers its formula when imported, and the attention package its backend
    # rows; importing this module imported the samepath.kernels package, which imports them all.
    if not _attention_backend_rows:
        raise RuntimeError("no attention backend registry is loaded: import samepath.kernels.attention first")
    return {
        "numerics_version": NUMERICS_VERSION,
        "attention_backend": _attention_backend_rows[0](),
        "attention_formula": ATTENTION_FORMULA,
        "op_formulas": OP_FORMULAS,
        "attention": {"/".join(map(str, key)): dataclasses.asdict(cfg) for key, cfg in sorted(ATTENTION_TABLE.items())},
        "matmul": {"/".join(key): dataclasses.asdict(cfg) for key, cfg in sorted(MATMUL_TABLE.items())},
        "row_reduce": {key: dataclasses.asdict(cfg) for key, cfg in sorted(ROW_REDUCE_TABLE.items())},
    }


def _fingerprint_of(table: dict, tensor_parallel_size: int, expert_parallel: bool = False) -> str:
    tensor_parallel = tensor_parallel_numerics(tensor_parallel_size, expert_parallel)
    payload = json.dumps({**table, "tensor_parallel": tensor_parallel}, sort_keys=True, separators=(",", ":"))
    return f"sp{NUMERICS_VERSION}-" + hashlib.sha256(payload.encode()).hexdigest()[:16]


def _uncovered_marker() -> str:
    uncovered = uncovered_allowed()
    if not uncovered:
        return ""
    flat = sorted({part for parts in uncovered.values() for part in parts})
    return "-uncovered" + hashlib.sha256(json.dumps(flat).encode()).hexdigest()[:8]


#: The function that hashes a model config's formulas (``samepath.models.formulas.model_fingerprint``,
#: registered when :mod:`samepath.models` is imported, which ``import samepath`` does): the models
#: room sits above this one, so it registers itself here instead of being imported.
_MODEL_FINGERPRINT: list[Callable[[object], str]] = []


def register_model_fingerprint(function: Callable[[object], str]) -> None:
    """Make ``function`` (a model config -> ``m`` + 12 hex digits) the model part of :func:`fingerprint`."""
    _MODEL_FINGERPRINT[:] = [function]


def model_fingerprint(model_config) -> str:
    """A short hash of a model's formula choices (``samepath.models.formulas.model_formulas``:
    rope type and parameters, norm, activation, MoE routing, attention scale) — ``m`` + 12 hex
    digits; the function :mod:`samepath.models` registers (:func:`register_model_fingerprint`)."""
    if not _MODEL_FINGERPRINT:
        raise RuntimeError("no model fingerprint is registered: import samepath.models (import samepath does)")
    return _MODEL_FINGERPRINT[0](model_config)


def fingerprint(tensor_parallel_size: int = 1, model_config=None, *, expert_parallel: bool = False) -> str:
    """A short hash of every numerics-relevant constant. Equal strings mean equal schedules.

    ``tensor_parallel_size`` is the rollout's TP degree S: the matmul's K slices and the vocabulary
    shards of the logprobs (:func:`tensor_parallel_numerics`) are part of the
    numerics, so a trainer that runs the S-slice kernels and a TP-S rollout compare equal.
    ``expert_parallel``: the rollout runs its MoE experts expert-parallel (vLLM's
    ``enable_expert_parallel=True``), the trainer ``tensor_parallel_numerics(model, S,
    expert_parallel=True)``; without it a MoE's experts are TP-sliced (:func:`tensor_parallel_numerics`).

    ``model_config`` (a Hugging Face config; optional) appends ``-`` + :func:`model_fingerprint`:
    the per-model formula choices, so a rollout and a trainer that resolved the model differently
    compare unequal. Parts of a model the user allowed off the contract
    (``samepath.audit.enforce``) add ``-uncovered<hash>``: a marker for the record,
    which :func:`assert_same_numerics` does not compare (the opt-out already accepted them)."""
    table = _fingerprint_of(_table_payload(), tensor_parallel_size, expert_parallel) + _uncovered_marker()
    return table if model_config is None else f"{table}-{model_fingerprint(model_config)}"


def split_fingerprint(value: str) -> tuple[str, str | None]:
    """``(numerics part, model part or None)`` of a :func:`fingerprint` string, without the
    ``-uncovered`` marker."""
    parts = value.split("-")
    model = [p for p in parts[2:] if len(p) == 13 and p[0] == "m" and all(c in "0123456789abcdef" for c in p[1:])]
    numerics = "-".join(p for p in parts if not p.startswith("uncovered") and p not in model)
    return numerics, (model[-1] if model else None)


def tensor_parallel_size_of(other_fingerprint: str, max_size: int = 64) -> int | None:
    """The ``S`` in ``1..max_size`` for which ``fingerprint(S)`` equals ``other_fingerprint``'s
    numerics part, or ``None`` when no TP degree of this process's table gives it (another version
    or table); with or without expert-parallel experts."""
    numerics, _ = split_fingerprint(other_fingerprint)
    table = _table_payload()
    for size in range(1, max_size + 1):
        if numerics in (_fingerprint_of(table, size), _fingerprint_of(table, size, True)):
            return size
    return None


class NumericsMismatchError(RuntimeError):
    """Raised when two processes would compute logprobs with different numerics tables."""


def assert_same_numerics(
    other_fingerprint: str, tensor_parallel_size: int = 1, model_config=None, *, expert_parallel: bool = False
) -> None:
    """Raise :class:`NumericsMismatchError` unless ``other_fingerprint`` equals this process's
    ``fingerprint(tensor_parallel_size)`` — and, when ``other_fingerprint`` carries a model part and
    ``model_config`` is given, ``fingerprint(tensor_parallel_size, model_config)``. A model part
    with no ``model_config`` to compare it to is checked later (only the numerics part now)."""
    numerics, model_part = split_fingerprint(other_fingerprint)
    mine = _fingerprint_of(_table_payload(), tensor_parallel_size, expert_parallel)
    if numerics != mine:
        raise NumericsMismatchError(
            f"numerics fingerprint mismatch: this process runs {mine}, the other side {other_fingerprint}. "
            "Trainer and rollout must install the same samepath version and config table (and agree on "
            "tensor_parallel_size and on expert parallelism: fingerprint(S, expert_parallel=...)), or their "
            "log-probabilities will not be bit-identical."
        )
    if model_part is not None and model_config is not None and model_part != model_fingerprint(model_config):
        raise NumericsMismatchError(
            f"model formula mismatch: this process resolved the model as {model_fingerprint(model_config)}, "
            f"the other side as {model_part} (another rope scaling, norm, activation, MoE routing or model "
            "type; compare samepath.models.formulas.model_formulas(config) on both sides). The "
            "log-probabilities would not be bit-identical."
        )
