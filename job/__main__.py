"""``python -m job``: the same entry point as the ``biggraph`` console script (and what torchrun runs)."""

from job.cli import entry

if __name__ == "__main__":
    entry()
