"""Extract, from unpacked vllm-ascend releases, the API facts samepath's integration relies on.

Reads the source with :mod:`ast` (nothing is imported: the packages need torch_npu / CANN), and
writes ``tests/fixtures/vllm_ascend_api.json``: per version, per ``module:attribute.path`` what the
tree defines (a class with its bases and fields, a function with its parameter names, an
assignment, an enum member) or ``null`` where it does not. The test suite checks
:mod:`samepath.integrations.vllm_ascend.compat`'s feature detection against these facts, so CI
needs neither the network nor the packages.

Regenerate (PyPI reachable)::

    pip download --no-deps vllm-ascend==0.18.0 -d /tmp/va/0.18.0   # a wheel: unzip it
    pip download --no-deps vllm-ascend==0.23.0 -d /tmp/va/0.23.0
    # 0.23.0.post1 is an sdist only (its build needs triton-ascend): fetch and untar it
    python -m bench.vllm_ascend_api 0.18.0=/tmp/va/0.18.0 0.23.0=/tmp/va/0.23.0 \
        0.23.0.post1=/tmp/va/vllm_ascend-0.23.0.post1

Each ``VERSION=DIR`` names a directory that holds the ``vllm_ascend`` package.

On a machine with vllm-ascend installed (``bench/npu_check.sh``'s setup stage)::

    python -m bench.vllm_ascend_api --installed --out OUT/vllm_ascend.json [--dry-run]

imports it, runs samepath's gate (``check_compatibility``) and ``detect_features`` on the real
modules, and compares the installed source's facts with the fixture's for that version.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path
from typing import Any

#: ``module: [attribute path, ...]`` recorded per version (the union of what compat.py may look for).
QUERIES: dict[str, tuple[str, ...]] = {
    "vllm_ascend.attention.attention_v1": (
        "AscendAttentionBackendImpl",
        "AscendAttentionBackendImpl.forward_impl",
        "AscendAttentionBackendImpl.forward",
        "AscendAttentionBackendImpl.reshape_and_cache",
        "AscendAttentionState",
        "AscendAttentionState.PrefillNoCache",
        "AscendAttentionState.PrefillCacheHit",
        "AscendAttentionState.DecodeOnly",
        "AscendAttentionState.ChunkedPrefill",
        "AscendAttentionState.SpecDecoding",
        "AscendMetadata",
        "record_attention_compute_start",
        "AscendAttentionMetadataBuilder",
        "AscendAttentionMetadataBuilder.build",
        "AscendAttentionMetadataBuilder.build_for_graph_capture",
        "AscendAttentionBackendImpl.update_graph_params",
    ),
    "vllm_ascend.attention.fa3_v1": ("AscendFAImpl", "AscendFAImpl.forward_impl"),
    "vllm_ascend.ascend_forward_context": (
        "_EXTRA_CTX",
        "select_moe_comm_method",
        "MoECommType",
        "MoECommType.ALLGATHER",
    ),
    "vllm_ascend.ops.layernorm": ("AscendRMSNorm", "AscendRMSNorm.forward_oot"),
    "vllm_ascend.utils": ("get_weight_prefetch_method",),
    "vllm_ascend.ops.activation": ("AscendSiluAndMul", "AscendSiluAndMul.forward_oot"),
    "vllm_ascend.ops.rotary_embedding": ("AscendRotaryEmbedding", "AscendRotaryEmbedding.forward_oot"),
    "vllm_ascend.ops.linear": (
        "AscendUnquantizedLinearMethod",
        "AscendUnquantizedLinearMethod.process_weights_after_loading",
        "AscendUnquantizedLinearMethod.apply",
    ),
    "vllm_ascend.ops.fused_moe.fused_moe": (
        "AscendUnquantizedFusedMoEMethod",
        "AscendUnquantizedFusedMoEMethod.process_weights_after_loading",
        "AscendUnquantizedFusedMoEMethod.apply",
    ),
    "vllm_ascend.ops.fused_moe.moe_comm_method": ("FusedExpertsResult",),
    "vllm_ascend.sample.sampler": (
        "AscendSampler",
        "AscendSampler.__init__",
        "AscendSampler.apply_penalties",
        "AscendTopKTopPSampler",
        "AscendTopKTopPSampler.__init__",
        "apply_top_k_top_p",
    ),
    "vllm_ascend.envs": ("env_variables",),
}


def _module_file(root: Path, module: str) -> Path | None:
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _params(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args)]
    if args.vararg:
        names.append("*" + args.vararg.arg)
    names += [a.arg for a in args.kwonlyargs]
    if args.kwarg:
        names.append("**" + args.kwarg.arg)
    return names


def _fact(node: ast.AST) -> dict[str, Any]:
    if isinstance(node, ast.ClassDef):
        fields = [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
        return {"kind": "class", "bases": [ast.unparse(b) for b in node.bases], "fields": fields}
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return {"kind": "function", "params": _params(node)}
    if isinstance(node, ast.Assign | ast.AnnAssign):
        value = node.value
        if isinstance(value, ast.Dict):
            keys = [k.value for k in value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
            return {"kind": "assign", "keys": keys}
        return {"kind": "assign"}
    return {"kind": type(node).__name__}


def _defined(body: list[ast.stmt], name: str) -> ast.AST | None:
    """The last top-level definition of ``name`` in ``body`` (also inside ``if``/``try`` blocks)."""
    found = None
    for stmt in body:
        if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
            found = stmt
        elif isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
            found = stmt
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == name:
            found = stmt
        elif isinstance(stmt, (ast.ImportFrom, ast.Import)) and any(
            (a.asname or a.name.split(".")[0]) == name for a in stmt.names
        ):
            found = stmt
        elif isinstance(stmt, (ast.If, ast.Try)):
            inner = _defined([*stmt.body, *getattr(stmt, "orelse", [])], name)
            found = inner or found
    return found


def lookup(root: Path, module: str, path: str) -> dict[str, Any] | None:
    file = _module_file(root, module)
    if file is None:
        return None
    node: ast.AST | None = ast.parse(file.read_text(encoding="utf-8"))
    for part in path.split("."):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            return None
        node = _defined(body, part)
        if node is None:
            return None
    fact = _fact(node)
    fact["file"] = str(file.relative_to(root))
    return fact


def extract(root: Path) -> dict[str, dict[str, Any] | None]:
    return {f"{module}:{path}": lookup(root, module, path) for module, paths in QUERIES.items() for path in paths}


FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "vllm_ascend_api.json"


def check_installed(out: Path | None, dry_run: bool = False) -> int:
    """The installed vllm-ascend through samepath's gate and against the fixture (see the module
    docstring); writes ``out`` (JSON) and returns 0 unless the gate ran and refused."""
    from samepath.integrations.vllm_ascend import compat

    fixture = json.loads(FIXTURE.read_text())["versions"]
    if dry_run:
        print(f"would import vllm_ascend, run the gate and compare with {len(fixture)} fixture versions ({out})")
        return 0
    result: dict[str, Any] = {"version": compat.installed_version()}
    try:
        import vllm_ascend
    except Exception as exc:  # torch_npu / CANN missing, or vllm-ascend not installed
        result["importable"] = f"{type(exc).__name__}: {exc}"
    else:
        result["importable"] = True
        facts = extract(Path(vllm_ascend.__file__).resolve().parent.parent)
        expected = fixture.get(str(result["version"]))
        result["fixture_differs"] = (
            None if expected is None else sorted(k for k in facts if facts.get(k) != expected.get(k))
        )
        result["features"] = sorted(compat.detect_features())
        try:
            compat.check_compatibility(result["version"])
            result["gate"] = "accepted"
        except compat.UnsupportedVllmAscendError as exc:
            result["gate"] = f"refused: {exc}"
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if out is not None:
        out.write_text(text + "\n")
    return 1 if str(result.get("gate", "")).startswith("refused") else 0


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--installed":
        out = Path(argv[argv.index("--out") + 1]) if "--out" in argv else None
        return check_installed(out, dry_run="--dry-run" in argv)
    out = FIXTURE
    versions = {}
    for spec in argv:
        version, _, directory = spec.partition("=")
        root = Path(directory)
        if not (root / "vllm_ascend").is_dir():
            raise SystemExit(f"{directory} holds no vllm_ascend package")
        versions[version] = extract(root)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"generator": "python -m bench.vllm_ascend_api", "versions": versions}, indent=1, sort_keys=True)
        + "\n"
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
