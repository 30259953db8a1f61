"""hspmd.cost.measure on this machine: samples, fits, the profile's JSON round trip and
`hspmd profile`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from hspmd.cli import main
from hspmd.cost import measure
from hspmd.cost.measure import (
    measure_attention,
    measure_collectives,
    measure_matmul,
    measure_norm,
    measure_optimizer,
    profile_machine,
    rms_norm,
)
from hspmd.cost.profile import (
    COLLECTIVE_OPS,
    COMPUTE_OPS,
    ProfileError,
    bus_bytes,
    fit_linear,
    load_profile,
)


def test_matmul_samples_grow_with_their_flops() -> None:
    # What a measurement says on a shared 2-core machine depends on its load (a fit's r2 fell
    # to 0.5 at load 20), so this checks what the code decides: the shapes, their FLOPs, and
    # that 64 times the work takes longer; the fit itself is checked on exact lines below.
    # A burst of load can still stretch one small sample: three tries.
    for _ in range(3):
        samples = measure_matmul((128, 512), reps=5, skinny=[])
        assert [s.units for s in samples] == [2 * 128**3, 4 * 128**3, 2 * 512**3, 4 * 512**3]
        assert all(s.seconds > 0 for s in samples)
        small, large = (
            samples[0].seconds + samples[1].seconds,
            samples[2].seconds + samples[3].seconds,
        )
        if large > small:
            break
    assert large > small, samples


def test_a_noisy_line_fits_with_its_slope() -> None:
    rng = np.random.default_rng(0)
    units = [float(n) ** 3 for n in (128, 256, 384, 512)]
    seconds = [2e-5 + 3e-11 * u * (1 + 0.02 * rng.standard_normal()) for u in units]
    fit = fit_linear(list(zip(units, seconds, strict=True)))
    assert fit.per_unit_s == pytest.approx(3e-11, rel=0.05) and fit.r2 > 0.99


def test_attention_norm_optimizer_units() -> None:
    attention = measure_attention((64, 128), reps=1, heads=2, head_dim=16)
    assert [s.units for s in attention] == [2.0 * 2 * 64 * 64 * 16, 4.0 * 2 * 64 * 64 * 16,
                                            2.0 * 2 * 128 * 128 * 16, 4.0 * 2 * 128 * 128 * 16]  # fmt: skip
    norm = measure_norm((8,), reps=1, hidden=64)
    assert [s.units for s in norm] == [8 * 64 * 4.0, 2 * 8 * 64 * 4.0]
    assert [s.units for s in measure_optimizer((1024,), reps=1)] == [4096.0]
    assert all(s.seconds > 0 for s in (*attention, *norm))


def test_rms_norm_matches_its_formula() -> None:
    x, w = torch.randn(3, 8), torch.rand(8)
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(rms_norm(x, w), want)


@pytest.mark.multiproc
def test_collectives_on_two_processes() -> None:
    samples = measure_collectives((64 << 10, 1 << 20), reps=2, nproc=2)[2]
    assert [s.op for s in samples] == [op for op in COLLECTIVE_OPS for _ in range(2)]
    assert samples[0].units == bus_bytes("all-reduce", 64 << 10, 2)
    assert all(s.seconds > 0 for s in samples)
    with pytest.raises(ProfileError, match="nproc=1"):
        measure_collectives((1024,), reps=1, nproc=1)


def _tiny(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shrink the quick fp32 sizes further: the tests check the plumbing, not the machine."""
    # matmuls up to 512^3 (0.27 GFLOP, a few ms): at 192^3 launch noise on a cold fresh
    # clone once swamped the FLOPs and the fitted slope came out 0
    small = measure.Sizes((128, 256, 512), (64, 128), (16, 64), (1 << 12, 1 << 16),
                          (1 << 12, 1 << 16), (16 << 10, 256 << 10), reps=2)  # fmt: skip
    monkeypatch.setitem(measure.SIZES, ("fp32", True), small)


@pytest.mark.multiproc
def test_quick_profile_round_trips_through_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _tiny(monkeypatch)
    profile = profile_machine(quick=True, nproc=2, dtype="fp32")
    assert set(profile.compute) == set(COMPUTE_OPS)
    assert set(profile.links["loopback"]) == set(COLLECTIVE_OPS)
    # tiny sizes on a loaded machine can fit a flat line (slope clamped to 0) for one
    # family; the slopes are never negative and the matmul one is real
    assert all(f.per_unit_s >= 0 for f in profile.compute.values())
    assert profile.compute["matmul"].per_unit_s > 0
    assert all(lf.group_size == 2 for lf in profile.links["loopback"].values())
    # compute timed with a local rank's threads (cores // nproc); CPU hosts: core sharing
    assert profile.threads == max(1, (os.cpu_count() or 1) // 2)
    assert profile.kind == "cuda" or len(profile.core_sharing) == 2
    assert profile.host["torch"] == torch.__version__
    path = tmp_path / "profile.json"
    path.write_text(profile.to_json())
    again = load_profile(path)
    assert again == profile


def test_cli_profile_without_collectives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _tiny(monkeypatch)
    asked = []  # core sharing spawns torch processes: measured in the test above
    monkeypatch.setattr(
        measure, "measure_core_sharing", lambda most, **_: asked.append(most) or (1.0, 1.6)
    )
    out = tmp_path / "p.json"
    assert main(["profile", "--quick", "--nproc", "1", "--out", str(out)]) == 0
    assert asked == [2]
    table = capsys.readouterr().out
    assert "matmul" in table and "s/flop" in table and "loopback" not in table
    data = json.loads(out.read_text())
    assert data["format"] == "hspmd.profile/1" and data["links"] == {}
    assert load_profile(out).compute["matmul"].per_unit_s > 0


def test_cli_profile_refuses_bad_nproc(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "--nproc", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hspmd profile: error: --nproc 0") and "\n" not in err


def test_matmul_takes_explicit_skinny_shapes() -> None:
    samples = measure_matmul((16,), reps=1, skinny=[(8, 16, 4)])
    assert [s.units for s in samples] == [2.0 * 16**3, 4.0 * 16**3, 2.0 * 8 * 16 * 4,
                                          4.0 * 8 * 16 * 4]  # fmt: skip


def test_cuda_sizes_are_llama_shapes_up_to_a_gigabyte() -> None:
    for (dtype, _quick), sizes in measure.CUDA_SIZES.items():
        elt = 2 if dtype == "bf16" else 4
        assert (sizes.heads, sizes.head_dim, sizes.hidden) == (32, 128, 8192)
        assert sizes.skinny and all(
            k in (4096, 8192, 3584, 14336, 28672) for _, k, _ in sizes.skinny
        )
        assert max(sizes.norm) * sizes.hidden * elt <= 1 << 30
        assert max(sizes.elementwise) * 2 * elt <= 1 << 30  # two inputs
        assert max(sizes.optimizer) * 4 <= 1 << 30  # fp32 parameters
    full = measure.CUDA_SIZES["bf16", False]
    assert max(full.matmul) == 16384 and max(n for _, _, n in full.skinny) == 28672
    assert max(full.attention) == 16384 and min(m for m, _, _ in full.skinny) == 2048


def test_cli_profile_across_nodes_needs_a_base_and_a_link(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["profile", "--nnodes", "2", "--master-addr", "127.0.0.1"]
    assert main([*args, "--link", "ib"]) == 2
    assert "give --base PROFILE" in capsys.readouterr().err
    assert main(["profile", "--link", "ib"]) == 2
    assert "--base and --link go with --nnodes" in capsys.readouterr().err
    assert main(["profile", "--nnodes", "0"]) == 2  # not read as one node
    assert "--nnodes 0: give the number of nodes" in capsys.readouterr().err


@pytest.mark.multiproc
def test_cli_profile_across_two_launchers_adds_the_link(tmp_path: Path) -> None:
    """Two launchers on this machine acting as two nodes of 2 ranks: node 0 writes the base
    profile plus link "ib", fitted over every rank (4) and one rank per node (2)."""
    import subprocess
    import sys

    from tests.cost.test_lines import _profile_with_link

    base = _profile_with_link(tmp_path / "base.json", "loopback", slope=1e-9, overhead=1e-3)
    out = tmp_path / "both.json"
    argv = [sys.executable, "-m", "hspmd", "profile", "--quick", "--nproc", "2", "--nnodes",
            "2", "--master-addr", "127.0.0.1", "--master-port", "29664", "--base", str(base),
            "--link", "ib", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}
    procs = [
        subprocess.Popen([*argv, "--node-rank", str(k)], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for k in (0, 1)
    ]  # fmt: skip
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "node 1: collectives timed across 2 nodes" in outs[1][0]
    profile = load_profile(out)
    assert profile.compute == load_profile(base).compute
    assert set(profile.links) == {"loopback", "ib"}
    for op, fit in profile.links["ib"].items():
        assert fit.group_size == 4 and [n for n, _ in fit.groups] == [2], op
        assert fit.fit.overhead_s > 0 or fit.fit.per_unit_s > 0, op
    assert "over 2 nodes x 2 processes" in profile.host["collectives (ib)"]
