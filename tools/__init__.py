"""Tools beside the training scripts (plots of finished runs)."""
