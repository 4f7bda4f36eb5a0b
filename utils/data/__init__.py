"""The data package moved to the top-level `data/`; this keeps the documented command
`python -m utils.data.prepare_era5` working (utils/data/prepare_era5.py)."""
