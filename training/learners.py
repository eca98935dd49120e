"""The black-box learner trained per feature set (any scikit-learn classifier works)."""

from __future__ import annotations

from typing import Any

from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import StandardScaler


def default_learner(
    *, C: float = 0.5, max_iter: int = 500, tol: float = 1e-3, seed: int = 0
) -> Any:
    """Standardise, then multinomial logistic regression: fast to fit, exact in ONNX."""
    return Pipeline(
        [
            ("scale", StandardScaler()),
            ("clf", LogisticRegression(C=C, max_iter=max_iter, tol=tol, random_state=seed)),
        ]
    )
