"""Suite-wide guard: no test may leave samepath's global patches behind for the next one."""

from __future__ import annotations

import importlib.util

import pytest

from samepath import integrations


def _stock_state() -> dict[str, object]:
    state: dict[str, object] = {"patch_all": integrations.enabled()}
    if importlib.util.find_spec("transformers") is not None:
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface

        state["attention"] = dict(AttentionInterface._global_mapping)
        state["masks"] = dict(AttentionMaskInterface._global_mapping)
    return state


@pytest.fixture(autouse=True)
def _no_leaked_patches():
    before = _stock_state()
    yield
    assert _stock_state() == before, "a test left samepath's integration patches (or interface entries) behind"
