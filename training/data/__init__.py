"""Training data: the rendered digits, the synthetic sets, the UCI and CSV loaders."""
