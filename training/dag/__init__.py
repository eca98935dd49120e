"""The adaptive sensor-acquisition DAG (Wang, Trapeznikov & Saligrama, NIPS 2015).

:mod:`~training.dag.sensors` checks the sensors and the data, :mod:`~training.dag.subsets` is
Alg. 2, :mod:`~training.dag.policies` the filter-tree policies, :mod:`~training.dag.estimator`
the estimator (Graph-Reduce), :mod:`~training.dag.sweep` one model per cost scale.
"""

from training.dag.estimator import DagClassifier
from training.dag.policies import decide_nodes
from training.dag.subsets import SubsetSelection, select_subsets
from training.dag.sweep import sweep

__all__ = ["DagClassifier", "SubsetSelection", "decide_nodes", "select_subsets", "sweep"]
