"""``python -m job.native build [--into DIR]``: compile the row kernels ahead of time (the image build does,
into the package's ``_prebuilt`` directory, so that a runtime image needs no compiler)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from job.native import PREBUILT, build


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m job.native", description=__doc__)
    parser.add_argument("command", choices=["build"])
    parser.add_argument("--into", type=Path, default=PREBUILT, help="directory for the library (default: %(default)s)")
    args = parser.parse_args()
    try:
        print(build(args.into, private=args.into != PREBUILT))
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
