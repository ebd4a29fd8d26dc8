"""The precision of the training step's products (``compute_dtype``), resolved once per trainer.

Only the scores and the large matrix products behind them run in the reduced precision: the
embeddings, their gradients, the loss and the Adagrad state stay float32 (``job.model.fused`` casts
the prepared rows down for each product and the product back up). A dtype is refused where the
device has no native kernels for it: emulated bfloat16 on a CPU without AVX512-BF16/AMX is several
times slower than float32, which is the opposite of what the key is for.

PBG's ``half_precision`` (GPU only there) means the same on a GPU when ``compute_dtype`` is unset:
bfloat16 where the card has it (its float32 exponent range needs no loss scaling), else float16
(scores stay far inside float16's range: the masked entries and the loss are float32). On the CPU
it is ignored with a warning, as PBG never ran it there: ``compute_dtype`` asks for it explicitly.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from job.config import ConfigKeyError, ConfigSchema

logger = logging.getLogger("biggraph")


def _cpu_has(name: str) -> bool:
    """Whether oneDNN has native kernels for this dtype on this CPU (AVX512-BF16/AMX, AVX512-FP16/AMX-FP16)."""
    check = torch.ops.mkldnn._is_mkldnn_bf16_supported if name == "bfloat16" else \
        torch.ops.mkldnn._is_mkldnn_fp16_supported
    return bool(torch.backends.mkldnn.is_available() and check())


def _cuda_has(name: str) -> bool:
    """Whether the current card computes in this dtype natively (bfloat16 from compute capability 8.0)."""
    return name == "float16" or torch.cuda.is_bf16_supported(including_emulation=False)


def device_supports(name: str, device: torch.device) -> bool:
    """Whether ``device`` has native kernels for the dtype called ``name``."""
    if name == "float32":
        return True
    return _cuda_has(name) if device.type == "cuda" else _cpu_has(name)


def training_dtype(config: ConfigSchema, device: torch.device) -> Optional[torch.dtype]:
    """The dtype of the training products on ``device``; None: the embeddings' own (float32).

    Raises ``ConfigKeyError`` naming ``compute_dtype`` when the device cannot compute in it.
    """
    name = config.compute_dtype
    if name == "auto":  # the fastest this device computes natively (preset: quality)
        name = "bfloat16" if device_supports("bfloat16", device) else "float32"
        logger.info("compute_dtype auto: the training step computes its scores in %s", name)
    if name is None:
        if not config.half_precision:
            return None
        if device.type != "cuda":
            logger.warning("half_precision is ignored on the CPU (PBG uses it on GPUs only): training in float32; "
                           "set compute_dtype: bfloat16 to compute the scores in bfloat16")
            return None
        name = "bfloat16" if _cuda_has("bfloat16") else "float16"
        logger.info("half_precision: the training step computes its scores in %s", name)
    if not device_supports(name, device):
        where = "this GPU" if device.type == "cuda" else "this CPU"
        hint = ("bfloat16 needs a GPU of compute capability 8.0 (Ampere) or later" if device.type == "cuda" else
                "it needs AVX512-BF16 or AMX (bfloat16) / AVX512-FP16 or AMX-FP16 (float16); emulated, it would "
                "be slower than float32")
        raise ConfigKeyError(
            f"config key 'compute_dtype': {where} has no native {name} kernels ({hint}); use 'float32'"
            + (" or 'bfloat16'" if name == "float16" and device_supports("bfloat16", device) else ""),
            ["compute_dtype"],
        )
    return None if name == "float32" else getattr(torch, name)
