"""Cost-sensitive trees and cascades of classifiers (paper 003): CSTC, CSCC, Cronus."""

from training.cstc.estimator import CSTCClassifier, CSTCRegressor

__all__ = ["CSTCClassifier", "CSTCRegressor"]
