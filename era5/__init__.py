"""Preparing public ERA5 offline into the data layout that training reads (docs/real_era5.md):
`python -m era5.prepare`. No training, scoring or planning process imports this package."""
