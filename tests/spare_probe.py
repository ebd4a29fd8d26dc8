"""A trainer stand-in for tests/test_warm_spares.py: prints what it was started with, as one JSON line, and exits with
the code its last argument names (``python -u -m spare_probe ARGS... [CODE]``)."""

import json
import os
import sys

from job.train import startup

print(json.dumps({
    "argv": sys.argv[1:], "name": __name__, "rank": os.environ.get("RANK"), "marker": os.environ.get("BIGGRAPH_WARM_SPARE"),
    "stdin": os.path.realpath("/proc/self/fd/0"), "torch_imported": "torch" in sys.modules,
    "spare": startup.warm_spare(), "session_leader": os.getsid(0) == os.getpid(),
}), flush=True)
sys.exit(int(sys.argv[-1]) if sys.argv[-1:] and sys.argv[-1].isdigit() else 0)
