"""Which attention backend runs, and the Ascend C one's loader and Python entry point.

``SAMEPATH_ATTENTION_BACKEND`` chooses the FlashAttention forward for every samepath caller:

* ``triton`` (default): the Triton kernel of ``samepath/kernels/attention.py`` on every device.
* ``ascendc``: the hand-written Ascend C kernel of ``csrc/flash_attention_fwd.cpp`` for NPU tensors,
  with the formula of the Triton kernel (position-anchored KV tiles visited in ascending order by one
  core, select ``-inf`` mask, fp32 online softmax in base 2, P cast to the input dtype before P @ V,
  ``acc / l``) on the schedule of numerics version 1 (:data:`ASCENDC_SCHEDULE`: no GQA packing, no
  KV segments).

The Ascend C backend is its own numerics: its bits equal the Triton-Ascend kernel's only where the
instructions happen to agree, so trainer and rollout must both run it or both not. The choice is part
of ``samepath.fingerprint()``, and asking for ``ascendc`` where it cannot run raises instead of falling
back to Triton.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import threading
from pathlib import Path

import torch

from samepath.ascendc_fallback import tiling

#: Environment variable that selects the attention backend.
BACKEND_ENV = "SAMEPATH_ATTENTION_BACKEND"
BACKENDS = ("triton", "ascendc")
DEFAULT_BACKEND = "triton"
#: Where the built library is looked for (and built); default ``~/.cache/samepath/ascendc``.
BUILD_DIR_ENV = "SAMEPATH_ASCENDC_BUILD_DIR"
#: SoC the kernel is compiled for when ``load()`` builds it (``npu-smi info`` shows the chip).
SOC_VERSION_ENV = "SAMEPATH_ASCENDC_SOC_VERSION"
DEFAULT_SOC_VERSION = "Ascend910B3"
LIBRARY_NAME = "libsamepath_ascendc.so"
SOURCE_DIR = Path(__file__).resolve().parent / "csrc"

#: How the Ascend C kernel computes, where it differs in form from ``config.ATTENTION_FORMULA``.
ASCENDC_ATTENTION_FORMULA = {
    "exp2": "exp(x * ln2) in fp32 (Muls then Exp: Ascend C has no exp2)",
    "accumulator": "acc * exp2(m_old - m_new) in fp32, then + fp32 dot(P, V) from the cube",
    "dots": "cube matmuls through the Ascend C Matmul API, fp32 output",
    "log2": "AscendC::Log2",
    "row_reductions": "WholeReduceMax / WholeReduceSum over one tile row",
}

#: The Ascend C kernel keeps the schedule of samepath numerics version 1: the Triton kernel's GQA
#: packing and fixed KV segments (version 2) are not ported to it.
ASCENDC_SCHEDULE = "v1: one query head per program, block_m query rows, tile_n KV tiles, no KV segments"

_lock = threading.Lock()
_loaded_path: Path | None = None


def attention_backend() -> str:
    """The attention backend ``SAMEPATH_ATTENTION_BACKEND`` selects: ``"triton"`` (unset) or ``"ascendc"``.

    Raises:
        ValueError: the variable holds anything else.
    """
    value = os.environ.get(BACKEND_ENV, "").strip()
    if not value:
        return DEFAULT_BACKEND
    if value not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={value!r} is not a samepath attention backend: use one of {BACKENDS}")
    return value


def backend_fingerprint() -> dict[str, object]:
    """What ``samepath.fingerprint()`` should hash about the backend choice."""
    backend = attention_backend()
    if backend == "ascendc":
        return {
            "name": backend,
            "formula": ASCENDC_ATTENTION_FORMULA,
            "numerics": "ascendc-fa-fwd-1",
            "schedule": ASCENDC_SCHEDULE,
        }
    return {"name": backend}


def build_dir() -> Path:
    """Directory of the built ``libsamepath_ascendc.so`` (``SAMEPATH_ASCENDC_BUILD_DIR``)."""
    configured = os.environ.get(BUILD_DIR_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "samepath" / "ascendc"


def missing_requirements() -> list[str]:
    """Why the Ascend C backend cannot run in this process (empty when it can). Never imports torch_npu
    without CANN (that import fails, and breaks ``import torch`` in later processes)."""
    reasons = []
    cann = os.environ.get("ASCEND_HOME_PATH")
    if not cann or not Path(cann).is_dir():
        reasons.append("CANN is not installed or not set up (ASCEND_HOME_PATH is unset; source <CANN>/set_env.sh)")
    if importlib.util.find_spec("torch_npu") is None:
        reasons.append("torch_npu is not installed")
    if reasons:
        return reasons
    try:
        import torch_npu  # noqa: F401
    except Exception as error:  # torch_npu raises plain Exceptions when CANN libraries do not load
        return [f"torch_npu does not import: {error}"]
    if not torch.npu.is_available():
        reasons.append("no Ascend NPU is visible (torch.npu.is_available() is False)")
    return reasons


def _build(directory: Path) -> Path:
    cmake = shutil.which("cmake")
    if cmake is None:
        raise RuntimeError(f"{BACKEND_ENV}=ascendc: {LIBRARY_NAME} is not built in {directory} and cmake is missing")
    soc = os.environ.get(SOC_VERSION_ENV, DEFAULT_SOC_VERSION)
    directory.mkdir(parents=True, exist_ok=True)
    for command in (
        [cmake, "-S", str(SOURCE_DIR), "-B", str(directory), f"-DSOC_VERSION={soc}", "-DCMAKE_BUILD_TYPE=Release"],
        [cmake, "--build", str(directory), "-j", str(os.cpu_count() or 1)],
    ):
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(
                f"{BACKEND_ENV}=ascendc: building the Ascend C attention failed ({' '.join(command)}):\n"
                f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
            )
    return directory / LIBRARY_NAME


def load() -> Path:
    """Load the ``samepath_ascendc`` torch operators, building them with CMake first if needed.

    Returns the library's path. Raises ``RuntimeError`` naming what is missing (CANN, torch_npu, an
    NPU, a successful build); it never falls back to the Triton kernel.
    """
    global _loaded_path
    with _lock:
        if _loaded_path is not None:
            return _loaded_path
        reasons = missing_requirements()
        if reasons:
            raise RuntimeError(f"{BACKEND_ENV}=ascendc needs CANN, torch_npu and an Ascend NPU: " + "; ".join(reasons))
        path = build_dir() / LIBRARY_NAME
        if not path.exists():
            path = _build(build_dir())
        torch.ops.load_library(str(path))
        _loaded_path = path
        return path


def _dtype_name(dtype: torch.dtype) -> str:
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    if dtype not in names:
        raise ValueError(f"query.dtype must be one of torch.float32, torch.bfloat16, torch.float16, got {dtype}")
    return names[dtype]


def _check_int_vector(name: str, tensor: torch.Tensor, length: int | None = None) -> None:
    if tensor.dtype not in (torch.int32, torch.int64) or tensor.dim() != 1:
        raise ValueError(f"{name} must be a 1-D int32/int64 tensor, got {tensor.dtype} of shape {tuple(tensor.shape)}")
    if length is not None and tensor.numel() != length:
        raise ValueError(f"{name} must have {length} entries, got {tensor.numel()}")


def check_arguments(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start_loc: torch.Tensor,
    kv_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor | None,
    scale: float,
    causal: bool,
    sliding_window: int | None,
    block_m: int,
    tile_n: int,
) -> None:
    """The checks ``flash_attention_fwd`` makes before loading anything: ``ValueError`` naming the argument."""
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_size], got shape {tuple(query.shape)}")
    kv_dims = 4 if block_table is not None else 3
    layout = "[num_blocks, block_size, num_kv_heads, head_size]" if block_table is not None else "[tokens, heads, head]"
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dim() != kv_dims:
            raise ValueError(f"{name} must be {layout}, got shape {tuple(tensor.shape)}")
        if tensor.dtype != query.dtype:
            raise ValueError(f"{name} dtype {tensor.dtype} differs from the query's {query.dtype}")
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_size) dimension")
        if tensor.device != query.device:
            raise ValueError(f"{name} is on {tensor.device}, expected {query.device} (the query's device)")
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have the same shape")
    if query.stride(-1) != 1:
        raise ValueError("query must be contiguous in its last (head_size) dimension")
    num_heads, head_size = query.shape[1:]
    num_kv_heads = key.shape[-2]
    if key.shape[-1] != head_size:
        raise ValueError(f"key head size {key.shape[-1]} differs from the query's {head_size}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"query has {num_heads} heads, not a multiple of the {num_kv_heads} KV heads")
    dtype = _dtype_name(query.dtype)
    _check_int_vector("query_start_loc", query_start_loc)
    num_seqs = query_start_loc.numel() - 1
    _check_int_vector("kv_start_loc", kv_start_loc)
    _check_int_vector("seq_lens", seq_lens, num_seqs)
    if block_table is not None and (block_table.dim() != 2 or block_table.dtype not in (torch.int32, torch.int64)):
        raise ValueError(
            f"block_table must be a 2-D int32/int64 tensor, got {block_table.dtype} {tuple(block_table.shape)}"
        )
    for name, tensor in (("query_start_loc", query_start_loc), ("kv_start_loc", kv_start_loc), ("seq_lens", seq_lens)):
        if tensor.device != query.device:
            raise ValueError(f"{name} is on {tensor.device}, expected {query.device} (the query's device)")
    if block_table is not None and block_table.device != query.device:
        raise ValueError(f"block_table is on {block_table.device}, expected {query.device} (the query's device)")
    if not isinstance(scale, (int, float)) or not scale > 0 or scale == float("inf"):
        raise ValueError(f"scale must be a positive finite float, got {scale!r}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1 or not causal):
        raise ValueError(f"sliding_window must be None or a positive int with causal=True, got {sliding_window!r}")
    tiling.check_fits(int(head_size), block_m, tile_n, dtype)
    if block_table is not None and key.shape[1] > 0xFFFF:
        raise ValueError(f"key.shape[1] (page size) = {key.shape[1]} must be at most 65535")


def flash_attention_fwd(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start_loc: torch.Tensor,
    kv_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor | None,
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    *,
    block_m: int,
    tile_n: int,
    store_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The Ascend C FlashAttention forward: the Triton launcher's arguments, the same outputs.

    Args:
        query: ``[num_tokens, num_heads, head_size]`` on an NPU.
        key, value: packed ``[tokens, num_kv_heads, head_size]`` (training; ``block_table`` None,
            sequence ``i``'s keys start at ``kv_start_loc[i]``) or paged caches
            ``[num_blocks, block_size, num_kv_heads, head_size]`` addressed through ``block_table``.
        query_start_loc: ``[num_seqs + 1]`` cumulative query counts.
        kv_start_loc: ``[num_seqs (+1)]`` first packed key of each sequence (ignored when paged).
        seq_lens: ``[num_seqs]`` KV length of each sequence; its queries are its last positions.
        block_table: ``[num_seqs(+), max_blocks]`` page ids, or None for contiguous KV.
        scale, causal, sliding_window: as in :func:`samepath.paged_attention`.
        block_m, tile_n: the frozen tiles (``config.attention_config(...)`` for ``"npu"``).
        store_lse: also return the base-2 log-sum-exp ``[num_tokens, num_heads]`` fp32 (``+inf`` for a
            row that sees no key), as the Triton kernel stores it for the backward.

    Returns:
        ``(out, lse)``: ``out`` in the query's dtype, ``lse`` or None.

    Raises:
        ValueError: a bad argument (named), before anything is loaded.
        RuntimeError: the Ascend C backend cannot run here (says what is missing).
    """
    check_arguments(
        query,
        key,
        value,
        query_start_loc,
        kv_start_loc,
        seq_lens,
        block_table,
        scale,
        causal,
        sliding_window,
        block_m,
        tile_n,
    )
    if query.device.type != "npu":
        raise RuntimeError(
            f"{BACKEND_ENV}=ascendc runs attention on Ascend NPU tensors only; got tensors on {query.device}"
        )
    load()
    out, lse = torch.ops.samepath_ascendc.flash_attention_fwd(
        query,
        key,
        value,
        query_start_loc,
        kv_start_loc,
        seq_lens,
        block_table,
        float(scale),
        bool(causal),
        int(sliding_window or 0),
        int(block_m),
        int(tile_n),
        bool(store_lse),
    )
    return out, (lse if store_lse else None)


def launch_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start_loc: torch.Tensor,
    kv_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor | None,
    scale: float,
    causal: bool,
    sliding_window: int | None,
    config,
    store_lse: bool,
    out: torch.Tensor,
) -> torch.Tensor | None:
    """Drop-in for ``samepath.kernels.attention._launch_forward`` (same arguments, writes ``out``,
    returns the lse or None) running the Ascend C kernel with ``config.block_m`` / ``config.tile_n``."""
    result, lse = flash_attention_fwd(
        query,
        key,
        value,
        query_start_loc,
        kv_start_loc,
        seq_lens,
        block_table,
        scale,
        causal,
        sliding_window,
        block_m=config.block_m,
        tile_n=config.tile_n,
        store_lse=store_lse,
    )
    out.copy_(result)
    return lse
