"""``biggraph build-native [--into DIR]``: compile the native kernels (job/native) ahead of time.

A wheel (and the image, which installs one) already carries them, built by setup.py. This is for an install whose
build found no compiler (a source install): into the installed package's ``_prebuilt`` directory, so that later
runs (other users, a read-only copy) need no compiler; without it the kernels are built on first use into a
private cache, and this only moves that second to now.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from job import native
from job.errors import UserError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "build-native", help="compile the native kernels now (a wheel carries them; for a source install built "
                             "without a compiler)",
        description="Compile job/native's C kernels with $CC / cc / gcc and print the library's path.")
    parser.add_argument("--into", type=Path, default=None,
                        help="directory for the library (default: the installed package's _prebuilt directory)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    into = args.into if args.into is not None else native.PREBUILT
    try:
        print(native.build(into, private=into != native.PREBUILT))
    except OSError as exc:
        raise UserError(str(exc)) from None
    return 0
