"""The paper's synthetic sets with known answers (§6.1 and an imbalanced cascade case)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[np.float64]

#: Column order of :func:`quadrants`: the four expensive quadrant features, then sign(x),
#: sign(z) (the order of the paper's Fig. 5).
QUADRANT_COLUMNS = ("z++", "z+-", "z-+", "z--", "sign_x", "sign_z")
QUADRANT_COSTS = (10.0, 10.0, 10.0, 10.0, 1.0, 1.0)
# Label means per quadrant (sign x, sign z): higher where z < 0, as the paper asks; within
# each half sign(x) moves the mean by 4 in opposite directions, so sign(x) tells nothing at
# the root and everything one level down.
QUADRANT_MEANS = {(1, 1): -10.0, (-1, 1): -6.0, (1, -1): 10.0, (-1, -1): 6.0}


def quadrants(n: int, seed: int = 0) -> tuple[Array, Array]:
    """X, Z uniform on [-1, 1]²; cheap features sign(x), sign(z) (cost 1); four expensive
    ones (cost 10), each equal to the label in its own quadrant and that quadrant's mean
    plus N(0, 5²) noise elsewhere; labels Gaussian (variance 1) around the quadrant's mean."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, n)
    z = rng.uniform(-1, 1, n)
    sx = np.where(x > 0, 1.0, -1.0)
    sz = np.where(z > 0, 1.0, -1.0)
    mean = np.asarray([QUADRANT_MEANS[(int(a), int(b))] for a, b in zip(sx, sz, strict=True)])
    y = mean + rng.normal(size=n)
    cols = []
    for qx, qz in ((1, 1), (1, -1), (-1, 1), (-1, -1)):
        inside = (sx == qx) & (sz == qz)
        # Elsewhere: noise around the quadrant's own mean, so the feature tells nothing
        # about which quadrant a row is in (only its own quadrant's exact label).
        cols.append(np.where(inside, y, QUADRANT_MEANS[(qx, qz)] + rng.normal(0, 5, n)))
    X = np.column_stack([*cols, sx, sz])
    return X, y


def imbalanced_cascade(n: int, seed: int = 0, positive_rate: float = 0.05) -> tuple[Array, Array]:
    """A binary set whose cheap feature 0 (cost 1) rejects most negatives: negatives are
    N(-2, 1) on it with probability 0.9 and look like positives otherwise; positives are
    N(+1, 1). Features 1-3 (cost 10 each) separate the rest: each is the label's sign plus
    N(0, 1.5²) noise. A cascade reads feature 0 for everything and the expensive ones only
    for the few rows that pass."""
    rng = np.random.default_rng(seed)
    y = (rng.uniform(size=n) < positive_rate).astype(int)
    easy = (y == 0) & (rng.uniform(size=n) < 0.9)
    f0 = np.where(easy, rng.normal(-2.0, 1.0, n), rng.normal(1.0, 1.0, n))
    sign = np.where(y == 1, 1.0, -1.0)
    rest = [sign + rng.normal(0, 1.5, n) for _ in range(3)]
    return np.column_stack([f0, *rest]), y
