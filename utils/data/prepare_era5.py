"""`python -m utils.data.prepare_era5 ...`, the command earlier docs give: the same as
`python -m data.prepare_era5 ...` (data/prepare_era5.py), which it runs."""

from data.prepare_era5 import cli

if __name__ == "__main__":
    cli()
