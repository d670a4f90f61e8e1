"""CPU replays of samepath's Triton kernels: the same schedule over whole tensors, bit-identical to
Triton's interpreter running the kernel source (see :mod:`samepath.kernels.dispatch`).

A replay computes what every program of the launch computes, all at once: the same tiles (with
the same zero padding of masked-off lanes), the same K / KV tile order, the same fp32 accumulation
points and casts, with the numpy operations the interpreter applies (:mod:`.numerics`) on arrays
whose leading dimensions stack the programs' tiles. Each module registers its replays with
:func:`samepath.kernels.dispatch.register_replay` under the kernel's ``"module.function"`` name;
importing this package imports them all.
"""

from __future__ import annotations

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
