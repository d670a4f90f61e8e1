"""The Ascend C attention's build and loading, and the schedule versions it replays.

``python -m samepath.ascendc_fallback build`` (or ``python -m samepath.kernels.attention.ascendc build``)
compiles the library once per machine into a cache directory keyed on the sources' hash, the SoC (read
from the device), the CANN version and the torch / torch_npu versions, under a file lock, so concurrent
processes (vLLM workers, trainer ranks) build it once. :func:`load` never runs CMake unless
``SAMEPATH_ASCENDC_ALLOW_BUILD=1``: a worker that finds no library for its key raises, naming the build
command and the key.

The backend is its own numerics: its instructions (exp2 as ``exp(x ln 2)``, the cube's accumulation,
hardware row reductions) are not Triton-Ascend's, so trainer and rollout must both run it or both not.
:func:`fingerprint` is what ``samepath.fingerprint()`` hashes about it, and :func:`check_schedule` /
:func:`check_backward_schedule` refuse to run once the Triton kernels moved past the schedules
``csrc/`` replays.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from samepath.kernels import config
from samepath.kernels.attention.backend import BACKEND_ENV

#: Root of the build cache (one subdirectory per build key); default ``~/.cache/samepath/ascendc``.
BUILD_DIR_ENV = "SAMEPATH_ASCENDC_BUILD_DIR"
#: Overrides the SoC read from the device (``torch.npu.get_device_name()``), e.g. ``Ascend910B3``.
SOC_VERSION_ENV = "SAMEPATH_ASCENDC_SOC_VERSION"
#: ``1``: :func:`load` may run the CMake build itself when the library for its key is missing.
ALLOW_BUILD_ENV = "SAMEPATH_ASCENDC_ALLOW_BUILD"
BUILD_COMMAND = "python -m samepath.ascendc_fallback build"
LIBRARY_NAME = "libsamepath_ascendc.so"
SOURCE_DIR = Path(__file__).resolve().parent / "csrc"

#: How the Ascend C kernel computes, where it differs in form from ``config.ATTENTION_FORMULA``.
ASCENDC_ATTENTION_FORMULA = {
    "exp2": "exp(x * ln2) in fp32 (Muls then Exp: Ascend C has no exp2)",
    "accumulator": "acc * exp2(m_old - m_new) in fp32, then + fp32 dot(P, V) from the cube",
    "dots": "cube matmuls through the Ascend C Matmul API, fp32 output",
    "log2": "AscendC::Log2",
    "row_reductions": "WholeReduceMax / WholeReduceSum over one tile row",
    "segment_merge": "m = max(m_r, m_s); l_r * exp2(m_r - m) + l_s * exp2(m_s - m), acc likewise; "
    "rows with m_s = -inf keep their state",
}

#: The samepath numerics version whose Triton forward schedule the Ascend C forward replays, and the
#: versions whose forward is that schedule (versions 3 and 4 changed only the backward and CUDA's tiles,
#: version 5 only RMSNorm's and the fused lm_head's weight gradients).
ASCENDC_SCHEDULE_VERSION = 2
FORWARD_SCHEDULE_VERSIONS = (2, 3, 4, 5)
#: The numerics version whose Triton backward schedule (``_attention_bwd_kernel``, one pass per KV tile) the
#: Ascend C backward replays (``replay.simulate_backward``); any other version is refused for training
#: (:func:`check_backward_schedule`) until the new schedule is ported. Version 4 kept version 3's schedule
#: and sums (its key-major dots multiply and add the same elements; ``replay.simulate_backward`` still
#: equals the Triton backward bit for bit) and moved ``delta`` into the backward's preprocessing kernel,
#: whose formula the Ascend C backward computes itself (``RowDelta``, per query tile: it takes ``out``, not a
#: ``delta`` tensor, so it runs no Triton-Ascend kernel). Version 5 changed no attention bits (RMSNorm's and
#: the fused lm_head's weight gradients only), so both versions' backward is this schedule.
ASCENDC_BACKWARD_SCHEDULE_VERSION = 5
BACKWARD_SCHEDULE_VERSIONS = (4, 5)
ASCENDC_SCHEDULE = (
    "v2: GQA-packed query tiles (head_chunk = min(group, block_m)), tile_n KV tiles and seg KV segments "
    "anchored at 0, segments merged in ascending order, serial per work item"
)

ASCENDC_BACKWARD_SCHEDULE = (
    "ascendc-fa-bwd-4 (numerics v4 one pass, standing alone): one item per KV tile of bwd_block_n keys and KV head, "
    "items round-robin over vector cores in ascending order; each visits its GQA-packed query tiles (bwd_block_m "
    "rows, head chunks in order, query blocks ascending); per tile delta = 0 + ReduceSum(fp32(dO) * fp32(O)) over "
    "each packed row zero-padded to the power-of-two head (the formula of attention.backward.backward_delta, "
    "computed in Ascend C); P = where(visible, exp2(S * qk_scale - lse), 0), "
    "dV += cast(P)^T dO, dS = cast(P * (dP - delta)), dK += dS^T Q in fp32 by a vector Add; dQ partials dS K added "
    "to fp32 row sums in ascending KV-tile order under one turn counter per packed query tile (no atomics)"
)

_lock = threading.Lock()
_loaded_path: Path | None = None


def fingerprint() -> dict[str, object]:
    """What ``samepath.fingerprint()`` hashes about this backend when it is selected."""
    return {
        "name": "ascendc",
        "formula": ASCENDC_ATTENTION_FORMULA,
        "numerics": "ascendc-fa-fwd-2",
        "schedule": ASCENDC_SCHEDULE,
        "backward": ASCENDC_BACKWARD_SCHEDULE,
        "backward_numerics_version": ASCENDC_BACKWARD_SCHEDULE_VERSION,
    }


def build_root() -> Path:
    """Root of the build cache (``SAMEPATH_ASCENDC_BUILD_DIR``, default ``~/.cache/samepath/ascendc``)."""
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


def check_schedule(numerics_version: int | None = None) -> None:
    """Fail closed when the Triton forward's schedule moved past the one the Ascend C forward replays.

    Raises:
        RuntimeError: ``config.NUMERICS_VERSION`` (or ``numerics_version``) is not one of
            :data:`FORWARD_SCHEDULE_VERSIONS`.
    """
    if numerics_version is None:
        numerics_version = config.NUMERICS_VERSION
    if numerics_version not in FORWARD_SCHEDULE_VERSIONS:
        raise RuntimeError(
            f"{BACKEND_ENV}=ascendc: the Ascend C kernel replays the schedule of samepath numerics version "
            f"{ASCENDC_SCHEDULE_VERSION} ({ASCENDC_SCHEDULE}), but the Triton kernels are at version "
            f"{numerics_version}: port the new schedule to csrc/ and prove it with ascendc/replay.py "
            "(tests/test_ascendc_fallback.py) before using this backend"
        )


@dataclass(frozen=True)
class BuildKey:
    """Everything a built library depends on: a different value of any field is a different build."""

    soc: str
    cann: str
    torch_npu: str
    torch: str
    sources: str

    def digest(self) -> str:
        """The key's short hash: the name of its directory in the build cache."""
        payload = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:20]

    def describe(self) -> str:
        return (
            f"SoC {self.soc}, CANN {self.cann}, torch_npu {self.torch_npu}, torch {self.torch}, "
            f"sources {self.sources[:12]}"
        )


def source_digest(directory: Path = SOURCE_DIR) -> str:
    """sha256 over the names and bytes of the kernel sources (``csrc/``), in name order."""
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.iterdir() if p.is_file()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def cann_version(home: str | None = None) -> str:
    """The CANN toolkit version under ``home`` (``ASCEND_HOME_PATH``), read from its version files.

    Falls back to ``unknown@<resolved path>`` (still a different key for a different install).

    Raises:
        RuntimeError: ``home`` is unset or not a directory.
    """
    home = home or os.environ.get("ASCEND_HOME_PATH")
    if not home or not Path(home).is_dir():
        raise RuntimeError("CANN is not set up: ASCEND_HOME_PATH is unset or not a directory (source set_env.sh)")
    root = Path(home).resolve()
    candidates = [root / "version.cfg", *sorted(root.glob("*-linux/ascend_toolkit_install.info"))]
    candidates += [root / "compiler" / "version.info", root / "runtime" / "version.info"]
    for path in candidates:
        if not path.is_file():
            continue
        for line in path.read_text(errors="replace").splitlines():
            name, _, value = line.partition("=")
            if name.strip().lower() in ("version", "toolkit_installed_version", "version_dir") and value.strip():
                return value.strip().strip("[]:")
    return f"unknown@{root}"


def detect_soc() -> str:
    """The SoC to compile for: ``SAMEPATH_ASCENDC_SOC_VERSION``, else ``torch.npu.get_device_name()``.

    Raises:
        RuntimeError: neither is available (no override, and torch_npu or an NPU is missing).
    """
    override = os.environ.get(SOC_VERSION_ENV, "").strip()
    if override:
        return override
    reasons = missing_requirements()
    if reasons:
        raise RuntimeError(
            f"cannot read the SoC from the device ({'; '.join(reasons)}); set {SOC_VERSION_ENV} to build anyway"
        )
    name = str(torch.npu.get_device_name(torch.npu.current_device())).strip()
    if not name.startswith("Ascend"):
        raise RuntimeError(f"torch.npu.get_device_name() returned {name!r}, not an Ascend SoC; set {SOC_VERSION_ENV}")
    return name


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not-installed"


def current_build_key(soc: str | None = None) -> BuildKey:
    """The build key of this process: SoC (``soc`` or :func:`detect_soc`), CANN, torch_npu, torch, sources."""
    return BuildKey(
        soc=soc or detect_soc(),
        cann=cann_version(),
        torch_npu=_package_version("torch_npu"),
        torch=torch.__version__,
        sources=source_digest(),
    )


def library_path(key: BuildKey, root: Path | None = None) -> Path:
    """Where the library built for ``key`` lives."""
    return (root or build_root()) / key.digest() / LIBRARY_NAME


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive ``fcntl.flock`` on ``path`` (created if needed), held across processes until exit."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


#: ``builder(directory, key)`` writes ``directory / LIBRARY_NAME``.
Builder = Callable[[Path, BuildKey], None]


def cmake_build(directory: Path, key: BuildKey) -> None:
    """Configure and build ``csrc/`` with CMake for ``key.soc`` into ``directory``.

    Raises:
        RuntimeError: cmake is missing or a step fails (with the end of its output).
    """
    cmake = shutil.which("cmake")
    if cmake is None:
        raise RuntimeError(f"building {LIBRARY_NAME} needs cmake on PATH")
    build = directory / "build"
    jobs = str(os.cpu_count() or 1)
    for command in (
        [cmake, "-S", str(SOURCE_DIR), "-B", str(build), f"-DSOC_VERSION={key.soc}", "-DCMAKE_BUILD_TYPE=Release"],
        [cmake, "--build", str(build), "-j", jobs],
    ):
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(
                f"building the Ascend C attention failed ({' '.join(command)}):\n"
                f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
            )
    shutil.copy2(build / LIBRARY_NAME, directory / LIBRARY_NAME)


def ensure_library(
    key: BuildKey, *, allow_build: bool, root: Path | None = None, builder: Builder | None = None
) -> Path:
    """The library for ``key``, building it first (once, under a cross-process lock) when allowed.

    A build runs in a temporary directory beside the cache entry and is renamed into place only when
    it succeeded, so a reader sees a complete library or none.

    Raises:
        RuntimeError: the library is missing and ``allow_build`` is False (names the build command
            and the key), or the build failed.
    """
    root = root or build_root()
    path = library_path(key, root)
    if path.is_file():
        return path
    with file_lock(root / f"{key.digest()}.lock"):
        if path.is_file():
            return path
        if not allow_build:
            raise RuntimeError(
                f"{BACKEND_ENV}=ascendc: {LIBRARY_NAME} is not built for this machine ({key.describe()}; "
                f"expected {path}). Run `{BUILD_COMMAND}` once before starting workers, or set "
                f"{ALLOW_BUILD_ENV}=1 to let this process build it (minutes, with CMake and CANN)."
            )
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"{key.digest()}.", dir=root))
        try:
            (builder or cmake_build)(staging, key)
            if not (staging / LIBRARY_NAME).is_file():
                raise RuntimeError(f"the build wrote no {LIBRARY_NAME} in {staging}")
            (staging / "build_key.json").write_text(json.dumps(dataclasses.asdict(key), indent=1, sort_keys=True))
            shutil.rmtree(path.parent, ignore_errors=True)  # an entry without a library is incomplete
            os.replace(staging, path.parent)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return path


def check_backward_schedule(numerics_version: int | None = None) -> None:
    """Fail closed when the Triton backward's schedule is not the one the Ascend C backward replays.

    Raises:
        RuntimeError: ``config.NUMERICS_VERSION`` (or ``numerics_version``) is not one of
            :data:`BACKWARD_SCHEDULE_VERSIONS` (numerics 4's one-pass key-major backward).
    """
    if numerics_version is None:
        numerics_version = config.NUMERICS_VERSION
    if numerics_version not in BACKWARD_SCHEDULE_VERSIONS:
        raise RuntimeError(
            f"{BACKEND_ENV}=ascendc: the Ascend C backward replays the backward of samepath numerics version "
            f"{ASCENDC_BACKWARD_SCHEDULE_VERSION} ({ASCENDC_BACKWARD_SCHEDULE}), but the Triton backward is at "
            f"version {numerics_version}: training on this backend is refused until csrc/flash_attention_bwd.cpp "
            "is ported to that schedule and replayed by ascendc/replay.py. The Ascend C forward (rollout, no-grad "
            f"passes) is unaffected; unset {BACKEND_ENV} to train with the Triton kernels"
        )


def build(soc: str | None = None, *, root: Path | None = None, builder: Builder | None = None) -> Path:
    """``python -m samepath.ascendc_fallback build``: the library for this machine, built if missing."""
    check_schedule()
    return ensure_library(current_build_key(soc), allow_build=True, root=root, builder=builder)


def load() -> Path:
    """Load the ``samepath_ascendc`` torch operators built for this machine's key.

    Returns the library's path. Raises ``RuntimeError`` naming what is missing (CANN, torch_npu, an
    NPU, the built library and the command that builds it); it never falls back to the Triton kernel.
    """
    global _loaded_path
    with _lock:
        if _loaded_path is not None:
            return _loaded_path
        reasons = missing_requirements()
        if reasons:
            raise RuntimeError(f"{BACKEND_ENV}=ascendc needs CANN, torch_npu and an Ascend NPU: " + "; ".join(reasons))
        check_schedule()
        allow = os.environ.get(ALLOW_BUILD_ENV, "").strip() == "1"
        path = ensure_library(current_build_key(), allow_build=allow)
        torch.ops.load_library(str(path))
        _loaded_path = path
        return path
