"""Pure tests of hspmd.cost.profile: the fit, bus bytes, the JSON form and its errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hspmd.cost.profile import (
    Fit,
    LinkFit,
    Profile,
    ProfileError,
    Sample,
    bus_bytes,
    fit_linear,
    load_profile,
)


def test_fit_linear_recovers_an_exact_line() -> None:
    samples = [(u, 3e-6 + 2.5e-10 * u) for u in (1e3, 1e4, 1e5, 1e6)]
    fit = fit_linear(samples)
    assert fit.per_unit_s == pytest.approx(2.5e-10, rel=1e-9)
    assert fit.overhead_s == pytest.approx(3e-6, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0)


def test_fit_linear_clamps_a_negative_intercept() -> None:
    fit = fit_linear([(1.0, 0.5), (2.0, 2.0), (3.0, 3.5)])
    assert fit.overhead_s == 0.0
    assert fit.per_unit_s > 0


def test_fit_linear_needs_two_samples() -> None:
    with pytest.raises(ProfileError, match="at least 2"):
        fit_linear([(1.0, 1.0)])


def test_bus_bytes_ring_formulas() -> None:
    assert bus_bytes("all-reduce", 1000, 4) == 1500
    assert bus_bytes("all-gather", 1000, 4) == 750
    assert bus_bytes("reduce-scatter", 1000, 2) == 500
    assert bus_bytes("all-to-all", 1000, 2) == 500
    assert bus_bytes("send-recv", 1000, 2) == 1000
    with pytest.raises(ProfileError, match="broadcast"):
        bus_bytes("broadcast", 1000, 2)


def _profile() -> Profile:
    return Profile(
        kind="cpu",
        device="cpu",
        dtype="float32",
        threads=1,
        created="2026-12-02T21:00:00+00:00",
        host={"cpus": 2},
        compute={"matmul": Fit(1.25e-11, 2e-6, 0.99), "optimizer": Fit(1e-10, 1e-5, 0.95)},
        links={"loopback": {"all-reduce": LinkFit(Fit(3e-10, 5e-5, 0.98), 2)}},
        samples=(Sample("matmul", 2.0e6, 3.1e-5),),
    )


def test_json_round_trip_is_exact() -> None:
    profile = _profile()
    text = profile.to_json()
    again = Profile.from_json(text)
    assert again == profile
    assert again.to_json() == text


def test_load_profile_names_file_and_field(tmp_path: Path) -> None:
    good = _profile().to_dict()
    path = tmp_path / "p.json"
    path.write_text("{not json")
    with pytest.raises(ProfileError, match="p.json: not JSON"):
        load_profile(path)
    path.write_text(json.dumps(dict(good, format="other/1")))
    with pytest.raises(ProfileError, match="'format'"):
        load_profile(path)
    broken = dict(good, compute={"matmul": {"overhead_s": 1.0, "r2": 1.0}})
    path.write_text(json.dumps(broken))
    with pytest.raises(ProfileError, match=r"compute\.matmul: missing field 'per_flop_s'"):
        load_profile(path)
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(tmp_path / "missing.json")


def test_measure_matmul_and_elementwise_tiny_sizes() -> None:
    from hspmd.cost.measure import measure_elementwise, measure_matmul

    samples = measure_matmul([8, 16], reps=2) + measure_elementwise([64, 128], reps=2)
    # squares 8, 16; skinny (32, 8) x (8, 16), (64, 16) x (16, 16), (4, 8) x (8, 24), (8, 16) x (16, 48)
    assert [s.op for s in samples] == ["matmul"] * 12 + ["elementwise"] * 4
    assert samples[1].units == 2 * samples[0].units == 2 * 2 * 8**3
    assert samples[4].units == 2 * 32 * 8 * 16 and samples[8].units == 2 * 4 * 8 * 24
    assert all(s.seconds > 0 for s in samples)
    fit_linear([(s.units, s.seconds) for s in samples[:4]])


def test_fit_linear_relative_weighs_small_samples_as_much_as_big_ones() -> None:
    # three small samples on one line, and a big one 30% above it
    samples = [(1.0, 2.0), (2.0, 3.0), (3.0, 4.0), (1000.0, 1300.0)]
    absolute, relative = fit_linear(samples), fit_linear(samples, relative=True)
    assert absolute.seconds(1.0) / 2.0 < 0.87  # the big sample pulls the small ones off
    assert relative.seconds(1.0) / 2.0 > 0.93
    with pytest.raises(ProfileError, match="seconds > 0"):
        fit_linear([(1.0, 0.0), (2.0, 1.0)], relative=True)


def test_core_sharing_and_group_fits_round_trip() -> None:
    groups = ((2, Fit(1e-9, 1e-3, 0.9)),)
    link = LinkFit(Fit(3e-10, 5e-3, 0.98), 4, groups)
    base = _profile()
    profile = Profile(**{**base.__dict__, "links": {"loopback": {"all-reduce": link}},
                         "core_sharing": (1.0, 1.02, 1.5, 2.0)})  # fmt: skip
    again = Profile.from_json(profile.to_json())
    assert again == profile
    assert again.core_sharing == (1.0, 1.02, 1.5, 2.0)
    assert "core_sharing" not in base.to_dict()  # absent where not measured (CUDA)
    bad = {**profile.to_dict(), "core_sharing": [1.0, 0.5]}
    with pytest.raises(ProfileError, match=r"core_sharing \[1.0, 0.5\]"):
        Profile.from_json(json.dumps(bad))


def test_link_fit_for_size_picks_the_nearest_measured_group() -> None:
    four, two = Fit(0.0, 4e-3, 1.0), Fit(0.0, 1e-3, 1.0)
    link = LinkFit(four, 4, ((2, two),))
    assert link.for_size(2) is two
    assert link.for_size(3) is four  # tie: the larger group
    assert link.for_size(8) is four
    assert LinkFit(four, 4).for_size(2) is four
