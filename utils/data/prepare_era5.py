"""`python -m utils.data.prepare_era5 ...`, the command earlier docs give: the same as
`python -m era5.prepare ...` (era5/prepare.py), which it runs as the main module."""

import runpy

if __name__ == "__main__":
    runpy.run_module("era5.prepare", run_name="__main__", alter_sys=True)
