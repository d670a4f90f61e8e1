"""nox sessions: tests, lint, bench. Each installs the CPU build of torch first (see README)."""

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
    session.install(TORCH, "-e", ".")
    session.run("python", "bench/bench_attention.py", *session.posargs)
