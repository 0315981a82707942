"""E2M1 element encoding and nibble packing (docs/formats.md, "The FP4 element (E2M1)"), written out by hand."""

from __future__ import annotations

import pytest
import torch

from resserve_export.formats.fp4 import decode_e2m1, encode_e2m1, encode_e2m1_packed, pack_fp4, unpack_fp4

# (input already divided by its scale, expected code). One case per representable value, every
# midpoint between neighbours, values just either side of a midpoint, and saturation.
E2M1_CASES = [
    (0.0, 0b0000),
    (0.5, 0b0001),
    (1.0, 0b0010),
    (1.5, 0b0011),
    (2.0, 0b0100),
    (3.0, 0b0101),
    (4.0, 0b0110),
    (6.0, 0b0111),
    (-0.5, 0b1001),
    (-1.0, 0b1010),
    (-1.5, 0b1011),
    (-2.0, 0b1100),
    (-3.0, 0b1101),
    (-4.0, 0b1110),
    (-6.0, 0b1111),
    # ties
    (0.25, 0b0000),  # tie to even: 0 (code 0) not 0.5 (code 1)
    (0.75, 0b0010),  # tie to even: 1 (code 2) not 0.5 (code 1)
    (1.25, 0b0010),  # tie to even: 1 (code 2) not 1.5 (code 3)
    (1.75, 0b0100),  # tie to even: 2 (code 4) not 1.5 (code 3)
    (2.5, 0b0100),  # tie to even: 2 (code 4) not 3 (code 5)
    (3.5, 0b0110),  # tie to even: 4 (code 6) not 3 (code 5)
    (5.0, 0b0110),  # tie to even: 4 (code 6) not 6 (code 7)
    (-0.25, 0b1000),  # tie to even: -0 (code 8)
    (-0.75, 0b1010),  # tie to even: -1
    (-1.25, 0b1010),  # tie to even: -1
    (-1.75, 0b1100),  # tie to even: -2
    (-2.5, 0b1100),  # tie to even: -2
    (-3.5, 0b1110),  # tie to even: -4
    (-5.0, 0b1110),  # tie to even: -4
    # just either side of the midpoints: nearest, no tie
    (0.2500001, 0b0001),
    (0.7499999, 0b0001),
    (1.2500001, 0b0011),
    (1.7499999, 0b0011),
    (2.5000002, 0b0101),
    (3.4999998, 0b0101),
    (5.0000005, 0b0111),
    (4.9999995, 0b0110),
    # signed zeros: an exact zero of either sign is +0 (ModelOpt tests `x < 0`); a negative
    # value that rounds to zero keeps its sign (-0, code 8)
    (-0.0, 0b0000),
    (-1e-30, 0b1000),
    (-0.24, 0b1000),
    (1e-30, 0b0000),
    # saturation above 6
    (6.0000005, 0b0111),
    (7.0, 0b0111),
    (1e30, 0b0111),
    (float("inf"), 0b0111),
    (-7.0, 0b1111),
    (-1e30, 0b1111),
]


def test_e2m1_table():
    x = torch.tensor([v for v, _ in E2M1_CASES], dtype=torch.float32)
    got = encode_e2m1(x)
    bad = [(v, c, int(g)) for (v, c), g in zip(E2M1_CASES, got) if int(g) != c]
    assert not bad, f"(input, expected, got): {bad}"


def test_signed_zeros():
    # An exact zero is +0 whatever its sign bit (bf16 weights do contain -0.0; ModelOpt writes +0).
    assert encode_e2m1(torch.tensor([0.0, -0.0])).tolist() == [0b0000, 0b0000]
    # A negative value that rounds to zero is -0 (code 8), as ModelOpt and the hardware cast.
    assert encode_e2m1(torch.tensor([-0.1, -0.25, -1e-45])).tolist() == [0b1000, 0b1000, 0b1000]


def test_decode_table():
    codes = torch.arange(16, dtype=torch.uint8)
    want = torch.tensor(
        [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    )
    got = decode_e2m1(codes)
    assert got.dtype == torch.float32
    assert torch.equal(got, want)
    # code 8 decodes to a zero (its sign is irrelevant to every product)
    assert got[8].item() == 0.0


def test_encode_decode_round_trip_on_all_codes():
    codes = torch.arange(16, dtype=torch.uint8)
    # -0 (code 8) decodes to 0.0 which re-encodes as +0: the only code that does not round-trip.
    back = encode_e2m1(decode_e2m1(codes))
    want = codes.clone()
    want[8] = 0
    assert torch.equal(back, want)


def test_nibble_order_pinned():
    # element 2i -> low nibble, element 2i+1 -> high nibble
    codes = torch.tensor([0b0001, 0b0111, 0b1010, 0b0011], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.tolist() == [0b0111_0001, 0b0011_1010]
    assert torch.equal(unpack_fp4(packed), codes)
    # the fused encode+pack path packs the same way
    vals = torch.tensor([0.5, 6.0, -1.0, 1.5])
    assert encode_e2m1_packed(vals).tolist() == [0b0111_0001, 0b0011_1010]


def test_pack_batched_and_odd():
    codes = torch.randint(0, 16, (3, 5, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = pack_fp4(codes)
    assert packed.shape == (3, 5, 16)
    assert torch.equal(unpack_fp4(packed), codes)
    with pytest.raises(ValueError, match="odd number"):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))
