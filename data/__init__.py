"""Data: the ERA5 loaders (PyTorch and DALI) and the synthetic ERA5-like generator."""
