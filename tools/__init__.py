"""Tools beside the training scripts: plots of finished runs, the config reference, the
README walked (`make tutorial`), and the first GPU run's check (`make gpu-check`)."""
