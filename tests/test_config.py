"""TurboQuantConfig: presets, validation, head_dim checks and the byte sizes of the format."""

from __future__ import annotations

from fractions import Fraction

import pytest

from tq_hf.config import PRESETS, TurboQuantConfig


# ---- presets ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, key_bits, value_bits",
    [("k8v4", 8, 4), ("4bit", 4, 4), ("k3v4", 3, 4), ("3bit", 3, 3)],
)
def test_preset_fields(name, key_bits, value_bits):
    cfg = TurboQuantConfig.from_preset(name)
    assert (cfg.key_bits, cfg.value_bits) == (key_bits, value_bits)
    # everything else keeps the dataclass defaults
    default = TurboQuantConfig()
    for field in ("norm_correction", "rotation", "block_size", "full_precision_layers", "prefill_attention", "seed"):
        assert getattr(cfg, field) == getattr(default, field), field
    assert cfg.uses_codebook == (key_bits != 8)


def test_presets_table_is_exactly_the_four_documented():
    assert set(PRESETS) == {"k8v4", "4bit", "k3v4", "3bit"}


def test_default_config_is_the_4bit_preset_with_the_measured_levers():
    cfg = TurboQuantConfig()
    assert cfg == TurboQuantConfig.from_preset("4bit")
    assert (cfg.key_bits, cfg.value_bits, cfg.norm_correction) == (4, 4, True)
    assert (cfg.key_centering, cfg.value_rotation, cfg.exact_prefix_tokens, cfg.recent_window) == (True, True, 4, 128)
    assert all(TurboQuantConfig.from_preset(p).key_centering for p in PRESETS)  # FP8 keys too (Qwen2.5's biases)
    assert cfg.full_precision_layers == () and cfg.dense_layer_kl == 0.5 and cfg.recent_format == "auto"


@pytest.mark.parametrize("preset,records", [("4bit", True), ("k3v4", True), ("3bit", True), ("k8v4", False)])
def test_ring_records_by_key_format(preset, records):
    """recent_format "auto": int8 records for codebook keys, exact tokens for FP8 keys; "int8" / "exact" as named."""
    assert TurboQuantConfig.from_preset(preset).ring_records is records
    assert TurboQuantConfig.from_preset(preset, recent_format="int8").ring_records
    assert not TurboQuantConfig.from_preset(preset, recent_format="exact").ring_records


@pytest.mark.parametrize("field, bad", [("exact_prefix_tokens", -1), ("exact_prefix_tokens", 65),
                                        ("exact_prefix_tokens", 2.0), ("recent_window", -1),
                                        ("recent_window", 5000), ("key_centering", 1), ("value_rotation", "yes"),
                                        ("recent_format", "fp8"), ("recent_format", None),
                                        ("chunk_history_tokens", -1), ("chunk_history_tokens", 5000),
                                        ("chunk_history_tokens", 256.0)])
def test_lever_fields_validated(field, bad):
    with pytest.raises(ValueError, match=field):
        TurboQuantConfig(**{field: bad})


def test_from_preset_overrides():
    cfg = TurboQuantConfig.from_preset(
        "k3v4", value_bits=3, rotation="random", block_size=64, full_precision_layers=[], seed=7,
        norm_correction=False, prefill_attention="compressed",
    )
    assert cfg == TurboQuantConfig(
        key_bits=3, value_bits=3, rotation="random", block_size=64, full_precision_layers=(), seed=7,
        norm_correction=False, prefill_attention="compressed",
    )
    assert cfg.full_precision_layers == ()  # list normalised to a tuple (hashable, frozen)
    hash(cfg)


def test_from_preset_overrides_are_validated():
    for bad in (8, 16.0, True, "64"):
        with pytest.raises(ValueError, match=r"block_size=.* supported values: 16, 32, 64, or None"):
            TurboQuantConfig.from_preset("4bit", block_size=bad)
    assert TurboQuantConfig().block_size is None  # chosen per head_dim by the layout (test_layout)


def test_config_is_frozen():
    cfg = TurboQuantConfig()
    with pytest.raises(AttributeError):
        cfg.key_bits = 3  # type: ignore[misc]


def test_unknown_preset_names_supported_presets():
    with pytest.raises(ValueError) as err:
        TurboQuantConfig.from_preset("2bit")
    for name in ("'2bit'", "k8v4", "4bit", "k3v4", "3bit"):
        assert name in str(err.value)


def test_unknown_override_names_the_fields():
    with pytest.raises(ValueError) as err:
        TurboQuantConfig.from_preset("4bit", key_bit=3)
    msg = str(err.value)
    assert "key_bit" in msg and "key_bits" in msg and "value_bits" in msg


# ---- validation ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field, bad, allowed",
    [
        ("key_bits", 2, ["3", "4", "8"]),
        ("key_bits", 5, ["3", "4", "8"]),
        ("value_bits", 8, ["3", "4"]),
        ("value_bits", 2, ["3", "4"]),
        ("rotation", "walsh", ["'hadamard'", "'random'"]),
        ("rotation", None, ["'hadamard'", "'random'"]),
        ("block_size", 8, ["16", "32", "64"]),
        ("block_size", 128, ["16", "32", "64"]),
        ("prefill_attention", "fast", ["'exact'", "'compressed'"]),
        ("sliding_layers", "dense", ["'exact'", "'compressed'"]),
    ],
)
def test_invalid_choice_names_field_and_allowed_values(field, bad, allowed):
    with pytest.raises(ValueError) as err:
        TurboQuantConfig(**{field: bad})
    msg = str(err.value)
    assert field in msg and repr(bad) in msg, msg
    for value in allowed:
        assert value in msg, f"{value} missing from: {msg}"


@pytest.mark.parametrize("field, bad", [("key_bits", 4.0), ("value_bits", 4.0), ("block_size", 16.0), ("key_bits", True)])
def test_non_integer_sizes_are_rejected(field, bad):
    """4.0 == 4 would slip through a plain `in` check and later yield float byte offsets."""
    with pytest.raises((ValueError, TypeError), match=field):
        TurboQuantConfig(**{field: bad})


@pytest.mark.parametrize("bad", [(0, 1.5), ("0",), (None,), (0, True)])
def test_bad_layer_indices(bad):
    with pytest.raises(ValueError, match="full_precision_layers"):
        TurboQuantConfig(full_precision_layers=bad)


@pytest.mark.parametrize("field, bad", [("norm_correction", 1), ("norm_correction", "yes"), ("seed", 1.5), ("seed", "0")])
def test_bad_flags_and_seed(field, bad):
    with pytest.raises(ValueError, match=field):
        TurboQuantConfig(**{field: bad})


# ---- head_dim -----------------------------------------------------------------------------------
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_power_of_two_head_dims_supported(preset, head_dim):
    TurboQuantConfig.from_preset(preset).check_head_dim(head_dim)


@pytest.mark.parametrize("head_dim", [48, 80, 96, 112, 160, 192, 240])
def test_hadamard_needs_power_of_two(head_dim):
    with pytest.raises(ValueError) as err:
        TurboQuantConfig(rotation="hadamard").check_head_dim(head_dim)
    assert str(head_dim) in str(err.value) and "random" in str(err.value)
    TurboQuantConfig(rotation="random").check_head_dim(head_dim)
    # FP8 keys are not rotated, so hadamard + a non-power-of-two head_dim is fine there
    TurboQuantConfig.from_preset("k8v4", rotation="hadamard", value_rotation=False).check_head_dim(head_dim)
    with pytest.raises(ValueError, match="hadamard"):  # ... but value_rotation rotates the values
        TurboQuantConfig.from_preset("k8v4", rotation="hadamard").check_head_dim(head_dim)


@pytest.mark.parametrize("head_dim", [0, 8, 16, 24, 40, 100, 264, 272, 512])
@pytest.mark.parametrize("rotation", ["random", "hadamard"])
def test_head_dim_range_and_multiple(head_dim, rotation):
    with pytest.raises(ValueError) as err:
        TurboQuantConfig(rotation=rotation).check_head_dim(head_dim)
    msg = str(err.value)
    assert str(head_dim) in msg and "multiples of 16 from 32 to 256" in msg, msg


# ---- byte sizes ---------------------------------------------------------------------------------
# Worked by hand: key codes D*kb/8, value codes D*vb/8, metadata 3 bf16 fields = 6 bytes, fp16 K+V = 4*D.
BYTE_TABLE = [
    # preset, D, key code bytes, value code bytes, token_head_bytes, compression vs fp16
    ("k8v4", 64, 64, 32, 102, Fraction(102, 256)),
    ("k8v4", 96, 96, 48, 150, Fraction(150, 384)),
    ("k8v4", 128, 128, 64, 198, Fraction(198, 512)),
    ("k8v4", 256, 256, 128, 390, Fraction(390, 1024)),
    ("4bit", 64, 32, 32, 70, Fraction(70, 256)),
    ("4bit", 96, 48, 48, 102, Fraction(102, 384)),
    ("4bit", 128, 64, 64, 134, Fraction(134, 512)),
    ("4bit", 256, 128, 128, 262, Fraction(262, 1024)),
    ("k3v4", 64, 24, 32, 62, Fraction(62, 256)),
    ("k3v4", 96, 36, 48, 90, Fraction(90, 384)),
    ("k3v4", 128, 48, 64, 118, Fraction(118, 512)),
    ("k3v4", 256, 96, 128, 230, Fraction(230, 1024)),
    ("3bit", 64, 24, 24, 54, Fraction(54, 256)),
    ("3bit", 96, 36, 36, 78, Fraction(78, 384)),
    ("3bit", 128, 48, 48, 102, Fraction(102, 512)),
    ("3bit", 256, 96, 96, 198, Fraction(198, 1024)),
]


@pytest.mark.parametrize("preset, head_dim, kb, vb, total, ratio", BYTE_TABLE)
def test_byte_sizes_pinned(preset, head_dim, kb, vb, total, ratio):
    cfg = TurboQuantConfig.from_preset(preset, rotation="random")
    cfg.check_head_dim(head_dim)
    assert cfg.metadata_bytes == 6
    assert cfg.key_code_bytes(head_dim) == kb
    assert cfg.value_code_bytes(head_dim) == vb
    assert cfg.token_head_bytes(head_dim) == total
    assert cfg.compression_vs_fp16(head_dim) == pytest.approx(float(ratio), rel=0, abs=1e-12)
    for size in (cfg.key_code_bytes(head_dim), cfg.value_code_bytes(head_dim), cfg.token_head_bytes(head_dim)):
        assert type(size) is int


def test_byte_sizes_do_not_depend_on_other_fields():
    a = TurboQuantConfig.from_preset("4bit")
    b = TurboQuantConfig.from_preset("4bit", rotation="random", block_size=64, seed=3, norm_correction=False)
    assert a.token_head_bytes(128) == b.token_head_bytes(128)


# ---- full precision layers ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "layers, num_layers, expected",
    [
        ((0, 1, -2, -1), 30, {0, 1, 28, 29}),
        ((0, 1, -2, -1), 4, {0, 1, 2, 3}),
        ((0, 1, -2, -1), 3, {0, 1, 2}),  # -2 -> 1 collides with 1: a set, no duplicates
        ((), 30, set()),
        ((-30,), 30, {0}),
        ((5, -5, 29), 30, {5, 25, 29}),
    ],
)
def test_full_precision_layer_set(layers, num_layers, expected):
    cfg = TurboQuantConfig(full_precision_layers=layers)
    assert cfg.full_precision_layer_set(num_layers) == frozenset(expected)


@pytest.mark.parametrize("layers, num_layers, bad", [((0, 1, -2, -1), 1, "1"), ((30,), 30, "30"), ((-31,), 30, "-31")])
def test_full_precision_layer_out_of_range(layers, num_layers, bad):
    cfg = TurboQuantConfig(full_precision_layers=layers)
    with pytest.raises(ValueError) as err:
        cfg.full_precision_layer_set(num_layers)
    msg = str(err.value)
    assert f"entry {bad} " in msg and f"{num_layers} layers" in msg, msg
