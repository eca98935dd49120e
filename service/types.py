"""Type aliases and the one polynomial evaluator shared across the service."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

FloatVector = npt.NDArray[np.float32]
FloatArray = npt.NDArray[np.float64]


def horner(coefficients: Sequence[float] | FloatArray, n: float) -> float | FloatArray:
    """Power-basis polynomial(s), constant first, at ``n``. A 1-D sequence gives a float
    (pure Python: fastest for the few terms cost curves have); a 2-D array gives one value
    per row."""
    if isinstance(coefficients, np.ndarray) and coefficients.ndim == 2:
        values = np.zeros(coefficients.shape[0])
        for k in range(coefficients.shape[1] - 1, -1, -1):
            values = values * n + coefficients[:, k]
        return values
    total = 0.0
    for c in reversed(list(coefficients)):
        total = total * n + float(c)
    return total
