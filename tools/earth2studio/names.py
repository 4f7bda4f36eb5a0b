"""What Earth2Studio calls this project's channels, and the grids it can name.

Earth2Studio names a variable by a short id of its lexicon (`earth2studio.lexicon.base.
E2STUDIO_VOCAB`): `u10m` for the 10 m wind's u component, `t850` for temperature at 850 hPa,
`z500` for geopotential (m2/s2) at 500 hPa, `r500` for relative humidity in percent, `tcwv`
... in the units the prepared files hold (data/era5_names.py). The tutorial's pressure-level
and most single-level names are Earth2Studio's already; the 10 m winds gain their `m`.
FourCastNet's six further channels (Earth2Studio's FCN: 100 m winds, and u, v, z, t at
250 hPa) are in the table under Earth2Studio's own names, for a data set that carries them.

Earth2Studio's grids run north to south (`lat` 90 .. -90) and east from Greenwich (`lon` in
[0, 360)). A model whose channel or grid falls outside that is refused in one line that
says which. The table is checked against Earth2Studio's lexicon where it is installed
(tests/earth2studio).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from utils.errors import ConfigError

# Tutorial channel name -> Earth2Studio variable id (data/era5_names.py: the 20 channels in
# the data contract's order; then FourCastNet's 26-channel set's other six).
EARTH2STUDIO_NAMES: dict[str, str] = {
    "u10": "u10m", "v10": "v10m", "t2m": "t2m", "sp": "sp", "msl": "msl", "t850": "t850",
    "u1000": "u1000", "v1000": "v1000", "z1000": "z1000", "u850": "u850", "v850": "v850",
    "z850": "z850", "u500": "u500", "v500": "v500", "z500": "z500", "t500": "t500",
    "z50": "z50", "r500": "r500", "r850": "r850", "tcwv": "tcwv",
    "u100m": "u100m", "v100m": "v100m", "u250": "u250", "v250": "v250", "z250": "z250",
    "t250": "t250",
}
_TOLERANCE = 1e-6  # degrees


def earth2studio_variables(channels: Sequence[str], where: str) -> list[str]:
    """Earth2Studio's ids of `channels`, in order; a channel it has no name for is a
    one-line ConfigError naming it."""
    unknown = [c for c in channels if c not in EARTH2STUDIO_NAMES]
    if unknown:
        raise ConfigError(f"{where}: channel {unknown[0]} has no Earth2Studio name "
                          f"({len(unknown)} of {len(channels)} channels without one; "
                          f"named: {', '.join(EARTH2STUDIO_NAMES)})")
    return [EARTH2STUDIO_NAMES[c] for c in channels]


def check_grid(latitude: np.ndarray, longitude: np.ndarray, where: str) -> None:
    """A ConfigError unless the grid is one Earth2Studio names: latitude descending within
    [-90, 90], longitude ascending within [0, 360)."""
    lat, lon = np.asarray(latitude, dtype=np.float64), np.asarray(longitude, dtype=np.float64)
    if lat.ndim != 1 or lon.ndim != 1 or len(lat) < 2 or len(lon) < 2:
        raise ConfigError(f"{where}: a grid of {lat.shape} latitudes and {lon.shape} "
                          "longitudes; Earth2Studio needs 1-D latitude and longitude")
    if not (np.diff(lat) < 0).all() or lat.max() > 90 + _TOLERANCE or lat.min() < -90 - _TOLERANCE:
        raise ConfigError(f"{where}: latitude {lat[0]:g} .. {lat[-1]:g}; Earth2Studio's grids "
                          "run from north to south within [-90, 90]")
    if not (np.diff(lon) > 0).all() or lon.min() < -_TOLERANCE or lon.max() >= 360 - _TOLERANCE:
        raise ConfigError(f"{where}: longitude {lon[0]:g} .. {lon[-1]:g}; Earth2Studio's grids "
                          "run east from 0 within [0, 360): prepare the data with longitudes "
                          "0 .. 360")
