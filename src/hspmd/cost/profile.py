"""Measured machine profiles: data types, the JSON text form and the pure fit.

A profile (format tag ``hspmd.profile/1``) holds, per operator family, a line
``time = overhead_s + per_unit_s * units`` fitted by least squares to medians of timed
repetitions (``hspmd.cost.measure`` takes them). Units:

- matmul: FLOPs ``2*M*N*K`` for the forward; the backward is a sample of the same family
  with twice the forward FLOPs, so one ``per_flop_s`` covers both;
- attention: causal FLOPs ``2*B*H*S*S*D`` (the full ``4*B*H*S*S*D`` halved by the causal
  mask); the backward counts twice that;
- norm, elementwise, optimizer: bytes (input bytes; optimizer: bytes of parameters);
- collectives: ring "bus bytes" of a tensor of ``nbytes`` over ``n`` ranks, see
  :func:`bus_bytes`;
- ``core_sharing`` (CPU hosts only): ``[f_1, f_2, ...]``, how many times longer one
  process's compute takes while ``k`` processes of ``threads`` threads compute at once on
  this host's cores (``f_1 = 1``). Local ranks share the cores; GPUs do not, and a CUDA
  profile has none. The simulator applies it per host (``hspmd.sim.Pool``).

No torch here: the planner imports this module without it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hspmd.errors import HspmdError

FORMAT = "hspmd.profile/1"
COMPUTE_OPS = ("matmul", "attention", "norm", "elementwise", "optimizer")
COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "send-recv")
# The unit name of each compute family's slope in the JSON form.
COMPUTE_UNIT = {
    "matmul": "per_flop_s",
    "attention": "per_flop_s",
    "norm": "per_byte_s",
    "elementwise": "per_byte_s",
    "optimizer": "per_byte_s",
}


class ProfileError(HspmdError, ValueError):
    """A malformed profile file or an invalid profile value."""


def bus_bytes(op: str, nbytes: float, group_size: int) -> float:
    """Bytes each rank moves for ``op`` on a ``nbytes`` tensor over ``group_size`` ranks (ring).

    all-reduce ``2*(n-1)/n*size``; all-gather and reduce-scatter ``(n-1)/n*size`` of the full
    tensor; all-to-all ``(n-1)/n*size``; send-recv ``size``.
    """
    if op not in COLLECTIVE_OPS:
        raise ProfileError(
            f"unknown collective {op!r}; expected one of {', '.join(COLLECTIVE_OPS)}"
        )
    if group_size < 1:
        raise ProfileError(f"group_size {group_size} must be >= 1")
    if nbytes < 0:
        raise ProfileError(f"nbytes {nbytes} must be >= 0")
    n = group_size
    if op == "send-recv":
        return float(nbytes)
    if op == "all-reduce":
        return 2.0 * (n - 1) / n * nbytes
    return (n - 1) / n * nbytes


@dataclass(frozen=True)
class Fit:
    """``seconds = overhead_s + per_unit_s * units``; ``r2`` is the fit's coefficient of determination."""

    per_unit_s: float
    overhead_s: float
    r2: float
    rel_residual: float = field(default=0.0, compare=False)  # not stored in the JSON form

    def seconds(self, units: float) -> float:
        return self.overhead_s + self.per_unit_s * units


def fit_linear(samples: list[tuple[float, float]], *, relative: bool = False) -> Fit:
    """Least-squares line through ``(units, seconds)`` samples, slope and intercept clamped >= 0.

    ``relative``: minimise the residuals divided by the seconds (each sample weighs the
    same whatever its size: a fit over 1e6..1e10 FLOPs then holds for small calls too).
    When the unconstrained fit has a negative coefficient, that coefficient is set to 0 and
    the other refitted alone. ``r2`` and ``rel_residual`` (residual norm / seconds norm)
    describe the clamped fit.

    >>> f = fit_linear([(1.0, 1.1), (10.0, 2.0), (100.0, 11.0)], relative=True)
    >>> round(f.per_unit_s, 3), round(f.overhead_s, 3)
    (0.1, 1.0)
    """
    if len(samples) < 2:
        raise ProfileError(f"fit_linear needs at least 2 samples, got {len(samples)}")
    x = np.array([float(u) for u, _ in samples])
    y = np.array([float(s) for _, s in samples])
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise ProfileError("fit_linear samples must be finite numbers")
    if relative and np.any(y <= 0):
        raise ProfileError("fit_linear(relative=True) needs seconds > 0 in every sample")
    w = 1.0 / y if relative else np.ones_like(y)
    xw, yw = x * w, y * w
    a_mat = np.stack([xw, w], axis=1)
    (slope, intercept), *_ = np.linalg.lstsq(a_mat, yw, rcond=None)
    if intercept < 0:
        intercept = 0.0
        denom = float(xw @ xw)
        slope = float(xw @ yw) / denom if denom > 0 else 0.0
    if slope < 0:
        slope = 0.0
        intercept = max(float((w @ yw) / (w @ w)), 0.0)
    pred = intercept + slope * x
    res = y - pred
    ss_res = float(res @ res)
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    ynorm = float(np.linalg.norm(y))
    rel = math.sqrt(ss_res) / ynorm if ynorm > 0 else 0.0
    return Fit(per_unit_s=float(slope), overhead_s=float(intercept), r2=float(r2), rel_residual=rel)


@dataclass(frozen=True)
class LinkFit:
    """One collective's fit on one link class, per bus byte, measured over ``group_size``
    ranks; ``groups``: fits of the same collective over other group sizes (smaller groups
    of the same processes; on shared cores their per-call overhead differs)."""

    fit: Fit
    group_size: int
    groups: tuple[tuple[int, Fit], ...] = ()

    def for_size(self, n: int) -> Fit:
        """The fit measured over the group size nearest ``n`` (ties: the larger)."""
        fits = [(self.group_size, self.fit), *self.groups]
        return min(fits, key=lambda gf: (abs(gf[0] - n), -gf[0]))[1]


@dataclass(frozen=True)
class Sample:
    op: str
    units: float
    seconds: float


@dataclass(frozen=True)
class Profile:
    """A machine's fitted cost model (see the module docstring for units)."""

    kind: str
    device: str
    dtype: str
    threads: int
    created: str
    host: dict[str, Any]
    compute: dict[str, Fit]
    links: dict[str, dict[str, LinkFit]]
    samples: tuple[Sample, ...] = ()
    core_sharing: tuple[float, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        compute = {
            op: {COMPUTE_UNIT[op]: f.per_unit_s, "overhead_s": f.overhead_s, "r2": f.r2}
            for op, f in self.compute.items()
        }
        links = {
            name: {
                op: {
                    "per_byte_s": lf.fit.per_unit_s,
                    "overhead_s": lf.fit.overhead_s,
                    "r2": lf.fit.r2,
                    "group_size": lf.group_size,
                    **(
                        {
                            "groups": [
                                {
                                    "group_size": g,
                                    "per_byte_s": f.per_unit_s,
                                    "overhead_s": f.overhead_s,
                                    "r2": f.r2,
                                }
                                for g, f in lf.groups
                            ]
                        }
                        if lf.groups
                        else {}
                    ),
                }
                for op, lf in ops.items()
            }
            for name, ops in self.links.items()
        }
        return {
            "format": FORMAT,
            "kind": self.kind,
            "device": self.device,
            "dtype": self.dtype,
            "threads": self.threads,
            "created": self.created,
            "host": dict(self.host),
            "compute": compute,
            "links": links,
            **({"core_sharing": list(self.core_sharing)} if self.core_sharing else {}),
            "samples": [{"op": s.op, "units": s.units, "seconds": s.seconds} for s in self.samples],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1) + "\n"

    @staticmethod
    def from_json(text: str, source: str = "<string>") -> Profile:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ProfileError(f"{source}: not JSON ({error})") from None
        return _from_dict(data, source)


def _field(data: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(data, dict) or key not in data:
        raise ProfileError(f"{where}: missing field {key!r}")
    value = data[key]
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise ProfileError(f"{where}: field {key!r} has {value!r}, expected {_kind_name(kind)}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    if isinstance(kind, tuple):
        return " or ".join(k.__name__ for k in kind)
    return kind.__name__


def _number(data: Any, key: str, where: str) -> float:
    value = float(_field(data, key, (int, float), where))
    if not math.isfinite(value) or (key != "r2" and value < 0):
        raise ProfileError(f"{where}: field {key!r} has {value!r}, expected a finite number >= 0")
    return value


def _from_dict(data: Any, source: str) -> Profile:
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: expected a JSON object, got {type(data).__name__}")
    fmt = data.get("format")
    if fmt != FORMAT:
        raise ProfileError(f"{source}: field 'format' is {fmt!r}, expected {FORMAT!r}")
    compute = _compute_fits(data, source)
    links = _link_fits(data, source)
    samples = _samples(data, source)
    sharing = _core_sharing(data, source)
    return Profile(
        kind=_field(data, "kind", str, source),
        device=_field(data, "device", str, source),
        dtype=_field(data, "dtype", str, source),
        threads=_field(data, "threads", int, source),
        created=_field(data, "created", str, source),
        host=dict(_field(data, "host", dict, source)),
        compute=compute,
        links=links,
        samples=samples,
        core_sharing=sharing,
    )


def _compute_fits(data: dict[str, Any], source: str) -> dict[str, Fit]:
    compute: dict[str, Fit] = {}
    for op, entry in _field(data, "compute", dict, source).items():
        where = f"{source}: compute.{op}"
        if op not in COMPUTE_UNIT:
            raise ProfileError(f"{where}: unknown op; expected one of {', '.join(COMPUTE_OPS)}")
        compute[op] = Fit(
            _number(entry, COMPUTE_UNIT[op], where),
            _number(entry, "overhead_s", where),
            _number(entry, "r2", where),
        )
    return compute


def _link_fits(data: dict[str, Any], source: str) -> dict[str, dict[str, LinkFit]]:
    links: dict[str, dict[str, LinkFit]] = {}
    for name, ops in _field(data, "links", dict, source).items():
        if not isinstance(ops, dict):
            raise ProfileError(f"{source}: links.{name} must be an object")
        links[name] = {}
        for op, entry in ops.items():
            where = f"{source}: links.{name}.{op}"
            if op not in COLLECTIVE_OPS:
                raise ProfileError(
                    f"{where}: unknown collective; expected one of {', '.join(COLLECTIVE_OPS)}"
                )
            links[name][op] = _link_fit(entry, where)
    return links


def _link_fit(entry: Any, where: str) -> LinkFit:
    fit = Fit(
        _number(entry, "per_byte_s", where),
        _number(entry, "overhead_s", where),
        _number(entry, "r2", where),
    )
    groups = []
    for j, g in enumerate(entry.get("groups", [])):
        gw = f"{where}.groups[{j}]"
        groups.append((
            int(_field(g, "group_size", int, gw)),
            Fit(_number(g, "per_byte_s", gw), _number(g, "overhead_s", gw), _number(g, "r2", gw)),
        ))  # fmt: skip
    return LinkFit(fit, int(_field(entry, "group_size", int, where)), tuple(groups))


def _samples(data: dict[str, Any], source: str) -> tuple[Sample, ...]:
    samples = []
    for i, entry in enumerate(data.get("samples", [])):
        where = f"{source}: samples[{i}]"
        samples.append(
            Sample(
                _field(entry, "op", str, where),
                _number(entry, "units", where),
                _number(entry, "seconds", where),
            )
        )
    return tuple(samples)


def _core_sharing(data: dict[str, Any], source: str) -> tuple[float, ...]:
    sharing = data.get("core_sharing", [])
    if not isinstance(sharing, list) or not all(
        isinstance(f, int | float) and not isinstance(f, bool) and math.isfinite(f) and f >= 1
        for f in sharing
    ):
        raise ProfileError(
            f"{source}: core_sharing {sharing!r} must be a list of factors >= 1 "
            "(k = 1, 2, ... processes computing at once); run `hspmd profile` again"
        )
    return tuple(float(f) for f in sharing)


def load_profile(path: str | Path) -> Profile:
    """Read a profile file; a ``ProfileError`` names the file and the bad field."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as error:
        raise ProfileError(f"cannot read profile {p}: {error.strerror}") from None
    return Profile.from_json(text, str(p))
