"""tools/distill/lockstep.py: drafts trained in lockstep must share what the loop shares."""

import pytest
import torch

from tools.distill.lockstep import check_lockstep


def test_check_lockstep_refuses_unshared_parts():
    from types import SimpleNamespace as NS
    batcher, teacher, dev = object(), object(), torch.device("cpu")
    ok = NS(batcher=batcher, teacher=teacher, device=dev, step=0)
    check_lockstep([ok, NS(**vars(ok))])
    for bad, msg in ((dict(batcher=object()), "one Batcher"), (dict(teacher=object()),
                     "one teacher"), (dict(step=3), "same step")):
        with pytest.raises(ValueError, match=msg):
            check_lockstep([ok, NS(**{**vars(ok), **bad})])
    with pytest.raises(ValueError, match="no drafts"):
        check_lockstep([])
