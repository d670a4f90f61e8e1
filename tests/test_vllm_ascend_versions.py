"""samepath's vllm-ascend gate and patch-point detection against each supported release's source.

``tests/fixtures/vllm_ascend_api.json`` holds the facts ``bench/vllm_ascend_api.py`` extracted
with ``ast`` from the published vllm-ascend 0.18.0, 0.23.0 and 0.23.0.post1 (the latest release
when written): the classes, methods with their parameter names, fields and assignments
:mod:`samepath.integrations.vllm_ascend.compat` relies on. The tests rebuild each release's module
tree from those facts (the packages themselves need torch_npu / CANN) and run the real gate on it;
running the patched model needs an NPU and is not done here.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from samepath.integrations.vllm_ascend import compat

FIXTURE = Path(__file__).parent / "fixtures" / "vllm_ascend_api.json"
FACTS: dict[str, dict[str, Any]] = json.loads(FIXTURE.read_text())["versions"]
#: Methods a release inherits from vLLM rather than defining (``(version prefix, key) -> base``).
INHERITED = {("0.18", "vllm_ascend.ops.linear:AscendUnquantizedLinearMethod.apply"): "UnquantizedLinearMethod"}
#: The optional patch points each release has (read in its source).
EXPECTED_FEATURES = {
    "0.18": {"ascend_sampler", "ascend_top_k_top_p", "acl_graph_builder", "acl_graph_params"},
    "0.23": {
        "ascend_sampler", "ascend_top_k_top_p", "fa3_attention", "kv_pool_fence", "acl_graph_builder",
        "acl_graph_params",
    },
}  # fmt: skip


def _function(name: str, params: list[str]) -> Any:
    source = f"def {name}({', '.join(params)}):\n    return 'stock'\n"
    namespace: dict[str, Any] = {}
    exec(source, namespace)
    return namespace[name]


def _tree(version: str, facts: dict[str, Any]) -> dict[str, types.ModuleType]:
    """The modules, classes, methods (with the release's parameter names), fields and assignments
    recorded for ``version``; what it lacks is absent; vLLM's own modules are bare stand-ins."""
    modules: dict[str, types.ModuleType] = {}
    for key, fact in sorted(facts.items(), key=lambda item: item[0].count(".")):
        module_name, _, path = key.partition(":")
        module = modules.setdefault(module_name, types.ModuleType(module_name))
        if fact is None:
            continue
        *owners, attr = path.split(".")
        owner: Any = module
        for name in owners:
            owner = getattr(owner, name)
        if fact["kind"] == "class":
            bases = tuple(type(b.rpartition(".")[2], (), {}) for b in fact["bases"] if b.rpartition(".")[2] != "Enum")
            value: Any = type(attr, bases, {"__module__": module_name})
            if attr == "AscendMetadata":
                value = dataclasses.make_dataclass(attr, [(n, Any, None) for n in fact["fields"]])
        elif fact["kind"] == "function":
            value = _function(attr, fact["params"])
        else:
            value = object()
        setattr(owner, attr, value)
    for (prefix, key), _base in INHERITED.items():
        if version.startswith(prefix):
            module_name, _, path = key.partition(":")
            owner_name, _, attr = path.rpartition(".")
            setattr(getattr(modules[module_name], owner_name), attr, _function(attr, ["self", "layer", "x", "bias"]))
    for module_name, paths in compat.REQUIRED_API.items():
        if module_name.startswith("vllm."):
            module = modules.setdefault(module_name, types.ModuleType(module_name))
            for path in paths:
                owner_name, _, attr = path.partition(".")
                owner = getattr(module, owner_name, None) or type(owner_name, (), {})
                setattr(module, owner_name, owner)
                if attr:
                    setattr(owner, attr, _function(attr, ["self", "*args", "**kwargs"]))
    return modules


def _importer(tree: dict[str, types.ModuleType]):
    def import_module(name: str) -> types.ModuleType:
        if name not in tree:
            raise ImportError(f"No module named {name!r}")
        return tree[name]

    return import_module


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("VLLM_USE_V2_MODEL_RUNNER", "VLLM_BATCH_INVARIANT"):
        monkeypatch.delenv(name, raising=False)


def test_fixture_covers_every_supported_release_and_patch_point() -> None:
    """Each supported major.minor has a release in the fixture, and every vllm-ascend name the gate
    requires was looked up there (the extractor's queries cover REQUIRED_API / REQUIRED_PARAMS /
    OPTIONAL_API)."""
    from bench import vllm_ascend_api as extractor

    queried = {f"{m}:{p}" for m, paths in extractor.QUERIES.items() for p in paths}
    wanted = {f"{m}:{p}" for m, paths in compat.REQUIRED_API.items() if m.startswith("vllm_ascend") for p in paths}
    wanted |= set(compat.REQUIRED_PARAMS) | {f"{m}:{p}" for m, p in compat.OPTIONAL_API.values()}
    assert wanted <= queried, sorted(wanted - queried)
    majors = {tuple(int(x) for x in v.split(".")[:2]) for v in FACTS}
    assert majors == set(compat.SUPPORTED_VERSIONS)


@pytest.mark.parametrize("version", sorted(FACTS))
def test_release_source_has_what_samepath_patches(version: str) -> None:
    """Straight from the extracted facts: every required name, METADATA field and replaced method's
    leading parameters are in the release's source (inherited ones through their vLLM base)."""
    facts = FACTS[version]
    for module_name, paths in compat.REQUIRED_API.items():
        if not module_name.startswith("vllm_ascend"):
            continue
        for path in paths:
            key = f"{module_name}:{path}"
            if facts[key] is None:
                base = INHERITED.get((version[:4], key))
                owner = facts[f"{module_name}:{path.rpartition('.')[0]}"]
                assert base is not None and base in owner["bases"], f"{version}: {key} not in the source"
    metadata = facts[f"{compat.ATTENTION_MODULE}:AscendMetadata"]["fields"]
    assert set(compat.METADATA_FIELDS) <= set(metadata), set(compat.METADATA_FIELDS) - set(metadata)
    for key, expected in compat.REQUIRED_PARAMS.items():
        assert tuple(facts[key]["params"][: len(expected)]) == expected, (version, key, facts[key]["params"])
    # ACL graph mode: the builder hook reads common_attn_metadata where the release's build takes it, and
    # build_for_graph_capture goes through build (so the capture's metadata gets the buffers too).
    build = facts[f"{compat.ATTENTION_MODULE}:AscendAttentionMetadataBuilder.build"]["params"]
    assert tuple(build[: len(compat.GRAPH_BUILD_PARAMS)]) == compat.GRAPH_BUILD_PARAMS, (version, build)
    assert facts[f"{compat.ATTENTION_MODULE}:AscendAttentionMetadataBuilder.build_for_graph_capture"] is not None


@pytest.mark.parametrize("version", sorted(FACTS))
def test_gate_accepts_each_release_and_detects_its_patch_points(version: str) -> None:
    tree = _tree(version, FACTS[version])
    compat.check_compatibility(version, _importer(tree))
    assert compat.detect_features(_importer(tree)) == EXPECTED_FEATURES[version[:4]]


@pytest.mark.parametrize("version", sorted(FACTS))
def test_gate_refuses_a_changed_signature_by_name(version: str) -> None:
    """Negative control: the same tree with ``forward_impl``'s arguments reordered, RMSNorm's
    ``residual`` gone, or the MoE method not derived from vLLM's ``UnquantizedFusedMoEMethod``
    (whose ``process_weights_after_loading`` samepath calls) is refused by name."""
    facts = json.loads(json.dumps(FACTS[version]))
    key = f"{compat.ATTENTION_MODULE}:AscendAttentionBackendImpl.forward_impl"
    facts[key]["params"] = ["self", "query", "key", "value", "attn_metadata", "kv_cache", "output"]
    with pytest.raises(compat.UnsupportedVllmAscendError, match=r"forward_impl\(self, query.*attn_metadata, kv_cache"):
        compat.check_compatibility(version, _importer(_tree(version, facts)))
    facts = json.loads(json.dumps(FACTS[version]))
    facts["vllm_ascend.ops.layernorm:AscendRMSNorm.forward_oot"]["params"] = ["self", "x"]
    with pytest.raises(compat.UnsupportedVllmAscendError, match=r"AscendRMSNorm\.forward_oot\(self, x\)"):
        compat.check_compatibility(version, _importer(_tree(version, facts)))
    facts = json.loads(json.dumps(FACTS[version]))
    facts["vllm_ascend.ops.fused_moe.fused_moe:AscendUnquantizedFusedMoEMethod"]["bases"] = ["FusedMoEMethodBase"]
    with pytest.raises(compat.UnsupportedVllmAscendError, match=r"AscendUnquantizedFusedMoEMethod's base"):
        compat.check_compatibility(version, _importer(_tree(version, facts)))


@pytest.mark.parametrize("version", ["0.13.0", "0.17.1", "0.19.0rc1", "0.24.0", "1.0.0"])
def test_unread_releases_are_refused_by_name(version: str) -> None:
    tree = _tree("0.23.0", FACTS["0.23.0"])
    with pytest.raises(compat.UnsupportedVllmAscendError, match=rf"0\.18\.x, 0\.23\.x.*found {re.escape(version)}"):
        compat.check_compatibility(version, _importer(tree))


def test_extractor_reads_classes_functions_and_assignments(tmp_path: Path) -> None:
    """bench/vllm_ascend_api.py's ``lookup`` on a small tree: a method's parameters, a dataclass's
    fields, a definition inside ``try``, an absent name (``None``)."""
    from bench.vllm_ascend_api import lookup

    package = tmp_path / "vllm_ascend" / "ops"
    package.mkdir(parents=True)
    (package / "layernorm.py").write_text(
        "try:\n    import torch_npu\nexcept ImportError:\n    pass\n"
        "class AscendRMSNorm(RMSNorm):\n    eps: float\n"
        "    def forward_oot(self, x, residual=None, *, y=1):\n        pass\n"
        "helper = {'A': 1, 'B': 2}\n"
    )
    assert lookup(tmp_path, "vllm_ascend.ops.layernorm", "AscendRMSNorm.forward_oot")["params"] == [
        "self",
        "x",
        "residual",
        "y",
    ]
    assert lookup(tmp_path, "vllm_ascend.ops.layernorm", "AscendRMSNorm")["fields"] == ["eps"]
    assert lookup(tmp_path, "vllm_ascend.ops.layernorm", "helper")["keys"] == ["A", "B"]
    assert lookup(tmp_path, "vllm_ascend.ops.layernorm", "torch_npu")["kind"] == "Import"
    assert lookup(tmp_path, "vllm_ascend.ops.layernorm", "AscendRMSNorm.forward_native") is None
    assert lookup(tmp_path, "vllm_ascend.ops.missing", "X") is None


def test_installed_check_reports_a_missing_vllm_ascend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """npu_check.sh's setup runs ``python -m bench.vllm_ascend_api --installed``: without vllm-ascend
    (or torch_npu) it records why and does not fail the stage."""
    from bench.vllm_ascend_api import main

    monkeypatch.setitem(sys.modules, "vllm_ascend", None)
    out = tmp_path / "vllm_ascend.json"
    assert main(["--installed", "--out", str(out)]) == 0
    assert "importable" in json.loads(out.read_text()) and json.loads(out.read_text())["importable"] is not True
