"""The Ascend C FlashAttention backend: the schedules of samepath's Triton attention kernels, hand-written.

Selected with ``SAMEPATH_ATTENTION_BACKEND=ascendc`` (default ``triton``; :mod:`samepath.kernels.attention.backend`),
for NPU tensors. Sources: ``csrc/`` (CMake, needs CANN), built once per machine with
``python -m samepath.ascendc_fallback build`` (:mod:`.build`: build key, cache, loading, the schedule versions
it replays and its fingerprint rows); the launchers over one
:class:`~samepath.kernels.attention.batch.AttentionBatch` (:mod:`.launch`, which registers the backend);
tiling: :mod:`.tiling` and ``csrc/flash_attention_tiling.h``; the kernels' steps replayed in numpy:
:mod:`.replay`.
"""

from samepath.kernels.attention.ascendc import launch  # noqa: F401  (registers the ascendc backend)
