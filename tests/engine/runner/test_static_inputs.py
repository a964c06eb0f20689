"""StaticInputs: the one static-input arena of the captured steps (StepGraphs, the speculator's
tree build): segment layout, ghost rows, host and device views after the one upload, float64
tables, the bucket policy. CPU always; the device-to-device inputs on CUDA too (``-m gpu``)."""

import numpy as np
import pytest
import torch

from ssdlib.engine.runner.static_inputs import Segment, StaticInputs, batch_bucket, batch_buckets

GREEDY = (1.0, 0.0, 1.0, 1.0)


def devices():
    out = ["cpu"]
    if torch.cuda.is_available():
        out.append(pytest.param("cuda", marks=pytest.mark.gpu))
    return out


def arena(device, max_batch=6, all_buckets=False):
    return StaticInputs(device, max_batch, {
        "ids": Segment(5), "limit": Segment(5, ghost=1), "slots": Segment(1, ghost=99),
        "reuse": Segment(1, ghost=-1), "table": Segment(4, ghost=GREEDY, float64=True),
        "streams": Segment(2)}, all_buckets=all_buckets)


@pytest.mark.parametrize("device", devices())
def test_segments_tile_the_arena_without_overlap(device):
    a = arena(device)
    assert a.max_rows == batch_bucket(6) == 8
    assert a.size == a.arena.numel() == a.host.size == 8 * (5 + 5 + 1 + 1 + 4 + 2)
    spans = sorted((a.offsets[n], a.offsets[n] + a.max_rows * s.cols)
                   for n, s in a.segments.items())
    assert spans[0][0] == 0 and spans[-1][1] == a.size
    assert all(end == start for (_, end), (start, _) in zip(spans, spans[1:]))  # no gap, no overlap
    # each segment's full view filled with its own value: every one reads back only its own
    for i, (name, seg) in enumerate(a.segments.items()):
        a.host_view(name, a.max_rows, seg.cols).view(np.int64)[:] = i + 1
    a.upload()
    for i, (name, seg) in enumerate(a.segments.items()):
        assert (a.view(name, a.max_rows, seg.cols).view(torch.int64) == i + 1).all(), name
    with pytest.raises(ValueError, match="ids"):
        a.view("ids", 9, 5)  # more rows than the segment holds
    with pytest.raises(ValueError, match="ids"):
        a.host_view("ids", 2, 6)  # more columns


@pytest.mark.parametrize("device", devices())
def test_ghost_rows_past_the_real_ones_and_views_agree_after_upload(device):
    a = arena(device)
    rows = 4  # a batch of 3 in bucket 4: one ghost row
    a.put("ids", rows, [[1, 2, 3], [4, 5, 6], [7, 8, 9]], 3)
    a.put("limit", rows, torch.tensor([[2, 3, 4]] * 3), 3)
    a.put("slots", rows, np.array([5, 0, 2]))
    a.put("reuse", rows, [2, -1, -1])
    a.upload()
    assert a.host_view("ids", rows, 3).tolist() == [[1, 2, 3], [4, 5, 6], [7, 8, 9], [0, 0, 0]]
    assert a.host_view("limit", rows, 3)[3].tolist() == [1, 1, 1]
    assert a.host_view("slots", rows).tolist() == [5, 0, 2, 99]
    assert a.host_view("reuse", rows).tolist() == [2, -1, -1, -1]
    for name, cols in (("ids", 3), ("limit", 3), ("slots", None), ("reuse", None)):
        assert a.view(name, rows, cols).cpu().numpy().tolist() == \
            a.host_view(name, rows, cols).tolist(), name
    # a smaller bucket's view is the larger one's first rows
    assert torch.equal(a.view("ids", 2, 3), a.view("ids", rows, 3)[:2])
    # a refill with fewer real rows: the rows past them become ghosts again
    a.put("slots", rows, [4])
    a.upload()
    assert a.view("slots", rows).tolist() == [4, 99, 99, 99]


@pytest.mark.parametrize("device", devices())
def test_float64_table_round_trips(device):
    a = arena(device)
    table = torch.tensor([[0.7, 40.0, 0.9, 0.0], [1.3, 0.0, 1.0, 0.0]], dtype=torch.float64)
    a.put("table", 3, table, 4)
    a.put("streams", 3, torch.tensor([[11, 7], [12, 9]]), 2)
    a.upload()
    host = a.host_view("table", 3, 4)
    dev = a.view("table", 3, 4)
    assert host.dtype == np.float64 and dev.dtype == torch.float64
    assert dev.cpu().tolist() == host.tolist() == table.tolist() + [list(GREEDY)]
    # the int64 arena holds the float64 bits
    bits = a.arena[a.offsets["table"]:a.offsets["table"] + 12].cpu()
    assert torch.equal(bits.view(torch.float64).view(3, 4), dev.cpu())
    assert a.view("streams", 3, 2).tolist() == [[11, 7], [12, 9], [0, 0]]


def test_bucket_policy():
    one = arena("cpu", max_batch=20)  # max_rows 24: buckets 1, 2, 4, 8, 16, 24
    assert one.fill_rows(4) == 4 and one.capture_buckets(4) == [4]
    every = arena("cpu", max_batch=20, all_buckets=True)
    assert every.fill_rows(4) == 24
    assert every.capture_buckets(4) == [1, 2, 8, 16, 24, 4]  # the one asked for last
    assert every.capture_buckets(24) == [1, 2, 4, 8, 16, 24]
    with pytest.raises(ValueError, match="cols"):
        StaticInputs("cpu", 2, {"x": Segment(0)})
    # every bucket up to the one serving the rows (the feature drafter's captured steps too)
    assert batch_buckets(1) == [1] and batch_buckets(3) == [1, 2, 4]
    assert batch_buckets(17) == [1, 2, 4, 8, 16, 24] == batch_buckets(24)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_device_inputs_are_copied_after_the_upload():
    """An input already on the device fills its real rows device to device; its ghost rows come
    with the one host copy."""
    a = arena("cuda")
    first = torch.tensor([3, 4, 5], device="cuda")
    a.put("ids", 4, first, 1)  # [3] values into [3, 1] rows
    a.put("slots", 4, torch.tensor([1, 2, 3], device="cuda"))
    a.upload()
    assert a.view("ids", 4, 1).view(-1).tolist() == [3, 4, 5, 0]
    assert a.view("slots", 4).tolist() == [1, 2, 3, 99]
