"""torch tensors as kvc KV: the dtypes kvc stores bit-exactly and numpy views of CPU tensors (for the engine adapters)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from catalog.identity import DType

DTYPES: dict[torch.dtype, DType] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}


def torch_dtype(dtype: str) -> torch.dtype:
    return next(t for t, name in DTYPES.items() if name == dtype)


def numpy_view(t: torch.Tensor) -> np.ndarray[Any, Any]:
    """A numpy view of a CPU tensor (bfloat16 as its uint16 bit patterns): no copy."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()
