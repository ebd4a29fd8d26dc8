"""A test hook for torchrun agents (tests/test_elastic_rounds.py), loaded by Python at start-up from the PYTHONPATH of
the one agent a test gives it.

With ``BIGGRAPH_TEST_AGENT_DIES_AFTER_ROUND=1``, the agent process (not its trainers, nor its warm spares) is
SIGKILLed with its process group the moment its first rendezvous round has formed, before it publishes its role in
the round's store: a pod lost while the group re-forms, at the one moment torch's agent does not survive (the other
agents wait for its role until the store's read timeout; job/train/elastic/agent.py, module docstring, 4)."""

import os

_AGENT = "LOCAL_RANK" not in os.environ and os.environ.get("BIGGRAPH_WARM_SPARE") != "1"
if os.environ.get("BIGGRAPH_TEST_AGENT_DIES_AFTER_ROUND") == "1" and _AGENT:
    import signal

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    _next_rendezvous = dynamic_rendezvous.DynamicRendezvousHandler.next_rendezvous

    def _formed_then_lost(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        _next_rendezvous(self, *args, **kwargs)
        with open(os.environ["BIGGRAPH_TEST_AGENT_DIED_FILE"], "w") as marker:
            marker.write(str(os.getpid()))
        os.killpg(os.getpgid(0), signal.SIGKILL)

    dynamic_rendezvous.DynamicRendezvousHandler.next_rendezvous = _formed_then_lost
