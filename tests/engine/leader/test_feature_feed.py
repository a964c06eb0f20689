"""The leader's side of a feature draft's speculator: each OUTCOME's FeatureRows cover every
committed position but the last exactly once over a row's life, read from the target's
feature buffer."""

import pytest
import torch

from ssdlib.distributed.protocol import FeatureRows
from ssdlib.engine.leader.feature_feed import FeatureFeed


class Row:
    def __init__(self, slot, tokens):
        self.slot, self.tokens = slot, tokens


def test_spans_cover_each_committed_position_once():
    buf = torch.randn(4, 32, 6)
    feed = FeatureFeed(buf)
    a, b = Row(0, [1, 2, 3, 4, 5]), Row(2, [7, 8])  # prompts, and the first token each
    feed.admit(0)
    feed.admit(2)
    f = feed.rows([a, b], [True, True], extra=1)
    assert (f.starts, f.counts) == ([0, 0, 0], [4, 1, 0])
    assert torch.equal(f.values[0, :4], buf[0, :4]) and torch.equal(f.values[1, :1], buf[2, :1])
    a.tokens += [9, 9, 9]  # a round: 2 accepted + the bonus
    b.tokens += [9]  # none accepted + the bonus
    f = feed.rows([a, b], [True, False])  # b leaves: nothing for it
    assert (f.starts, f.counts) == ([4, 1], [3, 0])
    assert torch.equal(f.values[0], buf[0, 4:7])
    with pytest.raises(RuntimeError, match="were sent"):
        feed.rows([Row(0, [1, 2])], [True])  # fewer tokens than already sent


def test_feature_rows_are_checked():
    with pytest.raises(ValueError, match="one start"):
        FeatureRows([0], [1, 2], torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="do not fit"):
        FeatureRows([0], [5], torch.zeros(1, 3, 4))


def test_feature_rows_round_trip_on_the_wire():
    rows = FeatureRows([3, 0, 9], [2, 0, 1], torch.randn(3, 2, 5))
    spans = rows.pack_spans()
    assert spans.numel() == FeatureRows.spans_size(3)
    shape = FeatureRows.values_shape(spans, 5)
    back = FeatureRows.unpack(spans, rows.values.clone().view(shape))
    assert (back.starts, back.counts) == (rows.starts, rows.counts)
    assert torch.equal(back.values, rows.values)
