"""Lloyd-Max codebooks (checked against scipy integration) and rotations (orthogonal, seeded, cached)."""

from __future__ import annotations

import contextlib
import io
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from scipy import integrate, special, stats

from tq_hf import codebook as codebook_module
from tq_hf.codebook import Codebook, codebook_mse, lloyd_max, rotation_matrix

HEAD_DIMS = (32, 64, 96, 128, 256)
# Gaussian N(0, 1) Lloyd-Max MSE (Max 1960; also the TurboQuant paper's per-coordinate figures).
GAUSSIAN_MSE = {2: 0.1175, 3: 0.03454, 4: 0.009497}


# ---- the exact coordinate density, integrated by scipy ------------------------------------------
def scaled_density(head_dim: int):
    """Normalised density of s = sqrt(D) * t, t one coordinate of a uniform unit vector in R^D."""
    root = math.sqrt(head_dim)
    a = (head_dim - 1) / 2
    # t ~ 2 * Beta(a, a) - 1 on [-1, 1]: f(t) = (1 - t^2)^(a - 1) / (2^(2a-1) B(a, a))
    log_norm = (2 * a - 1) * math.log(2) + special.betaln(a, a)

    def pdf(s: float) -> float:
        t = s / root
        return math.exp((a - 1) * math.log1p(-t * t) - log_norm) / root if abs(t) < 1 else 0.0

    return pdf, root


def _cells(book: Codebook, root: float) -> list[tuple[float, float]]:
    edges = [-root, *book.boundaries.double().tolist(), root]
    return list(zip(edges[:-1], edges[1:]))


def _quad(f, lo, hi) -> float:
    return integrate.quad(f, lo, hi, epsabs=1e-13, epsrel=1e-11, limit=200)[0]


def test_scipy_density_is_normalised_with_unit_variance():
    """Sanity of the test's own density: mass 1, variance 1 (a coordinate of a unit vector has E t^2 = 1/D)."""
    for d in (32, 128, 256):
        pdf, root = scaled_density(d)
        assert _quad(pdf, -root, root) == pytest.approx(1.0, abs=1e-9)
        assert _quad(lambda s: s * s * pdf(s), -root, root) == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("bits", (2, 3, 4))
def test_centroid_condition_against_scipy(head_dim, bits):
    """Lloyd-Max optimality: each centroid is the conditional mean of its cell; boundaries are midpoints.

    Tolerance 2.5e-4: the solver snaps boundaries to a 2**17-point grid over [-sqrt(D), sqrt(D)]
    (spacing 2.4e-4 at D = 256); measured deviations grow with that spacing, from 9e-6 (D=32,
    2 bits) to 1.05e-4 (D=256, 4 bits).
    """
    book = lloyd_max(head_dim, bits)
    pdf, root = scaled_density(head_dim)
    assert book.centroids.dtype == torch.float32 and book.centroids.shape == (1 << bits,)
    assert book.bits == bits
    assert torch.all(book.centroids[1:] > book.centroids[:-1])
    torch.testing.assert_close(book.boundaries, (book.centroids[1:] + book.centroids[:-1]) / 2, rtol=0, atol=1e-7)
    for i, (lo, hi) in enumerate(_cells(book, root)):
        mass = _quad(pdf, lo, hi)
        mean = _quad(lambda s: s * pdf(s), lo, hi) / mass
        assert abs(mean - book.centroids[i].item()) < 2.5e-4, (
            f"D={head_dim} bits={bits} cell {i} [{lo:.4f}, {hi:.4f}]: centroid {book.centroids[i].item():.6f}, "
            f"scipy conditional mean {mean:.6f}"
        )


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("bits", (2, 3, 4))
def test_codebook_mse_against_scipy(head_dim, bits):
    book = lloyd_max(head_dim, bits)
    pdf, root = scaled_density(head_dim)
    mse = sum(
        _quad(lambda s, c=c: (s - c) ** 2 * pdf(s), lo, hi)
        for (lo, hi), c in zip(_cells(book, root), book.centroids.double().tolist())
    )
    assert codebook_mse(head_dim, bits) == pytest.approx(mse, rel=1e-4), f"D={head_dim} bits={bits}"


def _gaussian_lloyd_max(bits: int) -> tuple[np.ndarray, float]:
    """Independent Lloyd-Max solve for N(0, 1) with closed-form cell means (scipy.stats.norm)."""
    n = stats.norm
    c = n.ppf((np.arange(1 << bits) + 0.5) / (1 << bits))
    for _ in range(2000):
        b = np.concatenate([[-np.inf], (c[1:] + c[:-1]) / 2, [np.inf]])
        mass = n.cdf(b[1:]) - n.cdf(b[:-1])
        c, previous = (n.pdf(b[:-1]) - n.pdf(b[1:])) / mass, c
        if np.abs(c - previous).max() < 1e-12:
            break
    b = np.concatenate([[-np.inf], (c[1:] + c[:-1]) / 2, [np.inf]])
    # E[(X - c)^2 | cell] integrated in closed form: E X^2 - 2c E X + c^2 over each cell
    bb = np.where(np.isfinite(b), b, 0.0)
    ex2 = (n.cdf(b[1:]) - n.cdf(b[:-1])) + (bb[:-1] * n.pdf(b[:-1]) - bb[1:] * n.pdf(b[1:]))
    ex = n.pdf(b[:-1]) - n.pdf(b[1:])
    mass = n.cdf(b[1:]) - n.cdf(b[:-1])
    return c, float(np.sum(ex2 - 2 * c * ex + c * c * mass))


@pytest.mark.parametrize("bits", (2, 3, 4))
def test_gaussian_limit(bits):
    """For D >= 64 the exact-Beta codebook is within 5% of the Gaussian Lloyd-Max (MSE and centroids),
    and the gap shrinks as D grows (the Beta marginal tends to N(0, 1))."""
    centroids, mse = _gaussian_lloyd_max(bits)
    assert mse == pytest.approx(GAUSSIAN_MSE[bits], rel=2e-3)  # our scipy solver reproduces the literature
    gaps = []
    for d in (64, 96, 128, 256):
        exact = codebook_mse(d, bits)
        gap = abs(exact - GAUSSIAN_MSE[bits]) / GAUSSIAN_MSE[bits]
        assert gap < 0.05, f"D={d} bits={bits}: codebook MSE {exact:.6f} vs Gaussian {GAUSSIAN_MSE[bits]}"
        np.testing.assert_allclose(lloyd_max(d, bits).centroids.double().numpy(), centroids, rtol=0.05, atol=0.01)
        gaps.append(gap)
    assert gaps == sorted(gaps, reverse=True), gaps
    # The finite-support Beta is lighter-tailed than N(0, 1): its MSE is lower.
    assert codebook_mse(64, bits) < GAUSSIAN_MSE[bits]


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("bits", (2, 3, 4))
def test_centroids_symmetric(head_dim, bits):
    c = lloyd_max(head_dim, bits).centroids
    torch.testing.assert_close(c, -c.flip(0), rtol=0, atol=1e-5)


@pytest.mark.parametrize("bits", (0, 1, 5, 8))
def test_lloyd_max_rejects_unsupported_bits(bits):
    with pytest.raises(ValueError, match="2, 3 or 4"):
        lloyd_max(64, bits)


def test_codebook_cached_by_value():
    a = lloyd_max(128, 4)
    assert lloyd_max(128, 4) is a
    assert lloyd_max(128, 4, torch.device("cpu")) is a
    assert lloyd_max(128, 4, "cpu") is a
    assert lloyd_max(128, 3) is not a and lloyd_max(64, 4) is not a


# ---- rotations ----------------------------------------------------------------------------------
ROTATION_CASES = [("hadamard", d) for d in (32, 64, 128, 256)] + [("random", d) for d in (32, 48, 96, 128, 160, 256)]


@pytest.mark.parametrize("kind, head_dim", ROTATION_CASES)
@pytest.mark.parametrize("seed", (0, 12345))
def test_rotation_orthogonal(kind, head_dim, seed):
    r = rotation_matrix(head_dim, kind, seed)
    assert r.shape == (head_dim, head_dim) and r.dtype == torch.float32
    eye = torch.eye(head_dim, dtype=torch.float64)
    torch.testing.assert_close(r.double() @ r.double().T, eye, rtol=0, atol=2e-6)
    torch.testing.assert_close(r.double().T @ r.double(), eye, rtol=0, atol=2e-6)


@pytest.mark.parametrize("head_dim", (32, 64, 128, 256))
def test_hadamard_is_signed_walsh_hadamard(head_dim):
    """Entries are +-1/sqrt(D), and R = H diag(signs) with H the Sylvester Hadamard matrix."""
    r = rotation_matrix(head_dim, "hadamard", 3).double()
    torch.testing.assert_close(r.abs(), torch.full_like(r, 1 / math.sqrt(head_dim)), rtol=0, atol=1e-7)
    signs = torch.sign(r[0])  # first row of Sylvester H is all ones
    i = torch.arange(head_dim)
    sylvester = (-1.0) ** torch.tensor([[bin(a & b).count("1") for b in i.tolist()] for a in i.tolist()]).double()
    torch.testing.assert_close(r * math.sqrt(head_dim), sylvester * signs[None, :], rtol=0, atol=1e-6)
    assert 0 < (signs > 0).sum() < head_dim  # randomized: not all signs equal


@pytest.mark.parametrize("kind, head_dim", [("hadamard", 64), ("random", 96)])
def test_rotation_differs_across_seeds(kind, head_dim):
    mats = [rotation_matrix(head_dim, kind, s) for s in range(4)]
    for a in range(4):
        for b in range(a + 1, 4):
            assert (mats[a] - mats[b]).abs().max() > 0.1, (kind, a, b)


def test_rotation_cached_by_value_not_address():
    r = rotation_matrix(128, "hadamard", 0)
    assert rotation_matrix(128, "hadamard", 0) is r
    assert rotation_matrix(128, "hadamard", 0, torch.device("cpu")) is r
    assert rotation_matrix(128, "hadamard", 1) is not r
    assert rotation_matrix(128, "random", 0) is not r


_CHECKSUM_SCRIPT = """
import torch
from tq_hf.codebook import rotation_matrix, lloyd_max
for kind, d, seed in [("hadamard", 128, 0), ("hadamard", 64, 9), ("random", 96, 0), ("random", 128, 5)]:
    print(rotation_matrix(d, kind, seed).double().mul(1e6).round().abs().sum().item(),
          rotation_matrix(d, kind, seed)[:3, :3].tolist())
print(lloyd_max(128, 3).centroids.tolist())
"""


@pytest.mark.slow
def test_rotation_and_codebook_deterministic_across_processes():
    """A cache written by one process must be readable by another: same seed -> same bits."""
    there = subprocess.run([sys.executable, "-c", _CHECKSUM_SCRIPT], capture_output=True, text=True, check=True).stdout
    here = io.StringIO()
    with contextlib.redirect_stdout(here):
        exec(_CHECKSUM_SCRIPT, {})
    assert there == here.getvalue()


@pytest.mark.parametrize("head_dim", (48, 96, 160))
def test_hadamard_rejects_non_power_of_two(head_dim):
    with pytest.raises(ValueError, match=f"power-of-two head_dim, got {head_dim}"):
        rotation_matrix(head_dim, "hadamard", 0)


def test_unknown_rotation_kind():
    with pytest.raises(ValueError) as err:
        rotation_matrix(64, "givens", 0)
    assert "'givens'" in str(err.value) and "'hadamard'" in str(err.value) and "'random'" in str(err.value)


@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_4bit_key_centroids_on_the_byte_grid_cost_little(head_dim):
    """The 4-bit key codec's centroids (reference.on_byte_grid): whole multiples 1..255 of the largest magnitude / 255,
    within half a step of Lloyd-Max's, symmetric, and (with Lloyd-Max's boundaries) an expected squared error at most
    0.2% above Lloyd-Max's, integrated with scipy."""
    from tq_hf.config import TurboQuantConfig
    from tq_hf.reference import key_codec

    book = lloyd_max(head_dim, 4)
    snapped = key_codec(TurboQuantConfig.from_preset("4bit"), head_dim, "cpu").centroids
    step = book.centroids.abs().max() / 255
    m = torch.round(snapped / step)
    assert torch.equal(m * step, snapped) and int(m.abs().min()) >= 1 and int(m.abs().max()) == 255
    assert torch.equal(snapped.flip(0), -snapped)
    assert float((snapped - book.centroids).abs().max()) <= float(step) / 2 + 1e-7
    pdf, root = scaled_density(head_dim)

    def mse(centroids):
        return sum(_quad(lambda s, c=c: (s - c) ** 2 * pdf(s), lo, hi)
                   for (lo, hi), c in zip(_cells(book, root), centroids.double().tolist()))

    assert mse(book.centroids) < mse(snapped) <= 1.002 * mse(book.centroids)


@pytest.mark.parametrize("kind", ["hadamard", "random"])
def test_constants_build_whatever_the_default_device(kind):
    """Under torch.set_default_device(...) (here the meta device; on a GPU, "cuda") the seeded rotations and the
    codebooks are still built on the CPU, equal to the same functions run uncached without it (sizes and a seed no
    other test asks for, so the cached builders run here first)."""
    with torch.device("meta"):
        got = rotation_matrix(32, kind, 4321, "cpu")
        book = lloyd_max(40, 3, "cpu")
    want = codebook_module._rotation_cpu.__wrapped__.__wrapped__(32, kind, 4321)
    want_book = codebook_module._lloyd_max_cpu.__wrapped__.__wrapped__(40, 3)
    assert got.device.type == "cpu" and torch.equal(got, want)
    assert torch.equal(book.centroids, want_book.centroids) and torch.equal(book.boundaries, want_book.boundaries)
