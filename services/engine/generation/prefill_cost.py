"""What a prefill costs on this machine, per cache namespace: the model behind
`prefill_saved_ms` (issue 16 item 6).

A prefill of `n` tokens starting at position `start` (the state already covers
`start` tokens, e.g. after a restore) costs

    cost(start, n) = a * n  +  b * n * (start + n / 2)  +  c

seconds: `a` per token (projections, MLP), `b` per attended (query, key) pair (each
of the n queries attends to start + i keys: n * (start + n/2) pairs in all), `c`
per call. It is fitted from every prefill, cold and partial, by least squares on
relative error (weights 1 / seconds²), with a, b, c ≥ 0 (an exact search over the
8 active sets of a 3-variable non-negative problem), over exponentially decayed
sufficient statistics, so the fit follows a machine whose speed changes.

Persisted beside the cache: `<cache_root>/<namespace>/prefill_cost.json`, written
atomically (temp file, fsync, rename) at most every `save_every_s` and on `save()`,
so a restarted engine reports what a restore saved from its first request.

What a restore saved: a request of `total` prompt tokens that restored `restored`
of them prefills `total - restored` from `restored` instead of `total` from 0, so
`saved(restored, total) = cost(0, total) - cost(restored, total - restored)`
(`cost(0, total)` when nothing is left to prefill); the caller subtracts the
restore time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

log = logging.getLogger(__name__)

FILE_NAME = "prefill_cost.json"
_VERSION = 1
_DIM = 3


def features(start: int, n: int) -> tuple[float, float, float]:
    """(n, attended pairs, 1): the regressors of cost(start, n)."""
    return (float(n), n * (start + n / 2.0), 1.0)


@dataclass(frozen=True)
class Fit:
    """Coefficients of cost(start, n) = a*n + b*n*(start + n/2) + c, in seconds."""

    a: float
    b: float
    c: float

    def cost(self, start: int, n: int) -> float:
        if n <= 0:
            return 0.0
        f = features(start, n)
        return self.a * f[0] + self.b * f[1] + self.c * f[2]


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    k = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    for col in range(k):
        piv = max(range(col, k), key=lambda r: abs(a[r][col]))
        scale = max(abs(x) for row in a for x in row[:k]) or 1.0
        if abs(a[piv][col]) <= 1e-12 * scale:
            return None
        a[col], a[piv] = a[piv], a[col]
        for r in range(k):
            if r != col:
                f = a[r][col] / a[col][col]
                for cc in range(col, k + 1):
                    a[r][cc] -= f * a[col][cc]
    return [a[i][k] / a[i][i] for i in range(k)]


def nonnegative_least_squares(
    xtx: Sequence[Sequence[float]], xty: Sequence[float], yty: float
) -> list[float] | None:
    """argmin_{w >= 0} |Xw - y|² from its sufficient statistics (3 variables: every
    active set is tried, the feasible one with the least residual wins)."""
    best: tuple[float, list[float]] | None = None
    k = len(xty)
    for size in range(k, 0, -1):
        for free in combinations(range(k), size):
            sub = _solve([[xtx[i][j] for j in free] for i in free], [xty[i] for i in free])
            if sub is None or any(x < 0 for x in sub):
                continue
            w = [0.0] * k
            for i, x in zip(free, sub, strict=True):
                w[i] = x
            sse = (
                yty
                - 2 * sum(w[i] * xty[i] for i in range(k))
                + sum(w[i] * xtx[i][j] * w[j] for i in range(k) for j in range(k))
            )
            if best is None or sse < best[0] - 1e-15 * max(1.0, abs(yty)):
                best = (sse, w)
    return None if best is None else best[1]


class PrefillCost:
    """The fitted prefill cost of one namespace (see the module docstring). Thread-safe."""

    def __init__(
        self,
        path: Path | None,
        *,
        memory: float = 0.995,
        min_tokens: int = 8,
        min_samples: int = 3,
        save_every_s: float = 10.0,
    ) -> None:
        if not 0.0 < memory <= 1.0:
            raise ValueError(f"memory must be in (0, 1], got {memory}")
        self.path = path
        self.memory = memory  # weight of past statistics per new sample
        self.min_tokens = min_tokens  # shorter prefills say more about noise than cost
        self.min_samples = min_samples
        self.save_every_s = save_every_s
        self._lock = threading.Lock()
        self._xtx = [[0.0] * _DIM for _ in range(_DIM)]
        self._xty = [0.0] * _DIM
        self._yty = 0.0
        self._samples = 0
        self._fit: Fit | None = None
        self._dirty = False
        self._saved_at = -math.inf  # the first record saves at once

    @classmethod
    def for_namespace(cls, cache_root: Path, namespace: str, **kw: float) -> PrefillCost:
        """The model persisted for `namespace` under the cache root (empty when none is,
        or when the file is damaged)."""
        model = cls(Path(cache_root) / namespace / FILE_NAME, **kw)  # type: ignore[arg-type]
        model.load()
        return model

    # ---- fitting ---------------------------------------------------------------------

    def record(self, start: int, n: int, seconds: float) -> None:
        """One measured prefill of `n` tokens from position `start` (compute only: no
        snapshot copies, no queueing)."""
        if n < self.min_tokens or start < 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        x = features(start, n)
        w = 1.0 / (seconds * seconds)  # relative error: short and long prefills count alike
        with self._lock:
            m = self.memory
            for i in range(_DIM):
                self._xty[i] = m * self._xty[i] + w * x[i] * seconds
                for j in range(_DIM):
                    self._xtx[i][j] = m * self._xtx[i][j] + w * x[i] * x[j]
            self._yty = m * self._yty + w * seconds * seconds
            self._samples += 1
            self._fit = None
            self._dirty = True
        self.maybe_save()

    def fit(self) -> Fit | None:
        """The current coefficients; None until `min_samples` prefills were recorded
        (or the recorded ones cannot determine a positive cost)."""
        with self._lock:
            if self._fit is None and self._samples >= self.min_samples:
                # Scale columns so the normal equations are well conditioned (n ~ 1e3,
                # pairs ~ 1e6, 1), solve, unscale.
                s = [math.sqrt(self._xtx[i][i]) or 1.0 for i in range(_DIM)]
                xtx = [[self._xtx[i][j] / (s[i] * s[j]) for j in range(_DIM)] for i in range(_DIM)]
                xty = [self._xty[i] / s[i] for i in range(_DIM)]
                w = nonnegative_least_squares(xtx, xty, self._yty)
                if w is not None and any(v > 0 for v in w):
                    a, b, c = (w[i] / s[i] for i in range(_DIM))
                    self._fit = Fit(a, b, c)
            return self._fit

    @property
    def samples(self) -> int:
        return self._samples

    @property
    def calibrated(self) -> bool:
        return self.fit() is not None

    def estimate(self, start: int, n: int) -> float | None:
        """Seconds a prefill of `n` tokens from `start` takes; None while uncalibrated."""
        f = self.fit()
        return None if f is None else f.cost(start, n)

    def saved(self, restored: int, total: int) -> float | None:
        """Seconds of prefill a restore of `restored` of `total` prompt tokens avoided
        (before subtracting the restore time); None while uncalibrated."""
        assert 0 <= restored <= total, f"restored {restored} of {total} tokens"
        f = self.fit()
        if f is None or restored == 0:
            return None if f is None else 0.0
        if restored == total:
            return f.cost(0, total)
        return max(0.0, f.cost(0, total) - f.cost(restored, total - restored))

    @staticmethod
    def calibration_plan(max_tokens: int) -> list[tuple[int, int]]:
        """(start, n) prefills for a short warm-up when no model exists: cold prefills of
        growing size and partial ones from a deep start, all within `max_tokens`, enough
        to separate a, b and c."""
        plan: list[tuple[int, int]] = []
        for n in (16, 64, 256, 1024):
            if n <= max_tokens:
                plan.append((0, n))
        for start, n in ((256, 64), (1024, 256)):
            if start + n <= max_tokens:
                plan.append((start, n))
        return plan

    # ---- persistence -----------------------------------------------------------------

    def load(self) -> bool:
        """Read the persisted statistics; False (and an empty model) when there are none
        or the file is damaged."""
        if self.path is None:
            return False
        try:
            doc = json.loads(self.path.read_text())
            if doc.get("version") != _VERSION:
                return False
            xtx = [[float(v) for v in row] for row in doc["xtx"]]
            xty = [float(v) for v in doc["xty"]]
            yty, samples = float(doc["yty"]), int(doc["samples"])
            ok = (
                len(xtx) == _DIM
                and all(len(r) == _DIM for r in xtx)
                and len(xty) == _DIM
                and samples >= 0
                and all(math.isfinite(v) for v in [*xty, yty, *(x for r in xtx for x in r)])
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False
        if not ok:
            log.warning("prefill cost: ignoring damaged %s", self.path)
            return False
        with self._lock:
            self._xtx, self._xty, self._yty, self._samples = xtx, xty, yty, samples
            self._fit = None
            self._dirty = False
        return True

    def maybe_save(self) -> None:
        if self._dirty and time.monotonic() - self._saved_at >= self.save_every_s:
            self.save()

    def save(self) -> None:
        """Write the statistics atomically (errors are logged: the model is a nicety)."""
        if self.path is None:
            return
        with self._lock:
            doc = {
                "version": _VERSION,
                "xtx": self._xtx,
                "xty": self._xty,
                "yty": self._yty,
                "samples": self._samples,
                "updated": time.time(),
            }
            self._dirty = False
            self._saved_at = time.monotonic()
        fit = self.fit()
        if fit is not None:
            doc["fit"] = {"a": fit.a, "b": fit.b, "c": fit.c}
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("prefill cost: cannot write %s: %s", self.path, e)
            with contextlib.suppress(OSError):
                tmp.unlink()
