"""``python -m samepath check|doctor``: the same as the ``samepath`` console script."""

import sys

from samepath.check.cli import main

if __name__ == "__main__":
    sys.exit(main())
