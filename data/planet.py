"""The synthetic data's planet: a chaotic two-layer quasi-geostrophic atmosphere whose state
is diagnosed into ERA5's 20 channels (data/synthetic.py writes them as a data set).

Dynamics (nondimensional: length = Earth radius, velocity = 10 m/s): two equal layers of
quasi-geostrophic potential vorticity on a doubly periodic beta-plane (x = longitude, y =
latitude from pole to pole), forced by relaxation of the layer thickness (temperature) towards
an equator-to-pole profile that drifts with the seasons, damped by bottom drag over fixed
continents with mountains and by hyperdiffusion. Baroclinic instability makes it turbulent and
chaotic. Two moisture tracers are advected by the layer winds, evaporate from the surface and
rain out at saturation. The 20 output channels are diagnosed from this state (plus a diurnal
cycle in t2m) and interpolated spectrally to the output grid. A 60-day spin-up precedes the
first sample (index 0); samples_per_year 6-hourly samples make one full seasonal cycle.

Stochastic forcing (`forcing` Z, off by default): before each 6-hour step the planet gets a
random kick, so that the next state cannot be computed from this one's channels and a
forecast has something to be uncertain about. The kick adds independent random fields of the
same spectrum (a Gaussian bump around total wavenumber 6, synoptic scales) to the barotropic
and the baroclinic streamfunction, scaled so that the kick's z500 has an expected root mean
square of Z m2/s2 (the PV of both layers changes accordingly). Its draws are keyed by (data
seed, sample index, stream): the data's own trajectory is one stream, and the members of a
perfect-model ensemble branched from a state (`Planet.branch`, data/perfect_ensemble.py) are
others, independent of it and of each other. Forcing 0 draws nothing: the data are the
deterministic planet's, byte for byte.
"""

from __future__ import annotations

import copy

import numpy as np

from data.era5_names import CHANNEL_NAMES
from data.grid import Grid

__all__ = ["DT_HOURS", "Planet", "grid_of", "orography"]

DT_HOURS = 6

_DAY = 86400.0 * 10.0 / 6.371e6      # one day in model time units (L / 10 m/s)
_DT_SAMPLE = DT_HOURS / 24.0 * _DAY
_PSI_TO_PHI = 1e-4 * 10.0 * 6.371e6  # f0 * psi in m2/s2 per nondimensional psi
_BETA = 20.0        # weaker than Earth's ~66: livelier eddies (error doubling ~2.5 days)
_F = 80.0           # 2F = k_d^2: deformation radius ~ 500 km
_TAU_EQ = 1.2       # radiative-equilibrium thickness amplitude (sets jet / temperature gradient)
_RELAX = 1.0 / (20.0 * _DAY)
_DRAG = 1.0 / (4.0 * _DAY)
_SEASON_SHIFT = 0.2  # rad: seasonal migration of the thermal equator (~11 degrees)
_T_PER_TAU = 24.0    # K per unit of thickness psi1 - psi2 (thermal wind)
_PLANET_SEED = 20231112  # the continents are the same for every data seed
_SPINUP_DAYS = 60.0
_CFL = 2.0
_HYPER_HOURS = 2.0
# Mean geopotential of each level and the weight a of the baroclinic mode in
# psi(level) = psi_barotropic + a * psi_baroclinic (upper layer ~ 300 hPa, lower ~ 750 hPa).
_LEVELS = {"1000": (1.0e3, -1.2), "850": (1.4e4, -0.8), "500": (5.5e4, 0.6), "50": (2.0e5, 1.6)}
# Stochastic forcing: the kick's spectrum (total wavenumber, in units of 1 / Earth radius) and
# the words that key its draws (a sample index + _INDEX_OFFSET is >= 0 from the spin-up on).
_KICK_WAVENUMBER, _KICK_WIDTH = 6.0, 3.0
_FORCING_KEY, _INDEX_OFFSET = 40, 2**20
DATA_STREAM = (0, 0, 0)


def _wavenumbers(ny: int, nx: int) -> tuple[np.ndarray, np.ndarray]:
    """Wavenumbers for rfft2 arrays; the domain is 2*pi wide and pi tall (rows = latitude)."""
    ky = 2.0 * np.fft.fftfreq(ny, 1.0 / ny)[:, None]
    kx = np.fft.rfftfreq(nx, 1.0 / nx)[None, :]
    return ky, kx


def _resample(ah: np.ndarray, ny: int, nx: int, shape: tuple[int, int]) -> np.ndarray:
    """Spectral interpolation (zero padding) or truncation of rfft2 coefficients to `shape`."""
    h, w = shape
    out = np.zeros(ah.shape[:-2] + (h, w // 2 + 1), dtype=complex)
    my, mx = min(ny, h) // 2, min(nx, w) // 2  # Nyquist modes dropped: they break symmetry
    out[..., :my, :mx] = ah[..., :my, :mx]
    out[..., h - my + 1:, :mx] = ah[..., ny - my + 1:, :mx]
    return out * (h * w) / (ny * nx)


def _latitudes(h: int) -> np.ndarray:
    """Row 0 is the north pole, like the tutorial's 720-row ERA5 grid."""
    return np.deg2rad(90.0 - 180.0 * np.arange(h) / h)


def grid_of(h: int, w: int) -> Grid:
    """The output grid in degrees: rows at 90 - 180 i / h, columns at 360 j / w."""
    return Grid(90.0 - 180.0 * np.arange(h) / h, 360.0 * np.arange(w) / w)


def orography(shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Fixed smooth continents (land mask) and mountains in metres, same planet at any size."""
    rng = np.random.default_rng(_PLANET_SEED)
    n = 7  # only wavenumbers < 7 so the planet is resolved on every grid
    coef = np.zeros((2 * n, 2 * n), dtype=complex)
    coef[:, :n] = rng.normal(size=(2 * n, n)) + 1j * rng.normal(size=(2 * n, n))
    coef[0, 0] = 0.0
    ref = np.fft.irfft2(_resample(coef, 2 * n, 2 * n - 2, (64, 128)), s=(64, 128))
    field = np.fft.irfft2(_resample(coef, 2 * n, 2 * n - 2, shape), s=shape)
    field = (field - ref.mean()) / ref.std()
    land = field > 0.5  # ~30 % land
    return land, np.where(land, 1500.0 * (field - 0.5), 0.0)


def _temperatures(tau: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """t850 and t500 (K) from the layer thickness psi1 - psi2 (hypsometric relation)."""
    return 270.0 + _T_PER_TAU * tau, 250.0 + 0.9 * _T_PER_TAU * tau


def _qsat(t850: np.ndarray, t500: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Clausius-Clapeyron-like saturation water (kg/m2) of the lower and upper troposphere."""
    return (45.0 * np.exp(0.065 * (np.minimum(t850, 330.0) - 285.0)),
            8.0 * np.exp(0.065 * (np.minimum(t500, 330.0) - 255.0)))


def _kick_spectrum(k2: np.ndarray, mask: np.ndarray, nx: int) -> np.ndarray:
    """rfft2 filter of the kick: the rfft2 of white noise on the grid times it is a field of
    the kick's spectrum with expected variance 1 (the mean of filter^2 over the full spectrum
    is 1; the rfft half holds each column kx > 0 once for +kx and -kx)."""
    f = np.exp(-(((np.sqrt(k2) - _KICK_WAVENUMBER) / _KICK_WIDTH) ** 2)) * mask * (k2 > 0)
    twice = np.full(f.shape, 2.0)
    twice[:, 0] = 1.0  # kx = 0 (and an even grid's Nyquist column) has no mirror
    if nx % 2 == 0:
        twice[:, -1] = 1.0
    return f / np.sqrt((twice * f**2).sum() / (k2.shape[0] * nx))


class Planet:
    """Spectral two-layer QG model with two moisture tracers on an (ny, nx) grid."""

    def __init__(self, ny: int, nx: int, seed: int, samples_per_year: int,
                 forcing: float = 0.0) -> None:
        self.ny, self.nx, self.spy = ny, nx, samples_per_year
        self.seed, self.forcing, self.stream = seed, float(forcing), DATA_STREAM
        self.ky, self.kx = _wavenumbers(ny, nx)
        k2 = self.kx**2 + self.ky**2
        kmax = min(nx // 2, ny)  # ky = 2 * row mode, so both directions reach ~nx / 2
        self.mask = (np.abs(self.kx) < kmax * 2 / 3) & (np.abs(self.ky) < kmax * 2 / 3)
        self.inv_k2 = np.where(k2 > 0, 1.0 / np.where(k2 > 0, k2, 1.0), 0.0)
        self.inv_k2f = np.where(k2 > 0, 1.0 / (k2 + 2 * _F), 0.0)
        self.k2 = k2
        self.kcut, self.steps = kmax * 2 / 3, 0
        # del^8 hyperdiffusion: e-folding in _HYPER_HOURS at the cutoff, negligible at large scales.
        self.hyper_rate = (k2 / self.kcut**2) ** 4 / (_HYPER_HOURS / 24.0 * _DAY)
        self.land, orog = orography((ny, nx))
        self.topo_h = np.fft.rfft2(0.004 * orog) * self.mask  # f0 h / H in PV units
        self.evap = np.where(self.land, 1.0 / (6.0 * _DAY), 1.0 / (1.5 * _DAY))
        self.lat = _latitudes(ny)[:, None]
        rng = np.random.default_rng(seed)
        tau0 = self._tau_eq(0.0) + 0.05 * rng.standard_normal((ny, nx))
        q1 = -_F * tau0 + 0.5 * rng.standard_normal((ny, nx))
        q2 = _F * tau0 + 0.5 * rng.standard_normal((ny, nx))
        qs_lo, qs_hi = _qsat(*_temperatures(tau0))
        self.state = np.fft.rfft2(np.stack([q1, q2, 0.7 * qs_lo, 0.4 * qs_hi])) * self.mask
        self.state[1] += self.topo_h
        self.index = -int(round(_SPINUP_DAYS * 4))  # first written sample has index 0
        if self.forcing > 0:
            self.kick_spectrum = _kick_spectrum(k2, self.mask, nx)

    def _tau_eq(self, phase: float) -> np.ndarray:
        shift = _SEASON_SHIFT * np.sin(2 * np.pi * phase)
        return _TAU_EQ * np.cos(2 * (self.lat - shift)) * np.ones((1, self.nx))

    def streamfunctions(self, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        bt = -(s[0] + s[1] - self.topo_h) * self.inv_k2      # psi1 + psi2
        tau = -(s[0] - s[1] + self.topo_h) * self.inv_k2f    # psi1 - psi2
        return 0.5 * (bt + tau), 0.5 * (bt - tau)

    def _tendency(self, s: np.ndarray, tau_eq_h: np.ndarray) -> np.ndarray:
        p1, p2 = self.streamfunctions(s)
        iky, ikx = 1j * self.ky, 1j * self.kx
        # Rows run southward, so d/dy = -d/drow; u = -dpsi/dy = +dpsi/drow.
        spec = np.stack([iky * p1, ikx * p1, iky * p2, ikx * p2,
                         ikx * s[0], iky * s[0], ikx * s[1], iky * s[1],
                         ikx * s[2], iky * s[2], ikx * s[3], iky * s[3], p1 - p2, s[2], s[3]])
        u1, v1, u2, v2, q1x, q1r, q2x, q2r, mlx, mlr, mhx, mhr, tau, ml, mh = np.fft.irfft2(
            spec, s=(self.ny, self.nx))
        qs_lo, qs_hi = _qsat(*_temperatures(tau))
        rh_lo = np.clip(ml / qs_lo, 0.0, 1.0)
        nl = np.fft.rfft2(np.stack([
            -(u1 * q1x - v1 * q1r),
            -(u2 * q2x - v2 * q2r),
            -(u2 * mlx - v2 * mlr) + self.evap * (0.8 * qs_lo - ml),
            -(u1 * mhx - v1 * mhr) + (0.7 * rh_lo * qs_hi - mh) / (3.0 * _DAY),
        ]))
        thick = _F * _RELAX * (p1 - p2 - tau_eq_h)  # thermal relaxation of psi1 - psi2
        nl[0] += -_BETA * ikx * p1 + thick
        nl[1] += -_BETA * ikx * p2 - thick + _DRAG * self.k2 * p2
        return nl * self.mask

    def kick(self) -> np.ndarray:
        """This sample's random change of the layers' PV (rfft2, (2, ny, nx // 2 + 1)): a
        barotropic and a baroclinic streamfunction kick whose z500 has an expected root
        mean square of `forcing` m2/s2, drawn from (seed, index, stream)."""
        rng = np.random.default_rng([self.seed, _FORCING_KEY, self.index + _INDEX_OFFSET,
                                     *self.stream])
        scale = self.forcing / (_PSI_TO_PHI * np.hypot(1.0, _LEVELS["500"][1]))
        bt, bc = np.fft.rfft2(rng.standard_normal((2, self.ny, self.nx))) * (
            scale * self.kick_spectrum)
        # psi1 + psi2 = 2 bt and psi1 - psi2 = 2 bc, inverted as in `streamfunctions`.
        stretched = (self.k2 + 2 * _F) * bc
        return np.stack([-self.k2 * bt - stretched, -self.k2 * bt + stretched])

    def branch(self, member: int, ensemble_seed: int = 0) -> Planet:
        """A copy of this planet that continues with its own forcing draws: member `member`
        of the ensemble `ensemble_seed` branched at this sample, independent of the data's
        trajectory, of the other members and of branches at other samples."""
        twin = copy.deepcopy(self)
        twin.stream = (1 + ensemble_seed, self.index + _INDEX_OFFSET, member)
        return twin

    def advance(self) -> None:
        """Integrate one 6-hour sample with RK4 substeps, then rain out supersaturation
        (kicked first, with stochastic forcing)."""
        phase = (self.index % self.spy) / self.spy
        tau_eq_h = np.fft.rfft2(self._tau_eq(phase)) * self.mask
        s = self.state
        if self.forcing > 0:
            s = s.copy()
            s[:2] += self.kick() * self.mask
        p1, p2 = self.streamfunctions(s)
        iky, ikx = 1j * self.ky, 1j * self.kx
        wind = np.abs(np.fft.irfft2(np.stack([iky * p1, ikx * p1, iky * p2, ikx * p2]),
                                    s=(self.ny, self.nx))).max(axis=(1, 2))
        # RK4 is stable for |omega dt| < 2.8: the step adapts to the fastest wind.
        speed = max(wind[0] + wind[1], wind[2] + wind[3], 1.0) * self.kcut
        nsub = max(2, int(np.ceil(_DT_SAMPLE * speed / _CFL)))
        dt = _DT_SAMPLE / nsub
        self.steps += nsub
        hyper = np.exp(-dt * self.hyper_rate)
        for _ in range(nsub):
            k1 = self._tendency(s, tau_eq_h)
            k2 = self._tendency(s + 0.5 * dt * k1, tau_eq_h)
            k3 = self._tendency(s + 0.5 * dt * k2, tau_eq_h)
            k4 = self._tendency(s + dt * k3, tau_eq_h)
            s = s + dt / 6.0 * (k1 + 2 * k2 + 2 * k3 + k4)
            s = s * hyper
        p1, p2 = self.streamfunctions(s)
        tau = np.fft.irfft2(p1 - p2, s=(self.ny, self.nx))
        m = np.fft.irfft2(s[2:], s=(self.ny, self.nx))
        m = np.clip(m, 0.0, np.stack(_qsat(*_temperatures(tau))))
        if not np.isfinite(m).all():
            raise FloatingPointError("synthetic dynamics blew up; please report the settings")
        s[2:] = np.fft.rfft2(m) * self.mask
        self.state = s
        self.index += 1

    def diagnose(self, shape: tuple[int, int], land: np.ndarray, orog: np.ndarray) -> np.ndarray:
        """The 20 output channels (float32, (20, H, W)) of the current state on the output grid."""
        p1, p2 = self.streamfunctions(self.state)
        bt, bc = 0.5 * (p1 + p2), 0.5 * (p1 - p2)
        iky, ikx = 1j * self.ky, 1j * self.kx
        spec = []
        for lev in ("1000", "850", "500"):
            psi = bt + _LEVELS[lev][1] * bc
            spec += [iky * psi, ikx * psi, psi]
        # The stratosphere (z50) only sees the largest scales.
        spec += [(bt + _LEVELS["50"][1] * bc) * np.exp(-self.k2 / 25.0), 2.0 * bc]
        spec += [self.state[2], self.state[3]]
        g = np.fft.irfft2(_resample(np.stack(spec), self.ny, self.nx, shape), s=shape)
        u1000, v1000 = 10.0 * g[0], 10.0 * g[1]
        tau, m_lo, m_hi = g[10], g[11], g[12]
        t850, t500 = _temperatures(tau)
        qs_lo, qs_hi = _qsat(t850, t500)
        t_surf = 280.0 + 1.1 * _T_PER_TAU * tau - 0.0065 * orog  # lapse rate over mountains
        hour = (self.index * DT_HOURS) % 24
        lon = 2 * np.pi * np.arange(shape[1]) / shape[1]
        lat = _latitudes(shape[0])[:, None]
        # Diurnal cycle peaking at 14 local time, stronger over land.
        diurnal = np.where(land, 5.0, 1.0) * np.cos(lat) * np.cos(lon + np.pi * (hour - 14) / 12)
        friction = np.where(land, 0.5, 0.7)  # 10 m wind: weaker and turned towards low pressure
        ca, sa = np.cos(np.deg2rad(20.0)), np.sin(np.deg2rad(20.0))
        z = {lev: _LEVELS[lev][0] + _PSI_TO_PHI * g[3 * i + 2]
             for i, lev in enumerate(("1000", "850", "500"))}
        msl = 1.0e5 + 1.25 * z["1000"]
        out = {
            "u10": friction * (ca * u1000 - sa * v1000),
            "v10": friction * (sa * u1000 + ca * v1000),
            "t2m": t_surf + diurnal,
            "sp": msl * np.exp(-9.81 * orog / (287.0 * t_surf)),
            "msl": msl, "t850": t850, "u1000": u1000, "v1000": v1000, "z1000": z["1000"],
            "u850": 10.0 * g[3], "v850": 10.0 * g[4], "z850": z["850"],
            "u500": 10.0 * g[6], "v500": 10.0 * g[7], "z500": z["500"], "t500": t500,
            "z50": _LEVELS["50"][0] + 1.5 * _PSI_TO_PHI * g[9],
            "r500": 100.0 * np.clip(m_hi / qs_hi, 0.0, 1.0),
            "r850": 100.0 * np.clip(m_lo / qs_lo, 0.0, 1.0),
            "tcwv": np.maximum(m_lo, 0.0) + np.maximum(m_hi, 0.0),
        }
        return np.stack([out[c] for c in CHANNEL_NAMES]).astype(np.float32)
