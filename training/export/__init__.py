"""ONNX export: scikit-learn models, gating graphs, DAG policies."""
