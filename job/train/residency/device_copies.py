"""A GPU partition store's copies, on a CUDA stream of their own: uploads while a bucket trains, downloads that do
not wait behind the training kernels.

Training runs on the device's current (default) stream. A copy issued there, from whatever thread, is queued
behind every kernel the training thread issued before it: an eviction's ``.cpu()`` in the I/O thread waited for
the next bucket's batches (bench/RESULTS.md, "Training on a GPU"), and an upload on the training thread held the
batches back for its whole transfer. Here both go on one side stream, ordered with events:

- an **upload** (``upload``, called in the I/O thread with a partition read ahead) allocates the device table on
  the side stream and copies into it; the training thread's ``ready`` makes its stream wait for the copy's event
  (no host wait) and marks the table as used by that stream, so that the caching allocator does not hand its memory
  to the side stream again before training is done with it;
- a **download** (``mark`` on the training thread when the table is let go, ``to_host`` wherever the write runs)
  waits, on the side stream, for the event recorded when the table was let go: what training wrote before it, and
  nothing issued after.

Host memory is ordinary (pageable): the driver stages such copies itself, and pinning a multi-GiB partition costs
more than it saves for a copy made once per swap. The thread that issues a copy waits for it; the training
thread never does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass
class Uploaded:
    """Device tensors whose copy was issued on the side stream; ``ready`` before use."""

    tensors: list[Tensor]
    event: torch.cuda.Event


class DeviceCopies:
    """The side stream of one GPU's partition store (one per store: its copies are issued from the training thread
    and the store's one I/O thread, never concurrently with themselves)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.uploads = 0  # issued on the side stream (tests read them)
        self.downloads = 0

    def upload(self, *host: Tensor) -> Uploaded:
        """``host`` tensors copied to the device on the side stream; returns once the copies are issued (a pageable
        source: once the driver has staged it)."""
        with torch.cuda.stream(self.stream):
            tensors = [torch.empty(t.shape, dtype=t.dtype, device=self.device) for t in host]
            for out, source in zip(tensors, host):
                out.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.uploads += 1
        return Uploaded(tensors, event)

    def fill_normal(self, shape: tuple[int, int], seed: int, std: float) -> Uploaded:
        """A fresh table drawn from N(0, std²) on the device, by the device's generator seeded with ``seed``, on the
        side stream (``ready`` before use, as an upload)."""
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        with torch.cuda.stream(self.stream):
            table = torch.empty(shape, dtype=torch.float32, device=self.device)
            table.normal_(0.0, 1.0, generator=generator).mul_(std)
            event = torch.cuda.Event()
            event.record(self.stream)
        return Uploaded([table], event)

    def ready(self, uploaded: Uploaded) -> list[Tensor]:
        """On the training thread: its stream waits for the upload (the host does not), and the tables are marked as
        used there (freeing them later waits for that stream's work, not only the side stream's)."""
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(uploaded.event)
        for tensor in uploaded.tensors:
            tensor.record_stream(compute)
        return uploaded.tensors

    def mark(self) -> torch.cuda.Event:
        """On the training thread, when a table is let go: an event after everything training issued on it."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def to_host(self, tensor: Tensor, after: Optional[torch.cuda.Event] = None) -> Tensor:
        """``tensor`` in host memory, copied on the side stream once ``after`` (``mark``'s event; None: now, on the
        calling thread's stream's order) has happened; returns when the copy is complete."""
        if after is None:
            after = self.mark()
        self.stream.wait_event(after)
        with torch.cuda.stream(self.stream):
            host = torch.empty(tensor.shape, dtype=tensor.dtype)
            host.copy_(tensor.detach())  # synchronous for this thread, queued on the side stream only
        self.downloads += 1
        return host
