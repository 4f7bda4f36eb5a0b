"""The config's checks across keys: a section whose keys are each valid (utils/config_schema.py
checks them one by one) but do not fit together, e.g. a tp that does not divide the heads,
an AFNO split with tp, an ensemble with a deterministic loss. Each check raises ValueError
with one line that names the keys, their values and what would fit; `validate` turns it
into the section's ConfigError.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from utils.parallel_axes import BY_NAME, config_sizes, parse_axes

if TYPE_CHECKING:
    from utils.config_schema import Config


def check_across_keys(c: Config) -> None:
    """Run every check on a config whose keys are each valid (the schema's after-validator)."""
    for check in (_check_patches, _check_widths, _check_layout, _check_splits,
                  _check_channels, _check_rollout, _check_ensemble, _check_data_parallel):
        check(c)


def _check_patches(c: Config) -> None:
    (H, W), p = c.img_size, c.patch_size
    if H % p or W % p:
        raise ValueError(f"img_size {H}x{W} is not a multiple of patch_size {p}")


def _check_widths(c: Config) -> None:
    # tp splits the heads and the embedding (and with it the MLP's hidden units).
    if c.model == "vit" and c.embed_dim % c.num_heads:
        raise ValueError(f"embed_dim {c.embed_dim} is not divisible by num_heads {c.num_heads}")
    if c.afno_variant == "fourcastnet" and (c.model != "afno"
                                            or c.hard_thresholding_fraction != 1.0):
        raise ValueError(f"afno_variant fourcastnet is an AFNO with hard_thresholding_fraction "
                         f"1 (FourCastNet's), got model {c.model}, hard_thresholding_fraction "
                         f"{c.hard_thresholding_fraction}")
    if c.model == "afno" and c.embed_dim % c.num_blocks:
        raise ValueError(f"embed_dim {c.embed_dim} is not divisible by "
                         f"num_blocks {c.num_blocks}")
    for key in ("num_heads", "embed_dim") if c.model == "vit" else ("embed_dim",):
        if getattr(c, key) % c.tp:
            raise ValueError(f"{key} {getattr(c, key)} is not divisible by tp {c.tp} (--tp): "
                             "choose a tp that divides it")
    hidden = int(c.embed_dim * c.mlp_ratio)
    if c.model == "vit" and hidden % c.tp:
        raise ValueError(f"the MLP's {hidden} hidden units (embed_dim {c.embed_dim} x mlp_ratio "
                         f"{c.mlp_ratio}) are not divisible by tp {c.tp} (--tp)")


def _check_splits(c: Config) -> None:
    (H, W), p = c.img_size, c.patch_size
    rows, cols = H // p, W // p
    if c.cp > rows * cols:
        raise ValueError(f"cp {c.cp} is larger than the {rows * cols} tokens of img_size "
                         f"{H}x{W} with patch_size {p}")
    for key, n, what in (("h_parallel_size", rows, "rows"), ("w_parallel_size", cols, "columns")):
        if getattr(c, key) > n:
            raise ValueError(f"{key} {getattr(c, key)} is larger than the {n} token {what} "
                             f"of img_size {H}x{W} with patch_size {p}")
    if c.model == "afno" and c.w_parallel_size > c.num_blocks:
        # the spectrum's channels are split over w in whole blocks, at least one per rank
        raise ValueError(f"w_parallel_size {c.w_parallel_size} is larger than num_blocks "
                         f"{c.num_blocks}: each w rank holds whole channel blocks of the spectrum")
    order = parse_axes(c.parallel_order)
    missing = [a for a, n in config_sizes(c).items() if n > 1 and a not in order]
    if missing:
        dp = order.index("dp")
        suggested = "-".join(order[:dp] + missing + order[dp:])
        raise ValueError(f"parallel_order '{c.parallel_order}' leaves out {', '.join(missing)} "
                         f"({', '.join(BY_NAME[a].key or a for a in missing)} > 1): name it "
                         f"in the config's parallel_order, e.g. '{suggested}'")


def _check_channels(c: Config) -> None:
    # The model forecasts the fields it reads: the target is the input t + dt, and a rollout
    # (the multi-step loss, inference) feeds each forecast back in as the next input.
    if c.n_out_channels != c.n_in_channels:
        raise ValueError(f"n_out_channels {c.n_out_channels} differs from n_in_channels "
                         f"{c.n_in_channels}: the model forecasts the fields it reads (each "
                         "forecast is the next step's input); set both to the data's channels")


def _check_rollout(c: Config) -> None:
    if c.rollout_steps > 1 and c.data_loader_config == "dali":
        raise ValueError(f"rollout_steps {c.rollout_steps} needs data_loader_config pytorch "
                         "(the DALI pipeline reads one target per sample)")


def _check_ensemble(c: Config) -> None:
    from utils.config_schema import ENSEMBLE_DEFAULT  # the schema imports this module
    E, ens = c.ensemble_size, c.ensemble_parallel_size
    if c.loss == "crps" and E == 1:
        raise ValueError(f"loss crps scores an ensemble, but ensemble_size is 1 (one member "
                         f"has no spread to score): set ensemble_size > 1 (default "
                         f"{ENSEMBLE_DEFAULT} with crps), or a deterministic loss")
    if E > 1 and c.loss != "crps":
        raise ValueError(f"ensemble_size {E} trains an ensemble, which loss {c.loss} cannot "
                         "score (every member would learn the same mean): use loss crps")
    if E % ens:
        raise ValueError(f"ensemble_size {E} is not divisible by ensemble_parallel_size "
                         f"{ens}: each ens rank holds ensemble_size / ensemble_parallel_size "
                         "members of every sample")


def _check_data_parallel(c: Config) -> None:
    if c.fsdp and c.noddp:
        raise ValueError("fsdp shards the gradients over the data-parallel ranks, noddp skips "
                         "their reduction: choose one (--fsdp or --noddp)")


def _check_layout(c: Config) -> None:
    # Each model has its own model parallelism: the ViT splits matmuls and the sequence
    # (tp, cp), the AFNO splits its grid over the h x w mesh (a distributed FFT).
    h, w = c.h_parallel_size, c.w_parallel_size
    if c.model == "afno" and c.tp * c.cp > 1:
        raise ValueError(f"model afno splits its grid over h_parallel_size x w_parallel_size, "
                         f"not tp/cp: got tp {c.tp}, cp {c.cp} (use --h_parallel_size, "
                         "--w_parallel_size)")
    if c.model == "vit" and h * w > 1:
        raise ValueError(f"h_parallel_size {h} x w_parallel_size {w} split the AFNO's grid; "
                         "model vit is split with tp and cp (or use model afno)")
