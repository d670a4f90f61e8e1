"""The README's Use snippet run from a folder that holds a clone named ``samepath``.

``import samepath`` there finds the clone (no ``__init__.py`` at its top: a namespace package).
samepath's own editable install is a plain ``sys.path`` entry, which beats such a folder; an
editable install made with setuptools' import finder (samepath's install before it set its package
root) loses to it, and samepath then refuses with an ImportError naming the folder instead of
``AttributeError: module 'samepath' has no attribute 'logprobs'``.

Each case builds the editable wheel pip would install (setuptools' PEP 660 hook) from a copy of
this project in a temporary folder, and runs a script beside that copy in a fresh interpreter.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the Use snippet imports transformers (pip install -e .[hf])")

ROOT = Path(__file__).resolve().parent.parent

# Runs in the child. The parent's environment may hold samepath's development install already (an
# editable finder, or a path entry holding samepath/__init__.py): both are removed so that the wheel
# built here is the only install.
DRIVER = """\
import sys
from pathlib import Path

sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable___samepath")]
sys.path[:] = [p for p in sys.path if not (Path(p or ".") / "samepath" / "__init__.py").is_file()]
site = Path(sys.argv[1])
for pth in site.glob("*.pth"):
    for line in pth.read_text().splitlines():
        if line.startswith("import "):  # setuptools' finder: run its install() from the copy
            (finder,) = site.glob("__editable___*_finder.py")
            namespace = {"__name__": "editable_finder_under_test"}
            exec(compile(finder.read_text(), str(finder), "exec"), namespace)
            namespace["install"]()
        elif line.strip():
            sys.path.append(line.strip())
"""


def _use_imports() -> str:
    """The import lines of the README's Use snippet, as a user pastes them."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Use\n") :]
    snippet = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    lines = [line for line in snippet.splitlines() if line.startswith(("import ", "from "))]
    assert "import samepath" in lines
    return "\n".join(lines)


def _install_beside_clone(tmp_path: Path, *, finder: bool) -> Path:
    """A clone-shaped folder ``tmp_path/samepath`` (pyproject, README, the package) and its editable
    install in ``tmp_path/site``; with ``finder``, as setuptools installs it without a package root."""
    clone = tmp_path / "samepath"
    clone.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, clone / name)
    shutil.copytree(ROOT / "samepath", clone / "samepath", ignore=shutil.ignore_patterns("__pycache__"))
    (clone / "tests").mkdir()
    if finder:
        pyproject = (clone / "pyproject.toml").read_text()
        pyproject = re.sub(r'\npackage-dir = \{"" = "\."\}\n', "\n", pyproject)
        assert "package-dir" not in pyproject
        (clone / "pyproject.toml").write_text(pyproject)
    hook = f"from setuptools import build_meta; print(build_meta.build_editable({str(tmp_path / 'dist')!r}))"
    build = subprocess.run(
        [sys.executable, "-c", hook],
        cwd=clone,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    wheel = tmp_path / "dist" / build.stdout.strip().splitlines()[-1]
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    return site


def _run_beside_clone(tmp_path: Path, site: Path, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "use.py"  # beside the clone: the script's folder is sys.path[0]
    script.write_text(DRIVER + _use_imports() + "\n" + body)
    return subprocess.run(
        [sys.executable, str(script), str(site)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )


def test_the_use_snippet_beside_a_clone_imports_the_install(tmp_path: Path) -> None:
    site = _install_beside_clone(tmp_path, finder=False)
    assert not list(site.glob("__editable___*_finder.py")), "the editable install is an import finder"
    body = "print(samepath.__file__)\nassert callable(samepath.logprobs) and callable(integrations.patch_all)\n"
    result = _run_beside_clone(tmp_path, site, body)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == str(tmp_path / "samepath" / "samepath" / "__init__.py")


def test_a_finder_install_shadowed_by_a_clone_is_refused_naming_the_folder(tmp_path: Path) -> None:
    site = _install_beside_clone(tmp_path, finder=True)
    assert list(site.glob("__editable___*_finder.py")), "setuptools made no import finder"
    result = _run_beside_clone(tmp_path, site, "samepath.logprobs\n")
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: `import samepath` found the folder "), result.stderr[-3000:]
    assert str(tmp_path / "samepath") in last
    assert "instead of the installed package" in last and "Run from another directory" in last
    assert "has no attribute" not in result.stderr
