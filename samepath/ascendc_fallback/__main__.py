"""``python -m samepath.ascendc_fallback build``: build the Ascend C attention for this machine, once
(:mod:`samepath.kernels.attention.ascendc.__main__`; ``key`` prints the build key and library path)."""

import sys

from samepath.kernels.attention.ascendc.__main__ import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
