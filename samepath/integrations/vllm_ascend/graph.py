"""ACL graph mode for samepath's vllm-ascend attention: fixed-size metadata on the device, no host work per step.

vllm-ascend captures the model's forward in an ACL graph per padded batch size
(``compilation_config.cudagraph_mode`` ``FULL_DECODE_ONLY`` / ``FULL``; ``ACLGraphWrapper`` in
``vllm_ascend/compilation/acl_graph.py``) and replays it. Its capture rules, read from 0.18.0 / 0.23.0 /
0.23.0.post1, and what samepath does under each:

* **The captured kernels read fixed addresses.** A replay runs the kernels with the arguments of the
  capture, so every tensor the attention reads must live at the same address every step (the wrapper
  checks the inputs' ``data_ptr`` in DEBUG). vllm-ascend's ``AscendMetadataBuilder.build`` makes a new
  ``query_start_loc`` on the device every step and keeps ``seq_lens`` on the host, and re-points its own
  fused-attention tasks after each replay (``update_graph_params``: ``graph_task_update`` with the new host
  lengths). samepath's kernels take their metadata from the device instead, so :class:`GraphInputs` holds
  persistent buffers, one set per metadata builder (per KV-cache group) for the whole engine: ``query_start_loc``
  ``[rows + 1]``, ``seq_lens`` ``[rows]`` (int32, one allocation) and ``block_table``
  ``[rows, max_num_blocks_per_req]``, with ``rows = max_num_seqs + 2`` (vllm-ascend's ``query_start_loc`` buffer
  size, which holds its dummy padding request). They are sized once from the engine's limits (the scheduler's
  ``max_num_seqs``, the builder's ``max_num_blocks_per_req``; either missing is refused by name) and never
  reallocated: a step with more requests, or a wider block table, is refused by name.
* **The new values arrive before the replay, outside the graph.** :func:`make_build` wraps the builder's
  ``build`` (which ``build_for_graph_capture`` also calls): after vllm-ascend's own build it writes the
  step's host-side lengths (``actual_seq_lengths_q`` / ``seq_lens_list``, or the common metadata's CPU
  tensors) into a pinned host tensor, issues one non-blocking host-to-device copy into the buffers and
  one device copy of the block table rows, on the current stream — ahead of the replay the model runner
  enqueues next — and attaches the buffers to the metadata. Requests past the real ones (the dummy
  padding request, graph padding) get no query tokens and no keys: the kernel reads no key for them.
  Nothing is read back from the device.
* **Nothing in the captured region waits for the host or allocates from a host value.** During capture
  (``_EXTRA_CTX.capturing``) ``forward_impl`` calls :func:`graph_paged_attention`: the kernel over all
  ``query.shape[0]`` rows (the capture size; the rows of no request, which vllm-ascend trims, hold no
  meaningful values), the buffers as metadata,
  its launch plan (program maps) built from the buffer inside the capture, so a replay recomputes it from
  the new values, and no value checks (``validate=False``). Eager steps (prefill, sizes past the largest
  capture, warm-up) keep :func:`.attention.paged_attention_from_metadata`.
* **No fused-attention task to update.** ``update_graph_params`` (called after the replay is enqueued to
  re-point vllm-ascend's own FIA / paged-attention tasks) becomes a no-op while samepath's attention is
  installed: the captured graph holds none of those tasks.
* **No torch.compile.** ``PIECEWISE`` graphs need ``compilation_config.mode=VLLM_COMPILE``, whose
  vllm-ascend fusion passes (add + RMSNorm, qk-norm + rope) would rewrite the graph around samepath's
  patched ops: refused by name. ACL graphs without compilation (``mode=NONE`` with ``FULL_DECODE_ONLY`` /
  ``FULL``, which vllm-ascend's platform keeps) and eager mode are supported.

Proven on the CPU (``tests/test_vllm_ascend_graph.py``) with the same sync-counting harness as vLLM's
``test_vllm_decode_step_host_work``: a decode step's attention in graph mode reads nothing from the device
and makes the same aten ops whatever the context, the buffers keep their addresses, and its rows equal the
eager path's and the trainer's. The capture itself (``torch.npu.NPUGraph``) needs an NPU.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch

from samepath.integrations.vllm_ascend.metadata import host_ints, host_layout
from samepath.kernels.attention import LaunchPlan, paged_attention

#: Rows of vllm-ascend's ``query_start_loc`` buffer beyond ``max_num_seqs`` (its dummy padding request).
EXTRA_ROWS = 2
#: The attribute of an ``AscendMetadata`` that carries samepath's graph inputs for that step.
ATTRIBUTE = "_samepath_graph_inputs"


@dataclasses.dataclass
class GraphInputs:
    """Persistent fixed-size attention metadata on one device (see the module docstring).

    ``query_start_loc`` ``[rows + 1]`` and ``seq_lens`` ``[rows]`` are views of one int32 buffer that
    :meth:`fill` writes with one copy; ``block_table`` ``[rows, max_blocks]``.
    """

    packed: torch.Tensor
    block_table: torch.Tensor
    rows: int
    #: Views of ``packed``, made once (a launch plan is tied to the very tensor it was built from).
    query_start_loc: torch.Tensor = dataclasses.field(init=False)
    seq_lens: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.query_start_loc = self.packed[: self.rows + 1]
        self.seq_lens = self.packed[self.rows + 1 :]

    @classmethod
    def allocate(cls, rows: int, max_blocks: int, device: torch.device, block_dtype: torch.dtype) -> GraphInputs:
        if rows <= 0 or max_blocks <= 0:
            raise ValueError(f"rows = {rows} and max_blocks = {max_blocks} must be positive")
        packed = torch.zeros(2 * rows + 1, dtype=torch.int32, device=device)
        block_table = torch.zeros(rows, max_blocks, dtype=block_dtype, device=device)
        return cls(packed, block_table, rows)

    def fill(self, starts: list[int], seq_lens: list[int], block_tables: torch.Tensor) -> None:
        """One step's metadata into the buffers: the real requests' query starts (``[num_seqs + 1]``) and KV
        lengths, then requests without tokens up to ``rows``; the block table's first ``num_seqs`` rows.
        Asynchronous (one host-to-device copy, one device copy); reads nothing from the device.

        Raises:
            ValueError: more requests than ``rows`` or a wider block table than the buffer (named).
        """
        num_seqs = len(starts) - 1
        if num_seqs > self.rows or len(seq_lens) != num_seqs:
            raise ValueError(
                f"graph inputs: {num_seqs} requests ({len(seq_lens)} seq_lens) do not fit {self.rows} rows "
                "(max_num_seqs + 2)"
            )
        if block_tables.shape[0] < num_seqs or block_tables.shape[1] > self.block_table.shape[1]:
            raise ValueError(
                f"attn_metadata.block_tables {tuple(block_tables.shape)} does not fit the graph buffer "
                f"{tuple(self.block_table.shape)} for {num_seqs} requests"
            )
        end = starts[-1]
        values = [*starts, *([end] * (self.rows - num_seqs)), *seq_lens, *([0] * (self.rows - num_seqs))]
        staging = torch.tensor(values, dtype=torch.int32)
        if self.packed.device.type != "cpu":
            # A fresh pinned block per step, as vllm-ascend's own build does: the caching host allocator
            # hands it out again only once this copy has run, so the next step cannot overwrite it early.
            staging = staging.pin_memory()
        self.packed.copy_(staging, non_blocking=True)
        if num_seqs:
            self.block_table[:num_seqs, : block_tables.shape[1]].copy_(block_tables[:num_seqs], non_blocking=True)


#: The builders whose graph buffers this process allocated (:func:`reset` forgets them).
_owners: list[Any] = []
_lock = threading.Lock()
#: The attribute of a metadata builder that holds its :class:`GraphInputs`.
BUFFERS = "_samepath_graph_buffers"


def graph_buffers(builder: Any, device: torch.device, block_dtype: torch.dtype) -> GraphInputs:
    """The builder's :class:`GraphInputs`, allocated at its first step from the engine's limits
    (``max_num_seqs + 2`` rows, ``max_num_blocks_per_req`` blocks) and never reallocated: captured graphs
    keep reading these addresses. One set per builder (per KV-cache group), so two groups' block tables do
    not share a buffer.

    Raises:
        ValueError: a limit is missing (named), or a later step's block table has another device or dtype.
    """
    with _lock:
        buffers = getattr(builder, BUFFERS, None)
        if buffers is None:
            rows, max_blocks = _limits(builder)
            buffers = GraphInputs.allocate(rows, max_blocks, torch.device(device), block_dtype)
            setattr(builder, BUFFERS, buffers)
            _owners.append(builder)
        elif buffers.block_table.device != torch.device(device) or buffers.block_table.dtype != block_dtype:
            raise ValueError(
                f"attn_metadata.block_tables is {block_dtype} on {device}, but the graph buffers (never "
                f"reallocated: captured graphs read them) hold {buffers.block_table.dtype} on "
                f"{buffers.block_table.device}"
            )
        return buffers


def graph_mode(vllm_config: Any) -> bool:
    """Whether vLLM may capture ACL graphs in this engine (``enforce_eager`` off, a cudagraph mode set)."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None or getattr(model_config, "enforce_eager", True):
        return False
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    return mode is not None and getattr(mode, "name", str(mode)) != "NONE"


def compiled_mode(vllm_config: Any) -> str | None:
    """The torch.compile mode vLLM would run (``None`` for ``NONE`` / eager)."""
    mode = getattr(getattr(vllm_config, "compilation_config", None), "mode", None)
    if mode is None:
        return None
    name = getattr(mode, "name", str(mode))
    return None if name in ("NONE", "0") else name


def _host_starts(attn_metadata: Any, common: Any) -> list[int] | None:
    ends = getattr(attn_metadata, "actual_seq_lengths_q", None)
    if ends is not None:
        return [0, *host_ints(ends, "actual_seq_lengths_q", host_only=True)]
    cpu = getattr(common, "query_start_loc_cpu", None)
    if cpu is not None:
        return host_ints(cpu[: int(common.num_reqs) + 1], "query_start_loc_cpu", host_only=True)
    return None


def _limits(builder: Any) -> tuple[int, int]:
    """``(rows, max_blocks)`` of the graph buffers, from the engine's limits (never from one step's metadata)."""
    scheduler = getattr(getattr(builder, "vllm_config", None), "scheduler_config", None)
    max_seqs = getattr(scheduler, "max_num_seqs", None)
    if not isinstance(max_seqs, int) or max_seqs <= 0:
        raise ValueError(
            f"ACL graph mode needs the builder's vllm_config.scheduler_config.max_num_seqs (got {max_seqs!r}) "
            "to size samepath's graph buffers"
        )
    max_blocks = getattr(builder, "max_num_blocks_per_req", None)
    if not isinstance(max_blocks, int) or max_blocks <= 0:
        raise ValueError(
            f"ACL graph mode needs the builder's max_num_blocks_per_req (got {max_blocks!r}) to size samepath's "
            "graph block table"
        )
    return max_seqs + EXTRA_ROWS, max_blocks


def attach(builder: Any, attn_metadata: Any, common: Any) -> GraphInputs:
    """Fill the builder's buffers (:func:`graph_buffers`) from one step's metadata and attach them
    (``ATTRIBUTE``).

    The buffers are sized once from the engine's limits (``max_num_seqs + 2`` rows,
    ``max_num_blocks_per_req`` blocks) and never reallocated: a step that does not fit is refused. The real
    requests and their lengths come from :func:`.metadata.host_layout` (the eager path's checks) on host
    values only: ``actual_seq_lengths_q`` or the common metadata's ``query_start_loc_cpu``, and
    ``seq_lens_list`` / ``seq_lens_cpu``; a device tensor in their place is refused by name.

    Raises:
        ValueError: inconsistent metadata, a missing limit, more requests than the buffers' rows or a device
            tensor where a host value is needed (named), or no host-side query starts.
    """
    starts = _host_starts(attn_metadata, common)
    if starts is None:
        raise ValueError("graph inputs need host-side query starts (actual_seq_lengths_q or query_start_loc_cpu)")
    layout = host_layout(attn_metadata, starts=starts, host_only=True)
    block_tables = attn_metadata.block_tables
    buffers = graph_buffers(builder, block_tables.device, block_tables.dtype)
    if layout.num_seqs > buffers.rows - EXTRA_ROWS:
        raise ValueError(
            f"attn_metadata: {layout.num_seqs} requests exceed the graph buffers' max_num_seqs = "
            f"{buffers.rows - EXTRA_ROWS}"
        )
    buffers.fill(layout.starts[: layout.num_seqs + 1], layout.seq_lens, block_tables)
    setattr(attn_metadata, ATTRIBUTE, buffers)
    attn_metadata._samepath_graph_causal = layout.causal
    return buffers


def make_build(owner: type) -> Any:
    """``AscendAttentionMetadataBuilder.build`` that, when the engine may capture ACL graphs, also fills
    samepath's graph buffers (:func:`attach`) after vllm-ascend's own build."""
    from samepath.integrations.vllm_ascend.state import original

    def build(self: Any, *args: Any, **kwargs: Any) -> Any:
        attn_metadata = original(owner, "build")(self, *args, **kwargs)
        if graph_mode(getattr(self, "vllm_config", None)):
            common = kwargs.get("common_attn_metadata", args[1] if len(args) > 1 else None)
            attach(self, attn_metadata, common)
        return attn_metadata

    return build


def update_graph_params(*args: Any, **kwargs: Any) -> None:
    """vllm-ascend's ``update_graph_params`` with samepath's attention: nothing to update (see the module)."""


#: One plan per (metadata object, capturing) for the layers of a step; the last few objects only.
_plans: list[tuple[Any, bool, LaunchPlan]] = []


def _plan(attn_metadata: Any, buffers: GraphInputs, num_tokens: int, capturing: bool) -> LaunchPlan:
    with _lock:
        for owner, captured, plan in _plans:
            if owner is attn_metadata and captured == capturing and plan.num_tokens == num_tokens:
                return plan
    plan = LaunchPlan(buffers.query_start_loc, num_tokens)
    with _lock:
        _plans.append((attn_metadata, capturing, plan))
        del _plans[:-4]
    return plan


def graph_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    attn_metadata: Any,
    scale: float,
    output: torch.Tensor,
    *,
    sliding_window: int | None = None,
    capturing: bool = True,
) -> torch.Tensor:
    """The attention of one layer in graph mode: :func:`samepath.paged_attention` over every row of
    ``query`` (``[tokens, num_heads, head_size]``, the padded batch) with the graph buffers attached to
    ``attn_metadata`` as its metadata, written into ``output`` (the rows of no request — vllm-ascend's
    padding, trimmed downstream — hold no meaningful values).
    Reads nothing from the device and builds nothing from a host value.

    Raises:
        RuntimeError: the metadata carries no graph inputs (the builder hook did not run: the engine was
            not configured for ACL graphs when the step was built).
    """
    buffers = getattr(attn_metadata, ATTRIBUTE, None)
    if buffers is None:
        raise RuntimeError(
            "samepath's vllm-ascend attention is captured in an ACL graph, but this step's metadata carries no "
            "graph inputs (samepath's AscendAttentionMetadataBuilder.build hook did not fill them: is the "
            "engine configured with enforce_eager=False and a cudagraph_mode?)"
        )
    num_tokens, num_heads, head_size = output.shape
    causal = bool(getattr(attn_metadata, "_samepath_graph_causal", True))
    paged_attention(
        query[:num_tokens].reshape(num_tokens, num_heads, head_size),
        key_cache,
        value_cache,
        buffers.block_table,
        buffers.query_start_loc,
        buffers.seq_lens,
        scale,
        causal=causal,
        sliding_window=sliding_window if causal else None,
        out=output,
        validate=False,
        plan=_plan(attn_metadata, buffers, num_tokens, capturing),
    )
    return output


def reset() -> None:
    """Forget the buffers and plans (tests; a process that captured graphs must not call it)."""
    with _lock:
        for owner in _owners:
            delattr(owner, BUFFERS)
        _owners.clear()
        _plans.clear()


__all__ = [
    "ATTRIBUTE",
    "BUFFERS",
    "EXTRA_ROWS",
    "GraphInputs",
    "attach",
    "compiled_mode",
    "graph_buffers",
    "graph_mode",
    "graph_paged_attention",
    "make_build",
    "reset",
    "update_graph_params",
]
