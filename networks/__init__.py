from networks.factory import build_model, training_flops

__all__ = ["build_model", "training_flops"]
