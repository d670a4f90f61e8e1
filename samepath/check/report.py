"""The numbers ``samepath check`` reports, its table, its JSON document and its plot.

JSON schema (``schema_version`` 1; fields are only ever added within a version)::

    {
      "schema_version": 1,
      "tool": "samepath check",
      "samepath_version": "0.1.0",
      "model": {"source": "embedded-default" | "<dir>", "model_type": str, "dtype": str,
                "num_layers": int, "hidden_size": int},
      "settings": {"rollout": "hf" | "vllm", "batch": int, "new_tokens": int, "temperature": float,
                   "seed": int, "prompt_lengths": [int, ...]},
      "runs": {
        "stock" | "samepath": {
          "tokens": int,                    # tokens compared (batch * new_tokens)
          "equal_tokens": int,              # bitwise-equal log-probs
          "equal_fraction": float,
          "max_abs_logp_diff": float,       # max |logp_trainer - logp_rollout|
          "mean_abs_logp_diff": float,
          "k3_kl": float,                   # mean(exp(r) - 1 - r), r = logp_trainer - logp_rollout
          "probs_diff_max": float,          # verl's training/rollout_probs_diff_max
          "probs_diff_mean": float,         # verl's training/rollout_probs_diff_mean
          "bit_identical": bool,            # every log-prob torch.equal
          "per_position_max_abs_logp_diff": [float, ...],   # one per generated position
          "fingerprints": {"rollout": str, "trainer": str}
        }
      },
      "logdiff_zero": bool,                 # runs.samepath.bit_identical
      "exit_status": 0 | 1,
      "environment": {"device": str,        # e.g. "cpu", "cuda:0 (NVIDIA H100 ...)"
                      "executor": str,      # how the kernels ran: "triton" (compiled) or the CPU executor
                      "versions": {"samepath": str, "torch": str, "triton": str | null,
                                   "transformers": str | null, "vllm": str | null}},  # vllm: with --rollout vllm
      "patched_vs_stock": {                 # samepath's trainer log-probs against stock's, where both
        "tokens": int,                      # runs generated the same tokens (each row up to its first
        "max_abs_logp_diff": float,         # differing token): how close samepath's numbers are to stock's
        "mean_abs_logp_diff": float
      }
    }

Non-finite numbers are written as ``null``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from samepath.check.harness import DTYPES_BY_TORCH, CheckInputError, LoadedModel, SideBySide

SCHEMA_VERSION = 1


@dataclass
class Metrics:
    tokens: int
    equal_tokens: int
    max_abs_logp_diff: float
    mean_abs_logp_diff: float
    k3_kl: float
    probs_diff_max: float
    probs_diff_mean: float
    per_position_max_abs_logp_diff: list[float]

    @property
    def equal_fraction(self) -> float:
        return self.equal_tokens / self.tokens if self.tokens else 1.0

    @property
    def bit_identical(self) -> bool:
        return self.equal_tokens == self.tokens


def compare(rollout_lp: torch.Tensor, trainer_lp: torch.Tensor) -> Metrics:
    """Rollout vs trainer log-probs ``[B, T]`` (fp32): the numbers verl and samepath log."""
    if rollout_lp.shape != trainer_lp.shape:
        raise ValueError(f"rollout {tuple(rollout_lp.shape)} and trainer {tuple(trainer_lp.shape)} shapes differ")
    equal = rollout_lp == trainer_lp
    equal |= rollout_lp.isnan() & trainer_lp.isnan()  # bitwise sense: NaN on both sides is "the same"
    r = trainer_lp.double() - rollout_lp.double()
    r = torch.where(equal, torch.zeros_like(r), r)  # -inf == -inf gives nan otherwise
    abs_r = r.abs()
    probs = (trainer_lp.double().exp() - rollout_lp.double().exp()).abs()
    k3 = r.exp() - 1 - r
    per_position = abs_r.amax(0) if abs_r.numel() else abs_r.new_zeros(0)
    return Metrics(
        tokens=int(equal.numel()),
        equal_tokens=int(equal.sum()),
        max_abs_logp_diff=float(abs_r.max()) if abs_r.numel() else 0.0,
        mean_abs_logp_diff=float(abs_r.mean()) if abs_r.numel() else 0.0,
        k3_kl=float(k3.mean()) if k3.numel() else 0.0,
        probs_diff_max=float(probs.max()) if probs.numel() else 0.0,
        probs_diff_mean=float(probs.mean()) if probs.numel() else 0.0,
        per_position_max_abs_logp_diff=[float(x) for x in per_position],
    )


def _version(module: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: torch.device | str, vllm: bool = False) -> dict:
    """Where the report was made: the device (with its name), how the kernels ran there, and the
    versions of samepath, torch, triton, transformers (and vLLM for a vLLM rollout)."""
    from samepath.version import __version__

    device = torch.device(device)
    name = str(device)
    if device.type == "cuda":
        name += f" ({torch.cuda.get_device_name(device)})"
    if device.type == "cpu":
        import os

        executor = "cpu: " + (os.environ.get("SAMEPATH_CPU_EXECUTOR") or "default executor")
    else:
        executor = "triton (compiled)"
    versions = {
        "samepath": __version__,
        "torch": torch.__version__,
        "triton": _version("triton") or _version("triton-ascend"),
        "transformers": _version("transformers"),
    }
    if vllm:
        versions["vllm"] = _version("vllm")
    return {"device": name, "executor": executor, "versions": versions}


def patched_vs_stock(stock: SideBySide, patched: SideBySide) -> dict:
    """samepath's trainer log-probs against stock's on the tokens both runs generated alike (each
    row up to its first differing token): closeness, where the check itself proves consistency."""
    diffs = []
    for row in range(stock.generated.shape[0]):
        same = (stock.generated[row] == patched.generated[row]).long().cumprod(0).bool()
        a, b = stock.trainer_logprobs[row][same].double(), patched.trainer_logprobs[row][same].double()
        diffs.append((a - b).abs())
    flat = torch.cat(diffs) if diffs else torch.zeros(0, dtype=torch.float64)
    return {
        "tokens": int(flat.numel()),
        "max_abs_logp_diff": _finite(float(flat.max())) if flat.numel() else 0.0,
        "mean_abs_logp_diff": _finite(float(flat.mean())) if flat.numel() else 0.0,
    }


@dataclass
class CheckReport:
    model: LoadedModel
    rollout: str
    batch: int
    new_tokens: int
    temperature: float
    seed: int
    stock: SideBySide
    patched: SideBySide

    def __post_init__(self) -> None:
        self.stock_metrics = compare(self.stock.rollout_logprobs, self.stock.trainer_logprobs)
        self.patched_metrics = compare(self.patched.rollout_logprobs, self.patched.trainer_logprobs)

    @property
    def logdiff_zero(self) -> bool:
        return self.patched_metrics.bit_identical

    @property
    def exit_status(self) -> int:
        return 0 if self.logdiff_zero else 1

    # -- JSON ------------------------------------------------------------------------------------

    def to_json(self) -> dict:
        from samepath.version import __version__

        cfg = self.model.model.config

        def run(side: SideBySide, m: Metrics) -> dict:
            return {
                "tokens": m.tokens,
                "equal_tokens": m.equal_tokens,
                "equal_fraction": _finite(m.equal_fraction),
                "max_abs_logp_diff": _finite(m.max_abs_logp_diff),
                "mean_abs_logp_diff": _finite(m.mean_abs_logp_diff),
                "k3_kl": _finite(m.k3_kl),
                "probs_diff_max": _finite(m.probs_diff_max),
                "probs_diff_mean": _finite(m.probs_diff_mean),
                "bit_identical": m.bit_identical,
                "per_position_max_abs_logp_diff": [_finite(x) for x in m.per_position_max_abs_logp_diff],
                "fingerprints": {"rollout": side.rollout_fingerprint, "trainer": side.trainer_fingerprint},
            }

        return {
            "schema_version": SCHEMA_VERSION,
            "tool": "samepath check",
            "samepath_version": __version__,
            "model": {
                "source": self.model.source,
                "model_type": self.model.model_type,
                "dtype": DTYPES_BY_TORCH[self.model.dtype],
                "num_layers": int(cfg.num_hidden_layers),
                "hidden_size": int(cfg.hidden_size),
            },
            "settings": {
                "rollout": self.rollout,
                "batch": self.batch,
                "new_tokens": self.new_tokens,
                "temperature": self.temperature,
                "seed": self.seed,
                "prompt_lengths": [len(p) for p in self.stock.prompts],
            },
            "runs": {
                "stock": run(self.stock, self.stock_metrics),
                "samepath": run(self.patched, self.patched_metrics),
            },
            "logdiff_zero": self.logdiff_zero,
            "exit_status": self.exit_status,
            "environment": environment(next(self.model.model.parameters()).device, vllm=self.rollout == "vllm"),
            "patched_vs_stock": patched_vs_stock(self.stock, self.patched),
        }

    # -- table -----------------------------------------------------------------------------------

    def format_table(self) -> str:
        s, p = self.stock_metrics, self.patched_metrics
        sampling = f"temperature {self.temperature:g}" if self.temperature > 0 else "greedy"
        lines = [
            f"samepath check: {self.model.describe()}",
            f"rollout: {_ROLLOUT_NAMES[self.rollout].format(batch=self.batch)}, "
            f"{self.new_tokens} new tokens, {sampling}, seed {self.seed}",
            "trainer: one right-padded forward of prompt + completion, no cache",
            "stock: the same runs with the framework's own kernels (samepath not patched in); "
            "samepath: both sides under patch_all()",
            "",
        ]
        rows = [
            ("", "stock", "samepath"),
            ("tokens compared", str(s.tokens), str(p.tokens)),
            ("bitwise equal", _fraction(s), _fraction(p)),
            ("max |Δlogp|", _num(s.max_abs_logp_diff), _num(p.max_abs_logp_diff)),
            ("mean |Δlogp|", _num(s.mean_abs_logp_diff), _num(p.mean_abs_logp_diff)),
            ("k3 KL(rollout‖trainer)", _num(s.k3_kl), _num(p.k3_kl)),
            ("probs diff max (verl)", _num(s.probs_diff_max), _num(p.probs_diff_max)),
            ("probs diff mean (verl)", _num(s.probs_diff_mean), _num(p.probs_diff_mean)),
        ]
        width0 = max(len(r[0]) for r in rows)
        width = max(len(c) for r in rows for c in r[1:])
        for label, a, b in rows:
            lines.append(f"  {label:<{width0}}  {a:>{width}}  {b:>{width}}")
        fps = {self.patched.rollout_fingerprint, self.patched.trainer_fingerprint}
        lines += [
            "",
            f"  fingerprint  rollout {self.patched.rollout_fingerprint}  trainer {self.patched.trainer_fingerprint}"
            + ("  (same)" if len(fps) == 1 else "  (MISMATCH)"),
            "",
        ]
        if self.logdiff_zero:
            lines.append("logdiff = 0 with samepath: every rollout log-prob equals the trainer's, bit for bit.")
        else:
            lines.append(
                f"logdiff != 0 with samepath: {p.tokens - p.equal_tokens} of {p.tokens} log-probs differ. "
                "Run `samepath doctor` with the same flags to find the first operator where the paths part."
            )
        return "\n".join(lines)

    # -- plot ------------------------------------------------------------------------------------

    def plot(self, path: str) -> None:
        """PNG of max |Δlogp| over the batch per generated position, stock vs samepath."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise CheckInputError('--plot needs matplotlib (pip install matplotlib, or -e ".[hf]")') from None
        positions = list(range(1, self.new_tokens + 1))
        fig, ax = plt.subplots(figsize=(7, 3.5), dpi=120)
        stock, patched = self.stock_metrics, self.patched_metrics
        ax.plot(
            positions,
            stock.per_position_max_abs_logp_diff,
            "o-",
            label=f"stock: {100 * stock.equal_fraction:.1f}% of tokens bit-identical",
            color="tab:red",
        )
        ax.plot(
            positions,
            patched.per_position_max_abs_logp_diff,
            "s-",
            label=f"samepath: {100 * patched.equal_fraction:.1f}% of tokens bit-identical",
            color="tab:blue",
        )
        smallest = [x for x in self.stock_metrics.per_position_max_abs_logp_diff if x > 0]
        ax.set_yscale("symlog", linthresh=min(smallest) if smallest else 1e-8)
        ax.set_xlabel("generated token position")
        ax.set_ylabel("max |Δlogp| over the batch (0 = bit-identical)")
        ax.set_title(f"rollout vs trainer log-probs: {self.model.model_type}, {DTYPES_BY_TORCH[self.model.dtype]}")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        try:
            fig.savefig(path, format="png")
        except OSError as exc:
            raise CheckInputError(f"cannot write the plot to {path!r}: {exc.strerror or exc}") from None
        finally:
            plt.close(fig)


_ROLLOUT_NAMES = {
    "hf": "Hugging Face generate (KV cache), batch {batch} (left-padded)",
    "vllm": "vLLM (paged KV cache, chunked prefill, prefix caching), batch {batch}",
}


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _num(x: float) -> str:
    if x == 0:
        return "0"
    if not math.isfinite(x):
        return str(x)
    return f"{x:.3e}"


def _fraction(m: Metrics) -> str:
    return f"{m.equal_tokens} ({100 * m.equal_fraction:.1f}%)"


__all__ = ["SCHEMA_VERSION", "CheckReport", "Metrics", "compare", "environment", "patched_vs_stock"]
