"""Loading untrusted legacy ``.pt`` files: ``torch.load(weights_only=True)`` only, with one-line errors.

SECURITY: every ``.pt`` file is untrusted. The weights-only unpickler builds tensors
(``nn.Parameter`` included), numbers, strings and containers; anything else (a custom class,
a ``__reduce__`` calling a function) is refused with an error naming the file, and there is
no fallback to full unpickling. torch is imported inside the functions: it takes seconds,
and the command line imports this package to build its parser.
"""

from __future__ import annotations

import pickle
import re
import warnings
import zipfile
from typing import TYPE_CHECKING, Any

import storage_adapters as storage
from job.errors import InputFormatError

if TYPE_CHECKING:
    import numpy as np

_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")


class LegacyFormatError(InputFormatError):
    """A legacy file is unreadable, unsafe or not what the legacy format says it is."""


def safe_torch_load(url: str) -> Any:
    """``torch.load(weights_only=True)`` of a URL, with one-line errors naming the file.

    Never falls back to unrestricted unpickling: a legacy file that needs it is refused.
    """
    import torch  # heavy: job.data.legacy loads with the command line, torch only when converting

    try:
        with storage.local_copy_for_reading(url) as path, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "pickle protocol 4" notices from the weights-only unpickler
            return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise LegacyFormatError(url, "missing", expected="a torch.save file") from None
    except pickle.UnpicklingError as err:
        text = str(err)
        match = _GLOBAL_RE.search(text)
        if match is None and "Unsupported operand" in text:
            raise LegacyFormatError(
                url, "not a readable torch.save file (not a pickle the weights-only loader knows)", expected="a torch.save file"
            ) from None
        what = f"it references '{match.group(1)}'" if match else "it holds objects other than tensors and plain values"
        raise LegacyFormatError(
            url,
            f"refused to load: {what}, and biggraph loads .pt files only with torch.load(weights_only=True) "
            "because unpickling arbitrary objects can run code",
            expected="tensors, numbers, strings and containers of them",
        ) from None
    except (RuntimeError, EOFError, ValueError, OSError, zipfile.BadZipFile, AttributeError, ImportError) as err:
        problem = f"not a readable torch.save file ({first_line(err)})"
        raise LegacyFormatError(url, problem, expected="a torch.save file") from None


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:160] if text else type(err).__name__


def as_count(value: Any, url: str) -> int:
    """A legacy count: a torch.save'd int (or a one-element integer tensor)."""
    import torch  # heavy: only when converting (see safe_torch_load)

    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point() and value.dtype != torch.bool:
        value = int(value.item())
    if not isinstance(value, int) or isinstance(value, bool):
        raise LegacyFormatError(url, f"holds a {type(value).__name__}", expected="a torch.save'd non-negative integer")
    if value < 0:
        raise LegacyFormatError(url, f"negative count {value}", expected="a torch.save'd non-negative integer")
    return value


def to_numpy(value: Any, url: str, what: str) -> np.ndarray:
    import torch  # heavy: only when converting (see safe_torch_load)

    if not isinstance(value, torch.Tensor):
        raise LegacyFormatError(url, f"{what} is a {type(value).__name__}", expected="a tensor")
    return value.detach().cpu().numpy()
