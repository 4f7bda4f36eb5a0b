"""Relative humidity from specific humidity, temperature and pressure, as the IFS defines it.

ERA5's relative humidity (the CDS `r`, WeatherBench-2's `relative_humidity`) is taken with
respect to saturation of the mixed phase: over water above 0 degrees C, over ice below
-23 degrees C, and a quadratic blend of the two in between (ECMWF's IFS documentation,
Part IV: Physical processes, the mixed-phase Tetens formula). A store that has
`specific_humidity` but no relative humidity (ARCO-ERA5) gets it from here:

    e_sat(T) = alpha(T) e_w(T) + (1 - alpha(T)) e_i(T),
    e_x(T)   = a1 exp(a3 (T - T0) / (T - a4))                 (water: x = w, ice: x = i)
    alpha(T) = 0 for T <= Ti, 1 for T >= T0, ((T - Ti) / (T0 - Ti))**2 between
    e        = p q (Rv / Rd) / (1 + (Rv / Rd - 1) q)           vapour pressure
    RH       = e / e_sat                                       a fraction (x 100: percent)

with p the pressure in Pa (a pressure level's hPa x 100) and q in kg/kg.
"""

from __future__ import annotations

import numpy as np

A1 = 611.21                       # Pa
T0 = 273.16                       # K, the triple point of water
T_ICE = 250.16                    # K, below it saturation is over ice alone
WATER = (17.502, 32.19)           # a3, a4 (K)
ICE = (22.587, -0.7)
R_DRY, R_VAPOUR = 287.0597, 461.5250  # J kg-1 K-1


def _tetens(t: np.ndarray, a3: float, a4: float) -> np.ndarray:
    return A1 * np.exp(a3 * (t - T0) / (t - a4))


def saturation_vapour_pressure(t: np.ndarray) -> np.ndarray:
    """Saturation vapour pressure (Pa) of the mixed phase at temperature `t` (K), float64."""
    t = np.asarray(t, dtype=np.float64)
    alpha = np.clip((t - T_ICE) / (T0 - T_ICE), 0.0, 1.0) ** 2
    return alpha * _tetens(t, *WATER) + (1.0 - alpha) * _tetens(t, *ICE)


def vapour_pressure(q: np.ndarray, pressure_pa: float | np.ndarray) -> np.ndarray:
    """Partial pressure of water vapour (Pa) at specific humidity `q` (kg/kg), float64."""
    q = np.asarray(q, dtype=np.float64)
    ratio = R_VAPOUR / R_DRY
    return pressure_pa * q * ratio / (1.0 + (ratio - 1.0) * q)


def relative_humidity(q: np.ndarray, t: np.ndarray, pressure_pa: float | np.ndarray
                      ) -> np.ndarray:
    """Relative humidity (a fraction, float64) w.r.t. the mixed phase (module docstring)."""
    return vapour_pressure(q, pressure_pa) / saturation_vapour_pressure(t)
