"""The README's "Use" snippet runs as a user would paste it, and its assertion (logdiff = 0) holds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[hf])")

from samepath import integrations

README = Path(__file__).resolve().parent.parent / "README.md"


def _use_snippet() -> str:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Use\n") :]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match, "the README's Use section has no python block"
    return match.group(1)


def _processed_snippet() -> str:
    text = README.read_text(encoding="utf-8")
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.DOTALL) if "processed_logprobs(" in b]
    assert len(blocks) == 1, "the README needs one processed_logprobs block"
    return blocks[0]


def test_the_use_snippet_runs_and_its_logdiff_is_zero() -> None:
    namespace: dict = {}
    try:
        exec(compile(_use_snippet(), str(README), "exec"), namespace)
    finally:
        integrations.unpatch_all()
    assert namespace["rollout_lp"].shape == (2, 6)
    # the processed-log-probs snippet runs on the same names
    exec(compile(_processed_snippet(), str(README), "exec"), namespace | {"eos_id": 2})


def test_the_snippet_without_position_ids_is_refused() -> None:
    """The same snippet with the trainer's positions left to Hugging Face (counted from the
    padding) is the mistake the snippet warns of: samepath refuses it, naming the fix, where it
    used to give a silent logdiff (6 of 18 tokens equal)."""
    snippet = _use_snippet().replace("position_ids=position_ids, ", "")
    assert "position_ids=position_ids" not in snippet
    try:
        with pytest.raises(ValueError, match=r"left-padded .* position_ids=\(attention_mask.cumsum"):
            exec(compile(snippet, str(README), "exec"), {})
    finally:
        integrations.unpatch_all()


@pytest.mark.slow
def test_the_rl_snippet_runs_and_every_step_is_bit_identical() -> None:
    """The README's samepath.rl snippet: three GRPO steps on the default-shaped Qwen3."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## RL through training") :]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match, "the README's RL section has no python block"
    namespace: dict = {}
    exec(compile(match.group(1), str(README), "exec"), namespace)
    assert len(namespace["history"]) == 3 and all(m.weight_change > 0 for m in namespace["history"])
