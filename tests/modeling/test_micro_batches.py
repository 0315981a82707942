"""Micro-batches: on a GPU a calibration batch whose MLP activations would pass
`forward.GPU_ACTIVATION_BYTES` runs in pieces of whole samples, the same pieces in every pipeline."""

from __future__ import annotations

import pytest
import torch

from resserve_export.modeling import data, forward


def _batches(sizes, width=6):
    out, k = [], 0
    for n in sizes:
        ids = torch.arange(k, k + n * width).reshape(n, width)
        mask = torch.ones(n, width, dtype=torch.long)
        mask[-1, width // 2 :] = 0  # right padding in the last sample
        out.append({"input_ids": ids, "attention_mask": mask})
        k += n * width
    return out


@pytest.mark.parametrize("rows, pieces", [(None, [3, 5, 1]), (100, [3, 5, 1]), (30, [3, 5, 1]), (12, [2, 1, 2, 2, 1, 1]), (6, [1] * 9), (1, [1] * 9)])
def test_micro_batches_keep_every_sample_in_order(rows, pieces):
    batches = _batches([3, 5, 1])
    got = data.micro_batches(batches, rows)
    assert [int(b["input_ids"].shape[0]) for b in got] == pieces
    for key in ("input_ids", "attention_mask"):
        assert torch.equal(torch.cat([b[key] for b in got]), torch.cat([b[key] for b in batches]))
    assert all(b["input_ids"].shape[1] == 6 for b in got)  # the batch's width: positions unchanged
    again = data.micro_batches(got, rows)
    assert len(again) == len(got) and all(a["input_ids"] is b["input_ids"] for a, b in zip(again, got))


def test_micro_batch_rows_follow_the_mlp_width_and_device():
    qwen3_8b = {"hidden_size": 4096, "intermediate_size": 12288}
    assert forward.micro_batch_rows(qwen3_8b, 2, "cpu") is None
    assert forward.micro_batch_rows(qwen3_8b, 2, torch.device("cuda", 0)) == forward.GPU_ACTIVATION_BYTES // (4 * 12288 * 2) == 2730
    # a wrapper's text config; no intermediate size: four times the hidden size
    assert forward.micro_batch_rows({"text_config": {"hidden_size": 64}}, 4, "cuda") == forward.GPU_ACTIVATION_BYTES // (4 * 256 * 4)
    assert forward.micro_batch_rows({"intermediate_size": 1 << 40}, 2, "cuda") == 1
