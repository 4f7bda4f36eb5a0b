"""Relative humidity from specific humidity, temperature and pressure: the two definitions.

ERA5's relative humidity and WeatherBench-2's are not the same quantity, and a comparison
must use one of them on both sides (docs/real_era5.md):

  - ECMWF's (`ECMWF`): the IFS definition, which the CDS `r` holds and which is derived here
    for a store that has only specific humidity (ARCO-ERA5). Saturation is taken over the
    mixed phase: over water above 0 degrees C, over ice below -23 degrees C, a quadratic
    blend between (ECMWF's IFS documentation, Part IV: Physical processes, the mixed-phase
    Tetens formula), and RH is the ratio of the vapour pressure to it:

        e_sat(T) = alpha(T) e_w(T) + (1 - alpha(T)) e_i(T),
        e_x(T)   = a1 exp(a3 (T - T0) / (T - a4))               (water: x = w, ice: x = i)
        alpha(T) = 0 for T <= Ti, 1 for T >= T0, ((T - Ti) / (T0 - Ti))**2 between
        e        = p q (Rv / Rd) / (1 + (Rv / Rd - 1) q)         vapour pressure
        RH       = e / e_sat

  - WeatherBench-2's (`WB2`): the `relative_humidity` of its stores, a variable it derives
    itself from q and T. Saturation over liquid water only, with Bolton's (1980) fit, and RH
    the ratio of the mixing ratio to the saturation mixing ratio:

        e_s(T) = 611.2 exp(17.67 (T - 273.15) / (T - 29.65))    Pa
        w      = q / (1 - q),    w_s = eps e_s / (p - e_s),   eps = 0.622
        RH     = w / w_s

Both are fractions (x 100: percent), with p the pressure in Pa (a pressure level's hPa x
100) and q in kg/kg. Below 0 degrees C saturation over ice is lower than over water, so
the mixed-phase RH is the larger one there: 12-39 % more at 500 hPa between 240 and 260 K.
"""

from __future__ import annotations

import numpy as np

ECMWF, WB2 = "ecmwf", "wb2"
DEFINITIONS = {  # how a prepared file, the docs and the errors name each one
    ECMWF: "ECMWF's (IFS, mixed phase)",
    WB2: "WeatherBench-2's (over water, Bolton 1980)",
}

A1 = 611.21                       # Pa
T0 = 273.16                       # K, the triple point of water
T_ICE = 250.16                    # K, below it saturation is over ice alone
WATER = (17.502, 32.19)           # a3, a4 (K)
ICE = (22.587, -0.7)
R_DRY, R_VAPOUR = 287.0597, 461.5250  # J kg-1 K-1
BOLTON = (611.2, 17.67, 273.15, 29.65)  # Pa, -, K, K
EPSILON = 0.622                   # the ratio of the molar masses of water and dry air


def _tetens(t: np.ndarray, a3: float, a4: float) -> np.ndarray:
    return A1 * np.exp(a3 * (t - T0) / (t - a4))


def saturation_vapour_pressure(t: np.ndarray) -> np.ndarray:
    """Saturation vapour pressure (Pa) of the mixed phase at temperature `t` (K), float64:
    ECMWF's."""
    t = np.asarray(t, dtype=np.float64)
    alpha = np.clip((t - T_ICE) / (T0 - T_ICE), 0.0, 1.0) ** 2
    return alpha * _tetens(t, *WATER) + (1.0 - alpha) * _tetens(t, *ICE)


def saturation_vapour_pressure_over_water(t: np.ndarray) -> np.ndarray:
    """Saturation vapour pressure (Pa) over liquid water at `t` (K), Bolton's fit, float64:
    WeatherBench-2's."""
    e0, a, t0, b = BOLTON
    t = np.asarray(t, dtype=np.float64)
    return e0 * np.exp(a * (t - t0) / (t - b))


def vapour_pressure(q: np.ndarray, pressure_pa: float | np.ndarray) -> np.ndarray:
    """Partial pressure of water vapour (Pa) at specific humidity `q` (kg/kg), float64."""
    q = np.asarray(q, dtype=np.float64)
    ratio = R_VAPOUR / R_DRY
    return pressure_pa * q * ratio / (1.0 + (ratio - 1.0) * q)


def relative_humidity(q: np.ndarray, t: np.ndarray, pressure_pa: float | np.ndarray,
                      definition: str = ECMWF) -> np.ndarray:
    """Relative humidity (a fraction, float64) by `definition`, ECMWF or WB2 (module
    docstring)."""
    if definition == ECMWF:
        return vapour_pressure(q, pressure_pa) / saturation_vapour_pressure(t)
    if definition == WB2:
        q = np.asarray(q, dtype=np.float64)
        e_s = saturation_vapour_pressure_over_water(t)
        return (q / (1.0 - q)) / (EPSILON * e_s / (pressure_pa - e_s))
    raise ValueError(f"unknown relative humidity definition {definition!r}")
