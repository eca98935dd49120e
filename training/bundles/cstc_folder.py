"""CSTC / CSCC trees (paper 003) on the image extractors, from the user's own labelled folder
(``budgetserve-train cstc-images``): ``cstc-digits`` generalised the same way as the Poly-Dom
digits builder was (:mod:`training.bundles.folder`).

The folder is read, split and extracted exactly as ``budgetserve-train images`` does (same
held-out images for the same folder, seed and ``--test``); the training images are split
again, stratified and keeping byte-identical files together, into the images that fit the
trees and those that choose the operating points (the validation Pareto set). Each feature
group is charged its cost curve c_f(n): profiled on the user's images on this machine, or
read from a bundle (``--costs-from``, e.g. the Poly-Dom bundle built from the same folder, so
both charge the same). Then :func:`training.bundles.cstc_digits.build_cstc_image_bundle`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import numpy.typing as npt

from training.bundles.cstc_digits import (
    CstcImageConfig,
    CstcImageResult,
    ImageRows,
    build_cstc_image_bundle,
    costs_from_bundle,
)
from training.bundles.folder import (
    FolderConfig,
    FolderData,
    extract_features,
    image_channels,
    profile_folder,
    read_folders,
)
from training.bundles.images import FeatureData
from training.executor import INLINE, Executor

Progress = Callable[[str, int, int], None]


def _noop(stage: str, done: int, total: int) -> None:
    return None


def folder_rows(
    data: FolderData, features: FeatureData, validation_fraction: float, seed: int
) -> ImageRows:
    """The folder's features as :class:`ImageRows`: the training images split into fitting
    and validation images (stratified, byte-identical files together), the held-out images
    as they are."""
    from sklearn.model_selection import StratifiedGroupKFold

    identity = np.unique(data.digests, return_inverse=True)[1].astype(np.int64)
    train = data.train
    folds = max(2, round(1 / validation_fraction))
    labels = data.labels[train]
    if np.bincount(labels).min() < folds:
        folds = max(2, int(np.bincount(labels).min()))
    splitter = StratifiedGroupKFold(folds, shuffle=True, random_state=seed)
    fit_at, val_at = next(splitter.split(np.zeros(len(train)), labels, identity[train]))
    groups: list[list[int]] = []
    start = 0
    for name in features.names:
        width = features.blocks[name].shape[1]
        groups.append(list(range(start, start + width)))
        start += width
    x: npt.NDArray[np.float64] = np.hstack([features.blocks[n] for n in features.names]).astype(
        np.float64
    )
    return ImageRows(
        names=list(features.names),
        groups=groups,
        X=x,
        labels=data.labels,
        sizes=data.sizes,
        identity=identity,
        fit=np.sort(train[fit_at]).astype(np.int64),
        validation=np.sort(train[val_at]).astype(np.int64),
        test=data.test,
        fingerprint=features.fingerprint,
        classes=data.train_folder.classes,
    )


def build_cstc_folder_bundle(
    out_dir: Path,
    folder: FolderConfig,
    trees: CstcImageConfig,
    *,
    costs_from: Path | None = None,
    progress: Progress = _noop,
    executor: Executor = INLINE,
) -> CstcImageResult[ImageRows]:
    """Read, profile (or read the curves of ``costs_from``), extract, fit and write."""
    from threadpoolctl import threadpool_limits

    folder.check()
    features = [c.create() for c in folder.choices()]
    channels = image_channels(features, folder)
    trees = replace(
        trees,
        name=folder.name,
        extractors=tuple(f.name for f in features),
        max_pixels=folder.max_pixels,
        min_side=folder.min_side,
        channels=channels,
        seed=folder.seed,
    )
    trees.check()
    costs = costs_from_bundle(costs_from, trees.extractors) if costs_from else None
    data = read_folders(folder, progress)
    with threadpool_limits(1):
        if costs is None:
            costs = profile_folder(data, features, folder, channels, progress)
        extracted = extract_features(data, features, folder, channels, progress)
        rows = folder_rows(data, extracted, trees.validation_fraction, folder.seed)
        return build_cstc_image_bundle(
            out_dir,
            trees,
            features,
            costs,
            rows,
            executor=executor,
            parameters={
                "source": "image folder",
                "costs": f"from {costs_from}" if costs_from else "profiled on the folder",
                "split": "test folder" if folder.test else f"{folder.test_fraction:.0%} held out",
                "images": {
                    "fit": len(rows.fit),
                    "validation": len(rows.validation),
                    "test": len(rows.test),
                },
            },
        )
