"""The 20 channels of the tutorial's ERA5 layout and what each is called elsewhere.

One table, in the data contract's channel order: the tutorial's short name, the variable
name of the WeatherBench-2 / ARCO-ERA5 Zarr stores (which WeatherBench-2 also uses for
forecasts and scores), the short name of the Copernicus CDS NetCDF files, the pressure
level in hPa (None: a single-level field) and the physical units of the prepared files
(CF style, as the public stores write them). Geopotential stays geopotential (m2/s2), not
geopotential height. Relative humidity is in percent in the prepared files whatever the
source (the CDS `r` is percent, WeatherBench-2's `relative_humidity` a fraction, told
apart by the units attribute or, without one, by the values' range: `humidity_scale`);
forecasts and truth written for WeatherBench-2 are in its convention (`wb2_units`). Which
definition of relative humidity a file holds (ECMWF's or WeatherBench-2's) is another
matter: data/humidity.py.

Besides the 20 stored channels, the evaluation scores one derived variable that
WeatherBench-2 reports among its headline scores: 10 m wind speed, sqrt(u10^2 + v10^2).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from utils.errors import DataError


class Channel(NamedTuple):
    name: str          # the tutorial's name, e.g. "z500"
    variable: str      # WeatherBench-2 / ARCO-ERA5 name, e.g. "geopotential"
    short: str         # CDS NetCDF name, e.g. "z"
    level: int | None  # hPa; None for single-level fields
    units: str


CHANNELS: tuple[Channel, ...] = (
    Channel("u10", "10m_u_component_of_wind", "u10", None, "m s**-1"),
    Channel("v10", "10m_v_component_of_wind", "v10", None, "m s**-1"),
    Channel("t2m", "2m_temperature", "t2m", None, "K"),
    Channel("sp", "surface_pressure", "sp", None, "Pa"),
    Channel("msl", "mean_sea_level_pressure", "msl", None, "Pa"),
    Channel("t850", "temperature", "t", 850, "K"),
    Channel("u1000", "u_component_of_wind", "u", 1000, "m s**-1"),
    Channel("v1000", "v_component_of_wind", "v", 1000, "m s**-1"),
    Channel("z1000", "geopotential", "z", 1000, "m**2 s**-2"),
    Channel("u850", "u_component_of_wind", "u", 850, "m s**-1"),
    Channel("v850", "v_component_of_wind", "v", 850, "m s**-1"),
    Channel("z850", "geopotential", "z", 850, "m**2 s**-2"),
    Channel("u500", "u_component_of_wind", "u", 500, "m s**-1"),
    Channel("v500", "v_component_of_wind", "v", 500, "m s**-1"),
    Channel("z500", "geopotential", "z", 500, "m**2 s**-2"),
    Channel("t500", "temperature", "t", 500, "K"),
    Channel("z50", "geopotential", "z", 50, "m**2 s**-2"),
    Channel("r500", "relative_humidity", "r", 500, "%"),
    Channel("r850", "relative_humidity", "r", 850, "%"),
    Channel("tcwv", "total_column_water_vapour", "tcwv", None, "kg m**-2"),
)
CHANNEL_NAMES: tuple[str, ...] = tuple(c.name for c in CHANNELS)

# Derived variables the evaluation scores beside the channels: name -> (WeatherBench-2
# name, units, the channels it is computed from).
WIND_SPEED = Channel("ws10", "10m_wind_speed", "si10", None, "m s**-1")
DERIVED: tuple[Channel, ...] = (WIND_SPEED,)
WIND_COMPONENTS = ("u10", "v10")

# WeatherBench-2's headline variables (its scorecards), in the tutorial's names.
HEADLINE = ("z500", "t850", "t2m", "u10", "v10", "ws10", "msl")

_BY_NAME = {c.name: c for c in (*CHANNELS, *DERIVED)}


def channel(name: str) -> Channel | None:
    """The table's row of a tutorial channel name (or a derived variable), else None."""
    return _BY_NAME.get(name)


def channel_label(c: int) -> str:
    """`channel 3 (sp)`: the ERA5 layout's channel names, in the data contract's order."""
    return f"channel {c} ({CHANNEL_NAMES[c]})" if c < len(CHANNEL_NAMES) else f"channel {c}"


def units_of(name: str) -> str:
    """The units of a channel (or derived variable) in the prepared files; '' for a channel
    outside the table."""
    c = channel(name)
    return "" if c is None else c.units


def wb2_label(name: str) -> str:
    """How WeatherBench-2 names a channel in its results: 'geopotential 500 hPa',
    '2m_temperature'; the name itself for a channel outside the table."""
    c = channel(name)
    if c is None:
        return name
    return c.variable if c.level is None else f"{c.variable} {c.level} hPa"


# WeatherBench-2's units where they differ from the prepared files': variable -> (units,
# factor from the prepared files' values). Its relative humidity is a fraction.
_WB2_UNITS = {"relative_humidity": ("1", 0.01)}
_PERCENT = ("%", "percent", "pct")
_FRACTION = ("1", "0-1", "(0 - 1)", "fraction", "dimensionless")
# The range that tells relative humidity without units apart: the largest value of a field.
FRACTION_AT_MOST, PERCENT_AT_LEAST, PERCENT_AT_MOST = 1.5, 5.0, 200.0


def wb2_units(variable: str) -> tuple[str, float]:
    """(units, factor) of a variable in WeatherBench-2's convention: its values there are
    the prepared files' times the factor."""
    if variable in _WB2_UNITS:
        return _WB2_UNITS[variable]
    units = next((c.units for c in (*CHANNELS, *DERIVED) if c.variable == variable), "")
    return units, 1.0


def humidity_scale(name: str, units: str | None, where: str,
                   sample: np.ndarray | None = None) -> float:
    """The factor that turns a source's relative humidity `name` into percent: from its
    `units` attribute, else from the range of `sample` (some of its values): a fraction
    peaks near 1 (up to ~1.1 where the air is supersaturated), percent near 100. A field
    without units whose range says neither (its largest value between 1.5 and 5) is
    refused: give the variable a units attribute."""
    text = (units or "").strip().lower()
    if text in _PERCENT:
        return 1.0
    if text in _FRACTION:
        return 100.0
    if text:
        raise DataError(f"{where}: '{name}' has units '{units}'; relative humidity must be "
                        f"in percent ({' or '.join(_PERCENT[:2])}) or a fraction (1)")
    values = np.asarray(sample if sample is not None else [], dtype=np.float64)
    values = values[np.isfinite(values)]
    if not len(values):
        raise DataError(f"{where}: '{name}' has no units attribute and no finite value to "
                        "tell a fraction from percent; give it units ('%' or '1')")
    lo, hi = float(values.min()), float(values.max())
    if hi <= FRACTION_AT_MOST:
        return 100.0
    if PERCENT_AT_LEAST <= hi <= PERCENT_AT_MOST:
        return 1.0
    raise DataError(f"{where}: '{name}' has no units attribute and values {lo:.3g} .. "
                    f"{hi:.3g}, neither a fraction (at most {FRACTION_AT_MOST:g}) nor "
                    f"percent ({PERCENT_AT_LEAST:g} .. {PERCENT_AT_MOST:g}); give it units "
                    "('%' or '1')")
