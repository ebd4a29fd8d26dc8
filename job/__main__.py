"""``python -m job``: the same entry point as the ``biggraph`` console script (and what torchrun runs)."""

import sys

from job.cli import main

if __name__ == "__main__":
    sys.exit(main())
