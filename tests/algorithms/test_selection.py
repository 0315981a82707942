"""Block-local top-k channel selection and uint8 masks (docs/formats.md, "Channel selection and masks")."""

from __future__ import annotations

import pytest
import torch

from resserve_export.algorithms.selection import bool_to_mask, check_ratio, mask_to_bool, mask_to_indices, mode_of, select_mask


def _reference(mean_abs: torch.Tensor, ratio: float) -> torch.Tensor:
    """Plain-Python top-k per group of 8: larger value first, then lower index."""
    k = int(ratio * 8)
    sel = torch.zeros(mean_abs.numel(), dtype=torch.bool)
    vals = mean_abs.tolist()
    for g in range(0, len(vals), 8):
        order = sorted(range(g, g + 8), key=lambda i: (-vals[i], i))
        for i in order[:k]:
            sel[i] = True
    return sel


def test_mask_bit_order():
    # bit b of byte g <=> channel 8g + b
    m = torch.zeros(16)
    m[5] = 1.0  # group 0, channel 5
    m[8] = 1.0  # group 1, channel 0
    assert select_mask(m, 0.125).tolist() == [0b0010_0000, 0b0000_0001]
    m[15] = 2.0  # group 1, channel 7 is now the most salient
    assert select_mask(m, 0.125).tolist() == [0b0010_0000, 0b1000_0000]
    assert select_mask(m, 0.25).tolist()[1] == 0b1000_0001


def test_ties_go_to_lower_index():
    assert select_mask(torch.ones(8), 0.125).tolist() == [0b0000_0001]
    assert select_mask(torch.ones(8), 0.25).tolist() == [0b0000_0011]
    assert select_mask(torch.ones(8), 0.5).tolist() == [0b0000_1111]
    # channels 1, 2 and 4 tie at the top: k = 2 takes 1 and 2
    m = torch.tensor([1.0, 3.0, 3.0, 0.0, 3.0, 0.0, 0.0, 0.0])
    assert select_mask(m, 0.25).tolist() == [0b0000_0110]
    # a tie at the k-th place: 5 wins alone, then 0 beats 6 for the second slot
    m = torch.tensor([2.0, 0.0, 0.0, 0.0, 0.0, 9.0, 2.0, 0.0])
    assert select_mask(m, 0.25).tolist() == [0b0010_0001]


@pytest.mark.parametrize("ratio, k", [(0.0, 0), (0.125, 1), (0.25, 2), (0.5, 4), (1.0, 8)])
def test_ratio_to_k(ratio, k):
    m = torch.rand(4096, generator=torch.Generator().manual_seed(3))
    mask = select_mask(m, ratio)
    assert mask.dtype == torch.uint8 and mask.shape == (512,)
    per_group = mask_to_bool(mask).reshape(-1, 8).sum(-1)
    assert (per_group == k).all()
    assert mode_of(ratio) == ("plain" if k == 0 else "full" if k == 8 else "k_ext")


def test_modes():
    assert [mode_of(r) for r in (0, 0.125, 0.25, 0.5, 1)] == ["plain", "k_ext", "k_ext", "k_ext", "full"]


@pytest.mark.parametrize("ratio", [0.125, 0.25, 0.5])
def test_matches_plain_python_reference_with_many_ties(ratio):
    g = torch.Generator().manual_seed(7)
    # few distinct values -> many ties within groups
    m = torch.randint(0, 4, (1024,), generator=g).float() / 4
    assert torch.equal(mask_to_bool(select_mask(m, ratio)), _reference(m, ratio))


def test_deterministic():
    g = torch.Generator().manual_seed(11)
    m = torch.randint(0, 3, (2048,), generator=g).float()
    a = select_mask(m, 0.25)
    b = select_mask(m.clone(), 0.25)
    c = select_mask(m.double(), 0.25)  # salience is compared as stored float32
    assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("ratio", [0.3, 0.75, -0.125, 2.0, 0.0625])
def test_invalid_ratio_raises(ratio):
    with pytest.raises(ValueError, match=r"choose one of \[0.0, 0.125, 0.25, 0.5, 1.0\]"):
        select_mask(torch.ones(8), ratio)
    with pytest.raises(ValueError):
        check_ratio(ratio)


def test_width_not_multiple_of_8_raises():
    with pytest.raises(ValueError, match="multiple of the selection group 8"):
        select_mask(torch.ones(12), 0.25)


def test_mask_conversions_round_trip():
    g = torch.Generator().manual_seed(5)
    mask = torch.randint(0, 256, (64,), generator=g).to(torch.uint8)
    sel = mask_to_bool(mask)
    assert sel.shape == (512,)
    assert torch.equal(bool_to_mask(sel), mask)
    idx = mask_to_indices(mask)
    assert torch.equal(idx, torch.nonzero(sel).reshape(-1))
    assert (idx[1:] > idx[:-1]).all()  # ascending: the compaction order
    assert mask_to_indices(torch.tensor([0b1000_0001, 0b0000_0100], dtype=torch.uint8)).tolist() == [0, 7, 10]


def test_select_masks_from_one_sort_are_select_mask():
    """`select_masks` (one stable sort for every ratio) gives `select_mask`'s bits, ties included."""
    from resserve_export.algorithms.selection import select_masks
    from resserve_export.formats.constants import RATIOS

    g = torch.Generator().manual_seed(0)
    for mean_abs in (torch.rand(256, generator=g), torch.randint(0, 3, (256,), generator=g).float(), torch.zeros(64)):
        got = select_masks(mean_abs, RATIOS)
        assert set(got) == set(RATIOS)
        for r in RATIOS:
            assert torch.equal(got[r], select_mask(mean_abs, r)), r
