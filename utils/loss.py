"""Training loss of the tutorial: relative L2 error per sample, averaged over the batch."""

import torch


def l2_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """mean_b ||pred_b - target_b||_2 / ||target_b||_2 over all channels and pixels.

    Computed in fp32 even under autocast: the norms sum ~10^5 squares.
    """
    b = pred.shape[0]
    diff = (pred.float() - target.float()).reshape(b, -1)
    return (diff.norm(dim=1) / target.float().reshape(b, -1).norm(dim=1)).mean()
