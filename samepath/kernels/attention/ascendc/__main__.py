"""``python -m samepath.ascendc_fallback build``: build the Ascend C attention for this machine, once.

Run it after installing samepath (and before starting vLLM workers or trainer ranks) on a machine with
CANN (``source <CANN>/set_env.sh``), torch_npu and an NPU. ``key`` prints the build key and the library
path without building. ``python -m samepath.kernels.attention.ascendc`` is the same command.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from samepath.kernels.attention.ascendc import build

PROG = "python -m samepath.ascendc_fallback"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__)
    parser.add_argument("command", choices=("build", "key"))
    parser.add_argument("--soc", help=f"SoC to compile for (default: {build.SOC_VERSION_ENV} or the device's)")
    args = parser.parse_args(argv)
    try:
        key = build.current_build_key(args.soc)
        if args.command == "key":
            print(json.dumps({**dataclasses.asdict(key), "library": str(build.library_path(key))}, indent=1))
            return 0
        path = build.build(args.soc)
    except RuntimeError as error:
        print(f"samepath.ascendc_fallback {args.command}: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
