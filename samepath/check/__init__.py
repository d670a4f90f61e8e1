"""``samepath check`` and ``samepath doctor``: see the problem, the fix, and where the paths part.

* :func:`samepath.check.harness.run_stock_and_patched` — the rollout (Hugging Face ``generate``)
  and the trainer forward on the same tokens, with stock kernels and under ``patch_all()``;
  :class:`samepath.check.report.CheckReport` turns the two into the table, JSON and plot.
* :func:`samepath.check.doctor.diagnose` — per-module records of a KV-cache decode and a full
  forward, compared position by position: the first module whose output differs.
* :func:`samepath.check.cli.main` — the ``samepath`` command line (also ``python -m samepath``).
"""

from samepath.check.doctor import Divergence, DoctorReport, diagnose
from samepath.check.harness import CheckInputError, load_default_model, load_model, run_stock_and_patched
from samepath.check.report import SCHEMA_VERSION, CheckReport, compare

__all__ = [
    "SCHEMA_VERSION",
    "CheckInputError",
    "CheckReport",
    "Divergence",
    "DoctorReport",
    "compare",
    "diagnose",
    "load_default_model",
    "load_model",
    "run_stock_and_patched",
]
