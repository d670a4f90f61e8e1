"""Rotary position embedding: one cos/sin function for every caller, and HF's rotation as a kernel.

:func:`rotary_cos_sin` is *the* function that turns positions into ``cos``/``sin``; trainer and
rollout must both call it, so a position gets the same bits in a training batch and in a decode
step. It follows Hugging Face's ``LlamaRotaryEmbedding`` step by step::

    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # CPU, fp32
    freqs = positions.float()[..., None] * inv_freq        # fp32; HF's K=1 matmul gives the same bits
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)

These are torch's own elementwise ops, so the result equals HF's bit for bit on the same device,
and each element depends only on its own position. ``inv_freq`` is always computed on the CPU (as
HF computes its buffer at construction) and then moved, so it does not depend on the device's
``pow``.

:func:`apply_rotary` computes HF's ``q * cos + rotate_half(q) * sin`` (``rotate_half`` on the
first half / second half split of the rotary dimensions) with HF's rounding points: each product
is an fp32 product of the widened dtype values rounded to the dtype (exactly torch's bf16/fp16
multiply), the sum an fp32 add of the two rounded products rounded to the dtype (exactly torch's
bf16/fp16 add). For float32 all of it is plain fp32 arithmetic. The result is bit-identical to the
stock HF expression. Head dimensions past ``cos.shape[-1]`` (partial rotary) are copied unchanged.

Backward (the rotation's transpose, fp32, one cast): with ``g = [g1, g2]``,
``dx1 = g1 * c1 + g2 * s2`` and ``dx2 = g2 * c2 - g1 * s1``. ``cos``/``sin`` are constants
(HF computes them without gradient); passing ones that require grad is an error.
"""

from __future__ import annotations

import functools
import json
import math

import torch
import triton
import triton.language as tl

from samepath.kernels import grid
from samepath.kernels.config import dtype_name, register_formula
from samepath.kernels.dispatch import device_kind, jit
from samepath.kernels.opaque import register

#: Elements (rows x half rotary dim) one program handles; elementwise, so numerics-neutral.
ELEMENTS_PER_PROGRAM = 4096

ROTARY_FORMULA = {
    "inv_freq": "1.0 / (base ** (arange(0, dim, 2, int64).float() / dim)) in fp32 on the CPU (HF default init)",
    "rope_types": "default, linear, dynamic (below max_position_embeddings), yarn, longrope (short factors, below "
    "original_max_position_embeddings), llama3: transformers 5 ROPE_INIT_FUNCTIONS step by step; others refused",
    "freqs": "positions.float()[..., None] * inv_freq in fp32, cat((freqs, freqs), -1)",
    "cos_sin": "torch cos()/sin() in fp32, * attention scaling, cast to the dtype",
    "rotate_half": "cat((-x[..., half:], x[..., :half]), -1)",
    "apply": "x*cos and rotate_half(x)*sin each rounded to the dtype, then their fp32 sum rounded once",
    "fp_fusion": "disabled",
    "backward": "transpose of the rotation, fp32, one cast",
}
register_formula("rotary", ROTARY_FORMULA)


# ----------------------------------------------------------------------------------------------
# cos / sin
# ----------------------------------------------------------------------------------------------


#: Hugging Face ``rope_type`` values :func:`rotary_inv_freq` computes (each with HF's formula).
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def _rope_type(scaling: dict | None) -> str:
    if scaling is None:
        return "default"
    if not isinstance(scaling, dict):
        raise ValueError(f"scaling must be a dict of HF rope parameters or None, not {type(scaling).__name__}")
    return scaling.get("rope_type", scaling.get("type", "default"))


def _max_positions(scaling: dict, rope_type: str) -> int:
    value = scaling.get("max_position_embeddings")
    if value is None:
        raise ValueError(f"scaling of rope_type {rope_type!r} needs the key 'max_position_embeddings' (the model's)")
    return value


def rotary_position_limit(scaling: dict | None) -> int | None:
    """The first position whose cos/sin Hugging Face computes with a length-dependent formula, or
    ``None`` when every position has one fixed formula.

    ``dynamic`` re-derives ``inv_freq`` once a sequence grows past ``max_position_embeddings``, and
    ``longrope`` switches from its short to its long factors past ``original_max_position_embeddings``;
    beyond that point a position's bits depend on the longest sequence in the batch (and in
    ``generate`` on the cache's history), so no rollout can match them. :func:`rotary_cos_sin`
    refuses positions at or past the limit.
    """
    rope_type = _rope_type(scaling)
    if rope_type == "dynamic":
        return int(_max_positions(scaling, rope_type))
    if rope_type == "longrope":
        if "original_max_position_embeddings" not in scaling:
            raise ValueError("scaling of rope_type 'longrope' needs the key 'original_max_position_embeddings'")
        return int(scaling["original_max_position_embeddings"])
    return None


def _factor(scaling: dict, rope_type: str, required: bool = True) -> float | None:
    """``scaling["factor"]``, refused unless a positive finite number (0 gives NaN frequencies, a
    negative one frequencies HF's formulas were not written for). Hugging Face only warns below 1,
    so a factor in (0, 1) is computed as HF computes it."""
    if "factor" not in scaling and not required:
        return None
    factor = scaling["factor"]  # a missing required key: the caller's KeyError -> ValueError
    if factor is None and not required:
        return None
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
        raise ValueError(
            f"scaling['factor'] of rope_type {rope_type!r} must be a positive finite number, got {factor!r}"
        )
    return factor


def _yarn(inv_dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    # transformers.modeling_rope_utils._compute_yarn_parameters, step by step.
    dim = inv_dim
    factor = _factor(scaling, "yarn", required=False)
    attention_factor = scaling.get("attention_factor")
    mscale = scaling.get("mscale")
    mscale_all_dim = scaling.get("mscale_all_dim")
    original = scaling["original_max_position_embeddings"]
    if factor is None:
        factor = _max_positions(scaling, "yarn") / original
    if attention_factor is None:

        def get_mscale(scale: float, m: float = 1) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_factor


def _longrope(dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    # transformers.modeling_rope_utils._compute_longrope_parameters at seq_len=None (the short
    # factors: positions below original_max_position_embeddings, see rotary_position_limit).
    original = scaling["original_max_position_embeddings"]
    factor = _factor(scaling, "longrope", required=False)
    attention_factor = scaling.get("attention_factor")
    if factor is None:
        factor = _max_positions(scaling, "longrope") / original
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    short_factor = scaling["short_factor"]
    if len(short_factor) != dim // 2:
        raise ValueError(f"longrope short_factor has {len(short_factor)} entries, not rotary_dim // 2 = {dim // 2}")
    ext_factors = torch.tensor(short_factor, dtype=torch.float32)
    inv_freq_shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext_factors * base**inv_freq_shape), attention_factor


def rotary_inv_freq(rotary_dim: int, base: float, scaling: dict | None = None) -> tuple[torch.Tensor, float]:
    """HF's ``inv_freq`` (fp32, CPU, ``[rotary_dim // 2]``) and attention scaling for a rope type.

    ``scaling`` is HF's ``config.rope_parameters`` (``rope_scaling``): ``None`` /
    ``{"rope_type": "default"}``; ``"linear"`` (``factor``); ``"dynamic"`` (``factor``,
    ``max_position_embeddings``: the model's); ``"yarn"`` (``factor``,
    ``original_max_position_embeddings``, optional ``attention_factor``, ``beta_fast``,
    ``beta_slow``, ``mscale``, ``mscale_all_dim``, ``truncate``); ``"longrope"`` (``short_factor``,
    ``long_factor``, ``original_max_position_embeddings``, optional ``factor`` /
    ``max_position_embeddings``, ``attention_factor``); ``"llama3"`` (``factor``,
    ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``). Each is
    transformers' ``ROPE_INIT_FUNCTIONS`` entry step by step, so the bits are HF's. ``dynamic`` and
    ``longrope`` give the formula of positions below :func:`rotary_position_limit`. Any other type
    is a ``ValueError``.
    """
    if not isinstance(rotary_dim, int) or rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even int, got {rotary_dim!r}")
    if not isinstance(base, (int, float)) or not math.isfinite(base) or base <= 0:
        raise ValueError(f"base must be a positive finite float, got {base!r}")
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(dtype=torch.float) / rotary_dim))
    rope_type = _rope_type(scaling)
    try:
        if rope_type == "default":
            return inv_freq, 1.0
        if rope_type == "linear":
            return inv_freq / _factor(scaling, rope_type), 1.0
        if rope_type == "dynamic":
            # _compute_dynamic_ntk_parameters at seq_len = max_position_embeddings (HF's init value,
            # which its forward keeps below that length).
            factor, seq_len = _factor(scaling, rope_type), _max_positions(scaling, rope_type)
            dim = rotary_dim
            if dim == 2:  # HF's exponent dim / (dim - 2) has no value there (ZeroDivisionError)
                raise ValueError(
                    "rotary_dim must be at least 4 for rope_type 'dynamic' (its exponent is dim / (dim - 2))"
                )
            base = base * ((factor * seq_len / seq_len) - (factor - 1)) ** (dim / (dim - 2))
            return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim)), 1.0
        if rope_type == "yarn":
            return _yarn(rotary_dim, base, scaling)
        if rope_type == "longrope":
            return _longrope(rotary_dim, base, scaling)
        if rope_type == "llama3":
            # transformers.modeling_rope_utils._compute_llama3_parameters, line by line.
            factor = _factor(scaling, rope_type)
            low_freq_factor = scaling["low_freq_factor"]
            high_freq_factor = scaling["high_freq_factor"]
            old_context_len = scaling["original_max_position_embeddings"]
            low_freq_wavelen = old_context_len / low_freq_factor
            high_freq_wavelen = old_context_len / high_freq_factor
            wavelen = 2 * math.pi / inv_freq
            inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
            smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
            is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
            return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama), 1.0
    except KeyError as missing:
        raise ValueError(f"scaling of rope_type {rope_type!r} needs the key {missing}") from None
    raise ValueError(f"scaling rope_type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)})")


def _scaling_key(scaling: dict | None) -> str | None:
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        _rope_type(scaling)  # raises the ValueError
    try:
        return json.dumps(scaling, sort_keys=True)
    except TypeError:
        raise ValueError("scaling must hold JSON-like values (numbers, strings, lists)") from None


@functools.lru_cache(maxsize=64)
def _inv_freq_on(rotary_dim: int, base: float, scaling_key: str | None, device: torch.device):
    """:func:`rotary_inv_freq` computed once per parameters and device (callers run it every layer
    and step); the CPU result moved, so the bits do not depend on the device."""
    scaling = None if scaling_key is None else json.loads(scaling_key)
    inv_freq, attention_scaling = rotary_inv_freq(rotary_dim, base, scaling)
    return inv_freq.to(device), attention_scaling


def rotary_cos_sin(
    positions: torch.Tensor,
    rotary_dim: int,
    base: float,
    dtype: torch.dtype,
    scaling: dict | None = None,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``, ``sin`` ``[*positions.shape, rotary_dim]`` in ``dtype``, exactly as HF computes them.

    Args:
        positions: integer positions of any shape (HF's ``position_ids`` ``[B, S]``, vLLM's
            ``positions`` ``[T]``).
        rotary_dim: the rotated part of the head (the head size unless partial rotary).
        base: ``rope_theta``.
        dtype: the model dtype (float32 / bfloat16 / float16).
        scaling: HF's ``rope_parameters`` / ``rope_scaling`` (see :func:`rotary_inv_freq`).
        interleaved: each frequency repeated in place (``repeat_interleave(freqs, 2)``: GPT-J style,
            for ``apply_rotary(..., interleaved=True)``) instead of ``cat((freqs, freqs))``.

    Raises ``ValueError`` for a position at or past :func:`rotary_position_limit`.

    Every element depends only on its own position: the same position gives the same bits in any
    batch, in any shape.
    """
    _checked_positions(positions)
    dtype_name(dtype, "dtype")
    device_kind(positions.device)
    if torch.compiler.is_compiling():
        key = _constant_scaling_key(scaling)
        return torch.ops.samepath.rotary_cos_sin(positions, int(rotary_dim), float(base), dtype, key, interleaved)
    inv_freq, attention_scaling = _inv_freq_on(rotary_dim, base, _scaling_key(scaling), positions.device)
    limit = rotary_position_limit(scaling)
    if limit is not None and positions.numel() and int(positions.max()) >= limit:
        raise ValueError(
            f"position {int(positions.max())} is at or past {limit}, where Hugging Face's {_rope_type(scaling)!r} "
            "rope turns length-dependent (its bits would depend on the batch): samepath refuses it"
        )
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    return _cos_sin(freqs, attention_scaling, dtype, interleaved)


@torch.compiler.assume_constant_result
def _constant_scaling_key(scaling: dict | None) -> str | None:
    return _scaling_key(scaling)


# ``torch.compile``: the cos/sin tables as custom ops (Inductor would compute ``cos`` / ``sin`` with
# its own kernels), ``scaling`` as its JSON key.
@torch.library.custom_op(register("rotary_cos_sin"), mutates_args=())
def _rotary_cos_sin_op(
    positions: torch.Tensor, rotary_dim: int, base: float, dtype: torch.dtype, scaling: str | None, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    scaling_dict = None if scaling is None else json.loads(scaling)
    cos, sin = rotary_cos_sin(positions, rotary_dim, base, dtype, scaling_dict, interleaved)
    return cos.contiguous(), sin.contiguous()


@_rotary_cos_sin_op.register_fake
def _(positions, rotary_dim, base, dtype, scaling, interleaved):
    shape = (*positions.shape, rotary_dim)
    return positions.new_empty(shape, dtype=dtype), positions.new_empty(shape, dtype=dtype)


@torch.library.custom_op(register("mrope_cos_sin"), mutates_args=())
def _mrope_cos_sin_op(
    position_ids: torch.Tensor,
    rotary_dim: int,
    base: float,
    dtype: torch.dtype,
    mrope_section: list[int],
    scaling: str | None,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    scaling_dict = None if scaling is None else json.loads(scaling)
    cos, sin = mrope_cos_sin(position_ids, rotary_dim, base, dtype, mrope_section, scaling_dict, interleaved)
    return cos.contiguous(), sin.contiguous()


@_mrope_cos_sin_op.register_fake
def _(position_ids, rotary_dim, base, dtype, mrope_section, scaling, interleaved):
    three_rows = position_ids.dim() >= 2 and position_ids.shape[0] == 3
    shape = (*(position_ids.shape[1:] if three_rows else position_ids.shape), rotary_dim)
    return position_ids.new_empty(shape, dtype=dtype), position_ids.new_empty(shape, dtype=dtype)


def _cos_sin(freqs: torch.Tensor, attention_scaling: float, dtype: torch.dtype, interleaved: bool):
    emb = torch.repeat_interleave(freqs, 2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * attention_scaling
    sin = emb.sin() * attention_scaling
    return cos.to(dtype), sin.to(dtype)


def _checked_positions(positions: object, name: str = "positions") -> None:
    if not isinstance(positions, torch.Tensor) or positions.dtype not in (torch.int32, torch.int64):
        got = positions.dtype if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise ValueError(f"{name} must be an int32/int64 tensor, got {got}")


def mrope_axes(rotary_dim: int, mrope_section: list[int] | tuple[int, ...], interleaved: bool) -> torch.Tensor:
    """For each of the ``rotary_dim // 2`` frequencies, which row of the ``[3, ...]`` position ids
    (0 temporal, 1 height, 2 width) it rotates by.

    Contiguous sections (Qwen2-VL / Qwen2.5-VL, Hugging Face's ``recomposition_frequencies``): the
    first ``mrope_section[0]`` frequencies take row 0, the next ``mrope_section[1]`` row 1, the
    next row 2 (section ``i`` takes row ``i % 3``). Interleaved (Qwen3-VL): frequency ``j`` takes
    row 1 when ``j % 3 == 1`` and ``j < 3 * mrope_section[1]``, row 2 when ``j % 3 == 2`` and
    ``j < 3 * mrope_section[2]``, else row 0.
    """
    half = rotary_dim // 2
    sections = [int(s) for s in mrope_section] if isinstance(mrope_section, (list, tuple)) else None
    if not sections or any(s < 0 for s in sections):
        raise ValueError(f"mrope_section must be a list of non-negative ints, got {mrope_section!r}")
    if interleaved:
        if len(sections) != 3 or 3 * max(sections[1:]) > half + 2:
            raise ValueError(f"interleaved mrope_section {sections} does not fit rotary_dim // 2 = {half}")
        axes = torch.zeros(half, dtype=torch.int64)
        for axis in (1, 2):
            axes[axis : 3 * sections[axis] : 3] = axis
        return axes
    if sum(sections) != half:
        raise ValueError(f"mrope_section {sections} must sum to rotary_dim // 2 = {half}")
    return torch.cat([torch.full((s,), i % 3, dtype=torch.int64) for i, s in enumerate(sections)])


def mrope_cos_sin(
    position_ids: torch.Tensor,
    rotary_dim: int,
    base: float,
    dtype: torch.dtype,
    mrope_section: list[int] | tuple[int, ...],
    scaling: dict | None = None,
    mrope_interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multimodal rope (``mrope``): ``cos``, ``sin`` ``[*position_ids.shape[1:], rotary_dim]`` for
    ``position_ids`` ``[3, ...]`` (temporal, height, width rows; a ``[...]`` tensor is taken as all
    three rows equal, as Hugging Face's ``expand(3, -1, -1)``), exactly as Qwen2.5-VL's
    ``Qwen2_5_VLRotaryEmbedding`` / Qwen3-VL's ``Qwen3VLTextRotaryEmbedding`` compute them.

    Frequency ``j`` is rotated by row :func:`mrope_axes` ``[j]`` of the positions; Hugging Face
    computes the cos/sin of every row and then selects, samepath selects the position first —
    the same fp32 product, the same ``cos``/``sin``, so the same bits. Every element depends only on
    its own three positions.
    """
    _checked_positions(position_ids, "position_ids")
    dtype_name(dtype, "dtype")
    device_kind(position_ids.device)
    if torch.compiler.is_compiling():
        key = _constant_scaling_key(scaling)
        sections = [int(s) for s in mrope_section]
        args = (int(rotary_dim), float(base), dtype, sections, key, bool(mrope_interleaved))
        return torch.ops.samepath.mrope_cos_sin(position_ids, *args)
    if position_ids.dim() >= 1 and position_ids.shape[0] == 3 and position_ids.dim() >= 2:
        rows = position_ids
    else:
        rows = position_ids.unsqueeze(0).expand(3, *position_ids.shape)
    axes = mrope_axes(rotary_dim, mrope_section, mrope_interleaved).to(position_ids.device)
    inv_freq, attention_scaling = _inv_freq_on(rotary_dim, base, _scaling_key(scaling), position_ids.device)
    limit = rotary_position_limit(scaling)
    if limit is not None and rows.numel() and int(rows.max()) >= limit:
        raise ValueError(f"position {int(rows.max())} is at or past {limit} (length-dependent rope): refused")
    # [..., half]: the position of the row each frequency takes.
    chosen = torch.movedim(rows, 0, -1).index_select(-1, axes)
    freqs = chosen.to(torch.float32) * inv_freq
    return _cos_sin(freqs, attention_scaling, dtype, False)


# ----------------------------------------------------------------------------------------------
# Rotation kernel
# ----------------------------------------------------------------------------------------------


@jit
def _rotary_kernel(
    X,
    Cos,
    Sin,
    Out,
    num_rows,
    size1,
    size2,
    stride_x0,
    stride_x1,
    stride_x2,
    stride_c0,
    stride_c1,
    stride_c2,
    stride_o0,
    stride_o1,
    stride_o2,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BACKWARD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    """Blocks of BLOCK_R rows of a ``[n0, size1, size2, HEAD]`` tensor; cos/sin rows found through
    their own strides (0 where broadcast). Forward: HF's ``x*cos + rotate_half(x)*sin``; backward:
    its transpose. A rotated pair is columns ``(i, i + HALF)`` (rotate-half, NeoX) or, with
    ``INTERLEAVED``, ``(2i, 2i + 1)`` (GPT-J); the arithmetic of a pair is the same."""
    for work in range(tl.program_id(0), tl.cdiv(num_rows, BLOCK_R), tl.num_programs(0)):
        rows = work * BLOCK_R + tl.arange(0, BLOCK_R)
        row_valid = rows < num_rows
        rows = rows.to(tl.int64)
        i0 = rows // (size1 * size2)
        i1 = (rows // size2) % size1
        i2 = rows % size2
        x_row = i0 * stride_x0 + i1 * stride_x1 + i2 * stride_x2
        c_row = i0 * stride_c0 + i1 * stride_c1 + i2 * stride_c2
        o_row = i0 * stride_o0 + i1 * stride_o1 + i2 * stride_o2

        cols = tl.arange(0, BLOCK_H)
        mask = row_valid[:, None] & (cols < HALF)[None, :]
        if INTERLEAVED:
            one = cols * 2
            other = 1
        else:
            one = cols
            other = HALF
        first = x_row[:, None] + one[None, :]
        x1 = tl.load(X + first, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(X + first + other, mask=mask, other=0.0).to(tl.float32)
        c_first = c_row[:, None] + one[None, :]
        c1 = tl.load(Cos + c_first, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(Cos + c_first + other, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(Sin + c_first, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(Sin + c_first + other, mask=mask, other=0.0).to(tl.float32)
        dtype = Out.dtype.element_ty
        if BACKWARD:
            o1 = x1 * c1 + x2 * s2
            o2 = x2 * c2 - x1 * s1
        else:
            # Each product rounded to the dtype, then the fp32 sum of the rounded products rounded.
            o1 = (x1 * c1).to(dtype).to(tl.float32) + ((-x2) * s1).to(dtype).to(tl.float32)
            o2 = (x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)
        out_first = o_row[:, None] + one[None, :]
        tl.store(Out + out_first, o1.to(dtype), mask=mask)
        tl.store(Out + out_first + other, o2.to(dtype), mask=mask)

        if HEAD > 2 * HALF:
            pass_cols = 2 * HALF + tl.arange(0, BLOCK_P)
            pass_mask = row_valid[:, None] & (pass_cols < HEAD)[None, :]
            kept = tl.load(X + x_row[:, None] + pass_cols[None, :], mask=pass_mask, other=0.0)
            tl.store(Out + o_row[:, None] + pass_cols[None, :], kept, mask=pass_mask)


def _as_4d(tensor: torch.Tensor) -> torch.Tensor:
    while tensor.dim() < 4:
        tensor = tensor.unsqueeze(0)
    return tensor


def _rotate(
    x4: torch.Tensor, cos4: torch.Tensor, sin4: torch.Tensor, backward: bool, interleaved: bool = False
) -> torch.Tensor:
    out = torch.empty(x4.shape, dtype=x4.dtype, device=x4.device)
    n0, size1, size2, head = x4.shape
    num_rows = n0 * size1 * size2
    if num_rows == 0:
        return out
    half = cos4.shape[-1] // 2
    block_h = triton.next_power_of_2(half)
    block_r = max(1, min(64, ELEMENTS_PER_PROGRAM // block_h))
    _rotary_kernel[(grid.num_programs(triton.cdiv(num_rows, block_r), x4.device),)](
        x4,
        cos4,
        sin4,
        out,
        num_rows,
        size1,
        size2,
        *x4.stride()[:3],
        *cos4.stride()[:3],
        *out.stride()[:3],
        HALF=half,
        BLOCK_H=block_h,
        HEAD=head,
        BLOCK_P=triton.next_power_of_2(max(1, head - 2 * half)),
        BLOCK_R=block_r,
        BACKWARD=backward,
        INTERLEAVED=interleaved,
    )
    return out


class RotaryFunction(torch.autograd.Function):
    """Autograd for one tensor's rotation; ``cos4``/``sin4`` are broadcast 4-D views."""

    @staticmethod
    def forward(ctx, x4, cos4, sin4, interleaved=False):  # type: ignore[override]
        ctx.save_for_backward(cos4, sin4)
        ctx.interleaved = interleaved
        return _rotate(x4, cos4, sin4, backward=False, interleaved=interleaved)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        cos4, sin4 = ctx.saved_tensors
        grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
        return _rotate(grad_out, cos4, sin4, backward=True, interleaved=ctx.interleaved), None, None, None


@torch.library.custom_op(register("rotary"), mutates_args=())
def _rotary_op(x4: torch.Tensor, cos4: torch.Tensor, sin4: torch.Tensor, interleaved: bool) -> torch.Tensor:
    return _rotate(x4, cos4, sin4, backward=False, interleaved=interleaved)


@_rotary_op.register_fake
def _(x4, cos4, sin4, interleaved):
    return x4.new_empty(x4.shape)


@torch.library.custom_op(register("rotary_backward"), mutates_args=())
def _rotary_backward_op(grad: torch.Tensor, cos4: torch.Tensor, sin4: torch.Tensor, interleaved: bool) -> torch.Tensor:
    grad = grad if grad.stride(-1) == 1 else grad.contiguous()
    return _rotate(grad, cos4, sin4, backward=True, interleaved=interleaved)


@_rotary_backward_op.register_fake
def _(grad, cos4, sin4, interleaved):
    return grad.new_empty(grad.shape)


def _rotary_setup(ctx, inputs, output):
    _, cos4, sin4, ctx.interleaved = inputs
    ctx.save_for_backward(cos4, sin4)


def _rotary_grad(ctx, grad):
    cos4, sin4 = ctx.saved_tensors
    return torch.ops.samepath.rotary_backward(grad, cos4, sin4, ctx.interleaved), None, None, None


_rotary_op.register_autograd(_rotary_grad, setup_context=_rotary_setup)


def _rotate_one(
    name: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int, interleaved: bool = False
):
    if not isinstance(x, torch.Tensor) or not 2 <= x.dim() <= 4:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be [B, H, S, D], [T, H, D] or [T, D], got shape {shape}")
    dtype_name(x.dtype, f"{name}.dtype")
    if cos.dtype != x.dtype:
        raise ValueError(f"cos dtype {cos.dtype} differs from {name}'s {x.dtype} (HF casts cos/sin to it)")
    if cos.device != x.device:
        raise ValueError(f"cos is on {cos.device}, expected {x.device} ({name}'s device)")
    rotary_dim = cos.shape[-1]
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"cos.shape[-1] = {rotary_dim} exceeds {name}.shape[-1] = {x.shape[-1]}")
    try:
        cos_b = cos.unsqueeze(unsqueeze_dim) if unsqueeze_dim is not None else cos
        sin_b = sin.unsqueeze(unsqueeze_dim) if unsqueeze_dim is not None else sin
        target = (*x.shape[:-1], rotary_dim)
        cos_b, sin_b = cos_b.expand(target), sin_b.expand(target)
    except (RuntimeError, IndexError) as err:
        raise ValueError(
            f"cos/sin of shape {tuple(cos.shape)} (unsqueezed at {unsqueeze_dim}) do not broadcast to "
            f"{name}'s {tuple(x.shape)}: {err}"
        ) from None
    if cos_b.stride(-1) != 1:
        cos_b, sin_b = cos_b.contiguous(), sin_b.contiguous()
    if sin_b.stride() != cos_b.stride():
        sin_b = sin_b.contiguous()
        cos_b = cos_b.contiguous()
    x = x if x.stride(-1) == 1 else x.contiguous()
    rotate = torch.ops.samepath.rotary if torch.compiler.is_compiling() else RotaryFunction.apply
    out = rotate(_as_4d(x), _as_4d(cos_b), _as_4d(sin_b), interleaved)
    return out.reshape(x.shape)


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int | None = 1,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` as one kernel per tensor.

    ``interleaved=True``: GPT-J style, the pairs ``(2i, 2i + 1)`` (Hugging Face's Cohere / GLM
    ``rotate_half`` on even / odd columns, with cos/sin from ``rotary_cos_sin(..., interleaved=True)``);
    the same products and roundings per pair.

    Args:
        q, k: ``[B, H, S, D]`` (HF) or ``[T, H, D]`` (vLLM); ``k`` may have fewer heads.
        cos, sin: from :func:`rotary_cos_sin`, ``[B, S, R]`` or ``[T, R]`` with ``R <= D`` even,
            in q's dtype; unsqueezed at ``unsqueeze_dim`` (the head dimension; ``None`` if already
            broadcastable) and broadcast to ``q``/``k``.

    Returns:
        ``(q_embed, k_embed)``, bit-identical to HF's ``q * cos + rotate_half(q) * sin``; the
        last ``D - R`` dimensions pass through unchanged. Differentiable in ``q`` and ``k``.
    """
    for name, tensor in (("cos", cos), ("sin", sin)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() < 1:
            raise ValueError(f"{name} must be a tensor [..., rotary_dim]")
        if tensor.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{name} must not require grad: cos/sin are constants of the rotation")
    if sin.shape != cos.shape or sin.dtype != cos.dtype or sin.device != cos.device:
        raise ValueError(
            f"sin {tuple(sin.shape)} {sin.dtype} {sin.device} must match cos {tuple(cos.shape)} {cos.dtype}"
        )
    if cos.shape[-1] % 2 or cos.shape[-1] == 0:
        raise ValueError(f"cos.shape[-1] = {cos.shape[-1]} must be a positive even rotary dimension")
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        raise ValueError("q and k must be tensors")
    device_kind(q.device)
    if k.dtype != q.dtype:
        raise ValueError(f"k dtype {k.dtype} differs from q's {q.dtype}")
    if k.device != q.device:
        raise ValueError(f"k is on {k.device}, expected {q.device} (q's device)")
    if not isinstance(interleaved, bool):
        raise ValueError(f"interleaved must be a bool, got {interleaved!r}")
    return (
        _rotate_one("q", q, cos, sin, unsqueeze_dim, interleaved),
        _rotate_one("k", k, cos, sin, unsqueeze_dim, interleaved),
    )
