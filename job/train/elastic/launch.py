"""How many trainer processes one machine runs: one per GPU (as PBG's GPU trainer), else one.

``biggraph train`` with ``num_gpus > 1`` re-launches itself under the pods' launcher (``python -m job.train.elastic.agent
--standalone``: torchrun with warm spares, job/train/elastic/agent.py); the processes are an ordinary single-node torchrun
group, so they share buckets through the same lock server as a multi-node job (each holds disjoint partitions,
which is PBG's sub-bucket rule).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from job.config import ConfigSchema

logger = logging.getLogger("biggraph")


def gpu_processes(num_gpus: int, device: str, cards: int, launched_by_torchrun: bool) -> int:
    """Trainer processes for this machine. Under torchrun the launcher already chose them; on the CPU there is
    one (its Hogwild workers are inside it)."""
    if launched_by_torchrun or device == "cpu" or num_gpus <= 1:
        return 1
    return max(1, min(num_gpus, cards))


def partition_advice(config: ConfigSchema, processes: int) -> str:
    """Why some of ``processes`` trainers would wait: a bucket locks its partitions, so with P partitions at
    most about P/2 buckets train at once (PBG's GPU trainer asks for 2 partitions per GPU for the same reason)."""
    most = max((e.num_partitions for e in config.entities.values()), default=1)
    if most >= 2 * processes:
        return ""
    return (f"{processes} GPU processes but at most {most} partitions per entity type: buckets hold their partitions, "
            f"so some GPUs will wait; use num_partitions >= {2 * processes}")


def relaunch_one_process_per_gpu(processes: int, argv: list[str]) -> int:
    """Run this same command line (``argv``, without the program name) as a ``torchrun --standalone`` group, through
    the pods' launcher so that the trainers start from warm spares as they do in a pod."""
    logger.info("training with %d processes, one per GPU (torchrun --standalone)", processes)
    command = [sys.executable, "-m", "job.train.elastic.agent", "--standalone", f"--nproc_per_node={processes}",
               "-m", "job", *argv]
    return subprocess.call(command)


def launch(config: ConfigSchema, argv: list[str], take_over: bool = False) -> int:
    """What ``biggraph train`` does once its config is read: train in this process, or, with several GPUs and no
    torchrun around it, re-launch itself as one process per GPU. Returns the exit code."""
    import torch

    from job.train import train

    launched_by_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    cards = torch.cuda.device_count() if torch.cuda.is_available() else 0
    processes = gpu_processes(config.num_gpus, config.device, cards, launched_by_torchrun)
    if 0 < cards < config.num_gpus and not launched_by_torchrun and config.device != "cpu":
        logger.warning("num_gpus=%d but this machine has %d GPU(s): training with %d", config.num_gpus, cards, cards)
    if processes > 1:
        advice = partition_advice(config, processes)
        if advice:
            logger.warning(advice)
        return relaunch_one_process_per_gpu(processes, argv)
    train(config, take_over=take_over)
    return 0
