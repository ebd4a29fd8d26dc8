"""What a pod checks before it trains (``biggraph preflight``, run by the chart's init step).

Failing here gives one clear line in ``kubectl logs`` instead of a stack trace minutes into a
torchrun start-up on every replica.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

import storage_adapters as storage
from job.config import ConfigSchema
from job.errors import UserError
from job.session import storage_scoped


@storage_scoped
def check_storage(config: ConfigSchema, *, write: bool, report: Callable[[str], None] = lambda line: None) -> None:
    """Its inputs are reachable and (``write``) its checkpoint_path writable.

    Each check that passes is given to ``report`` as one line as soon as it passes (so a pod's log shows how
    far it got); the first that fails raises ``UserError`` naming what is missing or not writable.
    """
    missing = [url for url in [config.entity_path, *config.edge_paths] if not storage.exists(url)]
    if missing:
        raise UserError(f"preflight: not found: {', '.join(missing)}")
    report(f"preflight: entity_path and {len(config.edge_paths)} edge path(s) reachable")
    if write:
        check_writable(config)
        report(f"preflight: checkpoint_path {config.checkpoint_path} writable")
    elif storage.exists(config.checkpoint_path):
        report(f"preflight: checkpoint_path {config.checkpoint_path} reachable")


@storage_scoped
def check_writable(config: ConfigSchema) -> None:
    """Write, read back and remove a probe under checkpoint_path (created if missing)."""
    probe = storage.join(config.checkpoint_path, f".biggraph-preflight-{secrets.token_hex(4)}")
    try:
        storage.makedirs(config.checkpoint_path)
        storage.write_text(probe, "ok\n")
        if storage.read_text(probe) != "ok\n":
            raise UserError(f"preflight: {probe}: read back something else than was written")
    finally:
        storage.remove(probe)
