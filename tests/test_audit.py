"""Fail closed: the coverage audit, its refusal and opt-out, the model fingerprint, and the
attention features Hugging Face passes that samepath refuses rather than drops (Hugging Face side;
the vLLM side is in tests/test_integration_vllm.py)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[hf])")

import samepath  # noqa: E402
from samepath import audit, integrations  # noqa: E402
from samepath.check.cli import main  # noqa: E402
from samepath.check.harness import DEFAULT_MODEL_CONFIG, audit_model_dir  # noqa: E402
from samepath.integrations import hf  # noqa: E402
from samepath.integrations.hf_audit import audit_hf_model  # noqa: E402
from samepath.kernels.config import split_fingerprint, tensor_parallel_size_of  # noqa: E402
from samepath.models.formulas import UnsupportedModelError, model_formulas  # noqa: E402

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {}),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    ),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=None)),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, {}),
    "mixtral": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        dict(sliding_window=None, num_local_experts=4, num_experts_per_tok=2),
    ),
    "gemma3_text": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        dict(layer_types=["sliding_attention", "full_attention"], sliding_window=16, query_pre_attn_scalar=24),
    ),
    "gemma2": (  # with Gemma 2's default caps (attention 50, final logits 30)
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        dict(layer_types=["sliding_attention", "full_attention"], sliding_window=16, query_pre_attn_scalar=24),
    ),
}


def tiny(arch: str, dtype: torch.dtype = torch.float32, **overrides) -> torch.nn.Module:
    config_cls, model_cls, extra = FAMILIES[arch]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**DEFAULT_MODEL_CONFIG, **extra, **overrides})).to(dtype).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(4.0 if param.dim() == 1 else 2.0)
    return model


@pytest.fixture(autouse=True)
def clean_state(monkeypatch):
    monkeypatch.delenv(audit.ALLOW_ENV_VAR, raising=False)
    monkeypatch.setattr(audit.report, "_warned", set())  # "warn once" is per process
    yield
    integrations.unpatch_all()


class ScaledNorm(torch.nn.Module):
    """A custom final norm (1.5 x RMSNorm): a module samepath has no rule for."""

    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) * 1.5


def with_custom_norm(model: torch.nn.Module) -> torch.nn.Module:
    model.model.norm = ScaledNorm(model.model.norm)
    return model


def test_audit_cli_on_the_embedded_default(tmp_path, capsys):
    """The verdict first, a summary by default (``--all``: every module); ``--dtype bf16`` is bfloat16."""
    report = tmp_path / "audit.json"
    assert main(["audit", "--dtype", "bf16", "--json", str(report)]) == 0
    doc = json.loads(report.read_text())
    assert doc["fully_covered"] and doc["model"] == "embedded-default" and doc["counts"]["uncovered"] == 0
    assert doc["refused"] is None and doc["exit_status"] == 0
    assert {e["op"] for e in doc["entries"]} >= {"attention", "rms_norm", "silu_mul", "rotary", "linear"}
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "samepath audit: embedded-default (qwen3, bfloat16)"
    assert lines[1].startswith("full coverage") and lines[2].startswith("summary: ")
    assert len(lines) < 10 and "model.layers.0.self_attn" not in "\n".join(lines)
    assert main(["audit", "--dtype", "float32", "--all"]) == 0
    assert "model.layers.0.self_attn" in capsys.readouterr().out
    assert not integrations.enabled()


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_audit_reports_full_coverage_for_each_family(arch, tmp_path):
    tiny(arch).save_pretrained(tmp_path)
    report = audit_model_dir(str(tmp_path))
    assert report.fully_covered, report.format()
    assert report.model_type == arch
    ops = {e.op for e in report.entries if e.status == audit.COVERED}
    assert {"attention", "rms_norm", "rotary", "linear"} <= ops
    assert ("experts" in ops) == (arch in ("qwen3_moe", "mixtral"))
    assert ("logits" in ops) == (arch == "gemma2")  # final logit soft-capping on samepath's kernel


def test_audit_cli_names_what_is_not_covered(tmp_path, capsys):
    """A model type samepath refuses on both sides (granite): exit 2 as in `check`, the reason on the
    second line and on stderr, then the summary naming what is not covered."""
    config = transformers.GraniteConfig(**{k: v for k, v in DEFAULT_MODEL_CONFIG.items() if k != "head_dim"})
    transformers.GraniteForCausalLM(config).save_pretrained(tmp_path)
    capsys.readouterr()  # save_pretrained's own progress
    assert main(["audit", "--model", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[1].startswith("REFUSED: ") and "model_type 'granite' is not supported" in lines[1]
    assert "GraniteRMSNorm" in captured.out and "--all lists" in captured.out and len(lines) < 20
    assert "model_type 'granite' is not supported: Granite's embedding_multiplier" in captured.err
    assert len(captured.err.strip().splitlines()) == 1
    assert main(["check", "--model", str(tmp_path)]) == 2  # the same situation, the same status
    capsys.readouterr()
    assert main(["audit", "--model", str(tmp_path / "nope")]) == 2


def test_audit_refuses_the_head_size_check_refuses(tmp_path, capsys):
    """Head size 18: `audit` said "fully covered" where `check` refused it; now both exit 2 with the reason."""
    transformers.Qwen3Config(
        vocab_size=64,
        hidden_size=36,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=18,
    ).save_pretrained(tmp_path)
    for command in ("audit", "check"):
        assert main([command, "--model", str(tmp_path)]) == 2, command
        err = capsys.readouterr().err
        assert "head size = 18 is not a supported head size" in err, (command, err)


def test_patch_all_refuses_a_custom_module_and_names_it():
    model = with_custom_norm(tiny("qwen3"))
    with pytest.raises(audit.UncoveredOpsError) as refused:
        integrations.patch_all(model)
    message = str(refused.value)
    assert "model.norm: " in message and "ScaledNorm" in message and audit.ALLOW_ENV_VAR in message
    assert "model.norm.norm" not in message  # the stock RMSNorm inside is covered: only the custom module
    assert not integrations.enabled(), "a refused patch_all(model) leaves nothing patched"


def test_patch_all_refuses_a_model_type_covered_on_one_side_only():
    """olmo2: no Hugging Face patches and no vLLM plugin rules — refused on both sides, with the reason."""
    config = transformers.Olmo2Config(**DEFAULT_MODEL_CONFIG)
    with pytest.raises(audit.UncoveredOpsError, match=r"model_type 'olmo2' is not supported: vLLM 0\.32 runs Olmo2"):
        integrations.patch_all(transformers.Olmo2ForCausalLM(config).eval())


@pytest.mark.parametrize("how", ["argument", "env"])
def test_opt_out_runs_warns_and_is_in_the_fingerprint(how, monkeypatch):
    plain = samepath.fingerprint()
    model = with_custom_norm(tiny("qwen3"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if how == "env":
            monkeypatch.setenv(audit.ALLOW_ENV_VAR, "ScaledNorm")
            integrations.patch_all(model)
        else:
            integrations.patch_all(model, allow_uncovered=["ScaledNorm"])
    assert any("ScaledNorm" in str(w.message) for w in caught)
    marked = samepath.fingerprint()
    assert marked.startswith(plain + "-uncovered")
    assert split_fingerprint(marked) == (plain, None)
    samepath.assert_same_numerics(marked)  # the marker is a record; the numerics still compare
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]))
    integrations.unpatch_all()
    assert samepath.fingerprint() == plain


def test_opt_out_of_another_module_is_still_refused():
    model = with_custom_norm(tiny("qwen3"))
    with pytest.raises(audit.UncoveredOpsError, match="ScaledNorm"):
        integrations.patch_all(model, allow_uncovered="SomethingElse")


def test_negative_control_the_mismatch_the_refusal_prevents():
    """What the opt-out lets through: the rollout engine builds the checkpoint's standard model (it
    does not know the trainer's custom module), the trainer runs the custom module. Same harness,
    same weights: equal without it, different with it (a deliberate 1.5x, on every machine)."""
    from tests.test_integration_hf import random_prompts, rollout, trainer_padded

    rollout_model = tiny("qwen3")
    prompts = random_prompts([4, 7], seed=2)
    with integrations.patched(rollout_model):
        generated, rollout_lp = rollout(rollout_model, prompts, 2, temperature=None)
        assert torch.equal(trainer_padded(rollout_model, prompts, generated, 1.0), rollout_lp)
    trainer_model = with_custom_norm(tiny("qwen3"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with integrations.patched(trainer_model, allow_uncovered="all"):
            trained = trainer_padded(trainer_model, prompts, generated, 1.0)
    assert not torch.equal(trained, rollout_lp)


def test_unpatched_model_is_reported_uncovered():
    report = audit_hf_model(tiny("llama"))
    assert not report.fully_covered
    ops = {e.op for e in report.uncovered}
    assert {"attention", "rms_norm", "silu_mul", "rotary", "linear"} <= ops


def test_model_fingerprint_follows_the_formulas():
    base = tiny("llama").config
    llama3 = tiny(
        "llama",
        rope_parameters={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 10000.0,
        },
    ).config
    plain = samepath.fingerprint()
    fp_base, fp_llama3 = samepath.fingerprint(model_config=base), samepath.fingerprint(model_config=llama3)
    assert fp_base != fp_llama3 and fp_base.startswith(plain + "-m")
    assert samepath.fingerprint(model_config=tiny("llama").config) == fp_base  # deterministic
    assert split_fingerprint(fp_base) == (plain, fp_base.rsplit("-", 1)[1])
    assert tensor_parallel_size_of(fp_base) == 1 and tensor_parallel_size_of(samepath.fingerprint(2, base)) == 2
    samepath.assert_same_numerics(fp_base, model_config=base)
    samepath.assert_same_numerics(fp_base)  # no model to compare with: the numerics part only
    with pytest.raises(samepath.NumericsMismatchError, match="model formula mismatch"):
        samepath.assert_same_numerics(fp_llama3, model_config=base)
    formulas = model_formulas(llama3)
    assert formulas["rope"]["rope_type"] == "llama3" and formulas["activation"] == "silu·mul"
    eps = model_formulas(tiny("qwen3", rms_norm_eps=1e-5).config)["norm"]["eps"]
    assert eps == 1e-5 and samepath.fingerprint(model_config=tiny("qwen3").config) != samepath.fingerprint(
        model_config=tiny("qwen3", rms_norm_eps=1e-5).config
    )
    with pytest.raises(UnsupportedModelError, match="hidden_act='gelu'"):
        model_formulas(tiny("llama", hidden_act="gelu").config)


def _qkv(batch: int = 1, length: int = 5):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, 4, length, 32, generator=gen)
    k, v = (torch.randn(batch, 2, length, 32, generator=gen) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"dropout": 0.1}, "dropout=0.1"),
        ({"output_attentions": True}, "output_attentions"),
        ({"window_offset": 3}, "unknown keyword window_offset"),
        ({"cache_position": torch.arange(5)}, "unknown keyword cache_position"),
        ({"cu_seq_lens_q": torch.tensor([0, 2, 5])}, "cu_seq_lens_q"),
    ],
    ids=lambda v: str(v)[:20],
)
def test_attention_refuses_what_it_would_drop(kwargs, named):
    q, k, v = _qkv()
    module = torch.nn.Module()
    with pytest.raises(hf.UnsupportedAttentionError, match=named):
        hf.attention_forward(module, q, k, v, None, **kwargs)


def test_attention_accepts_what_transformers_passes():
    """Stock arguments (softcap=None, sinks=None, matching cu_seq_lens, model-level flags) run."""
    q, k, v = _qkv()
    module = torch.nn.Module()
    want, _ = hf.attention_forward(module, q, k, v, None)
    got, _ = hf.attention_forward(
        module,
        q,
        k,
        v,
        None,
        softcap=None,
        s_aux=None,
        use_cache=False,
        cu_seq_lens_q=torch.tensor([0, 5]),
        cu_seq_lens_k=torch.tensor([0, 5]),
        max_length_q=5,
        max_length_k=5,
        cache_position=None,  # verl's fused-kernel forward passes it explicitly
    )
    assert torch.equal(got, want)


def test_gemma2_softcap_reaches_the_kernel_not_dropped():
    """Gemma 2's attention softcap (a keyword transformers passes) goes to samepath's kernel: the
    Hugging Face attention's rows are varlen_attention's with that softcap, not without it."""
    from samepath.kernels.attention import varlen_attention

    q, k, v = _qkv(length=7)
    q = q * 4.0
    module = torch.nn.Module()
    got, _ = hf.attention_forward(module, q, k, v, None, softcap=2.0)
    flat = [t.transpose(1, 2).reshape(7, -1, 32) for t in (q, k, v)]
    cu = torch.tensor([0, 7], dtype=torch.int32)
    assert torch.equal(got[0], varlen_attention(*flat, cu, softcap=2.0))
    assert not torch.equal(got[0], varlen_attention(*flat, cu))


def test_both_sides_cover_the_same_model_types():
    """One resolution of the model on both sides: the Hugging Face patches, the formulas and the
    vLLM plugin's rules name the same model types, so none is covered on one side only."""
    from samepath.models import families

    assert set(hf.MODEL_TYPES) == set(families()) == set(audit.VLLM_STRUCTURE) == set(audit.VLLM_ATTENTION_MLP)


REFUSED_CONFIGS = {
    "olmo2": {},
    "granite": dict(logits_scaling=8.0, residual_multiplier=0.5, embedding_multiplier=12.0),
    "deepseek_v2": {},
}
BUILT = ("olmo2", "granite")  # cheap to build: patch_all(model) is run on them too


@pytest.mark.parametrize("model_type", list(REFUSED_CONFIGS))
def test_refused_families_give_one_reason_everywhere(model_type, tmp_path, capsys):
    """A family samepath does not implement on both sides is refused with the same reason by the
    formulas (what the vLLM plugin's load audit raises), patch_all(model) and `samepath check`
    (exit 2 from the config, before any weights load)."""
    from samepath.models.formulas import REFUSED

    small = {k: v for k, v in DEFAULT_MODEL_CONFIG.items() if k != "head_dim"}
    config = transformers.AutoConfig.for_model(model_type, **small, **REFUSED_CONFIGS[model_type])
    reason = REFUSED[model_type]
    with pytest.raises(UnsupportedModelError) as refused:
        model_formulas(config)
    assert reason in str(refused.value)
    if model_type in BUILT:
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        with pytest.raises(audit.UncoveredOpsError) as refused:
            integrations.patch_all(model)
        assert reason in str(refused.value)
        assert not integrations.enabled()
    config.save_pretrained(tmp_path)
    assert main(["check", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert reason in err and "Traceback" not in err


@pytest.mark.parametrize("arch", ["mistral", "phi3"])
def test_new_families_are_accepted_by_the_cli_and_refuse_their_extras(arch, tmp_path):
    """What patch_all(model) accepts the CLI loads; a config extra that vLLM's Mistral would run
    and samepath does not (llama_4_scaling) is refused by both, naming it."""
    from samepath.check.harness import CheckInputError, load_model

    tiny(arch).save_pretrained(tmp_path / "ok")
    assert load_model(str(tmp_path / "ok"), torch.float32).model_type == arch
    if arch == "mistral":
        extra = dict(llama_4_scaling={"original_max_position_embeddings": 64, "beta": 0.1})
        tiny(arch, **extra).save_pretrained(tmp_path / "bad")
        with pytest.raises(CheckInputError, match="llama_4_scaling"):
            load_model(str(tmp_path / "bad"), torch.float32)
        with pytest.raises(audit.UncoveredOpsError, match="llama_4_scaling"):
            integrations.patch_all(tiny(arch, **extra))


def test_gemma3_is_accepted_by_the_cli_and_refuses_what_it_does_not_implement(tmp_path, capsys):
    """gemma3_text: `samepath check` runs it (exit 0: rollout and trainer bit-identical) and its
    audit is full coverage with the Gemma ops; the options samepath does not implement — logit
    soft-capping (attention or final), bidirectional attention, another MLP activation — are
    refused by the formulas, patch_all(model) and the CLI alike, naming the option."""
    from samepath.check.harness import CheckInputError, load_model

    tiny("gemma3_text").save_pretrained(tmp_path / "ok")
    report = audit_model_dir(str(tmp_path / "ok"))
    ops = {e.op for e in report.entries if e.status == audit.COVERED}
    assert report.fully_covered and {"gelu_tanh_mul", "rms_norm", "rotary", "attention"} <= ops
    assert "silu_mul" not in ops
    assert main(["check", "--model", str(tmp_path / "ok"), "--batch", "2", "--new-tokens", "3"]) == 0
    assert "gemma3_text" in capsys.readouterr().out
    refused = {
        "final_logit_softcapping": dict(final_logit_softcapping=30.0),
        "attn_logit_softcapping": dict(attn_logit_softcapping=50.0),
        "use_bidirectional_attention": dict(use_bidirectional_attention=True),
        "hidden_activation='gelu'": dict(hidden_activation="gelu"),
    }
    for named, extra in refused.items():
        config = FAMILIES["gemma3_text"][0](**{**DEFAULT_MODEL_CONFIG, **FAMILIES["gemma3_text"][2], **extra})
        with pytest.raises(UnsupportedModelError, match=named):
            model_formulas(config)
        config.save_pretrained(tmp_path / named)
        with pytest.raises(CheckInputError, match=named):
            load_model(str(tmp_path / named), torch.float32)
    with pytest.raises(audit.UncoveredOpsError, match="final_logit_softcapping"):
        integrations.patch_all(tiny("gemma3_text", final_logit_softcapping=30.0))
    assert not integrations.enabled()


def test_an_embedding_scale_multiplied_as_stored_must_be_in_the_model_dtype() -> None:
    """vLLM's Gemma 3 multiplies the embeddings by its ``normalizer`` buffer as stored: in bf16 it is
    Hugging Face's factor (``embed_scale`` rounded to bf16); in fp32 it would multiply unrounded."""
    from samepath.audit import NEUTRAL, UNCOVERED, embedding_scale_entry
    from samepath.models.formulas import sqrt_hidden_scale

    module = torch.nn.Identity()
    factor = torch.tensor(sqrt_hidden_scale(64))
    stored = embedding_scale_entry("model", module, factor, torch.bfloat16, 64, multiplied_as_stored=True)
    assert stored.status == UNCOVERED and "float32" in stored.detail
    rounded = embedding_scale_entry("model", module, factor.bfloat16(), torch.bfloat16, 64, multiplied_as_stored=True)
    assert rounded.status == NEUTRAL
    assert embedding_scale_entry("model", module, factor, torch.bfloat16, 64).status == NEUTRAL  # HF casts at use


def test_a_refused_patch_all_model_leaves_no_state_behind():
    """patch_all(model) refused on a model type it patched for that call (here qwen2 after
    patch_all(model_types=["llama"])) undoes those patches and forgets the type, so a later
    patch_all(good_qwen2_model) patches it again instead of being refused."""
    integrations.patch_all(model_types=["llama"])
    with pytest.raises(audit.UncoveredOpsError):
        integrations.patch_all(with_custom_norm(tiny("qwen2")))
    integrations.patch_all(tiny("qwen2"))  # accepted
    assert integrations.enabled()


@pytest.mark.parametrize("value", [5, [1], b"all"])
def test_allow_uncovered_of_the_wrong_type_is_named(value):
    with pytest.raises(TypeError, match="allow_uncovered must be"):
        integrations.patch_all(allow_uncovered=value, model=tiny("qwen3"))
    assert not integrations.enabled()
