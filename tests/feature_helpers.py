"""Helpers shared by the feature-draft tests: a target checkpoint as a frozen model, a sequence
stub as a drafter reads it, and a target runner that keeps features with its draft beside it."""

from __future__ import annotations

import contextlib

import torch

from ssdlib import SamplingParams
from ssdlib.engine.runner.model_runner import ModelRunner
from ssdlib.loading import load_checkpoint
from ssdlib.loading.feature_draft import load_feature_draft
from ssdlib.models.llama import LlamaForCausalLM
from ssdlib.speculative.rng import RowStream


def frozen_target(path, max_positions: int = 160):
    """(checkpoint, its LlamaForCausalLM in eval mode without gradients)."""
    ck = load_checkpoint(path)
    model = LlamaForCausalLM(ck.config, None, max_positions)
    model.load_weights(ck.weights)
    return ck, model.eval().requires_grad_(False)


class Seq:
    """What a drafter reads of a sequence (greedy unless ``params`` say otherwise)."""

    def __init__(self, slot, tokens, params=None):
        self.slot, self.tokens = slot, tokens
        self.params = params or SamplingParams()
        self.stream = RowStream.from_seed(slot)


def runner_and_draft(target_dir, feature_draft, slots, device="cpu", features=True):
    """The target's checkpoint and model, a target runner keeping ``features`` (True: the last
    layer's; or a FeatureSpec) for ``slots`` sequences, and the feature draft loaded beside it
    (fp32)."""
    ck, model = frozen_target(target_dir)
    runner = ModelRunner(ck, None, device, torch.float32, slots, 128, features=features)
    draft = load_feature_draft(feature_draft, ck, runner.model, device, torch.float32)
    return ck, model, runner, draft


def counting_backend(runs: list):
    """A torch.compile backend that runs the traced graph as it is and appends to ``runs`` at
    each call: where a feature draft's compiled layers run (on CPU, without inductor). A test
    using it resets dynamo after (``fresh_dynamo``)."""
    def backend(gm, example_inputs):
        def run(*args):
            runs.append(1)
            return gm.forward(*args)
        return run
    return backend


@contextlib.contextmanager
def fresh_dynamo():
    """torch._dynamo reset before and after: compiled code of a test's backend is not left on
    the decoder layer's code object for the next test."""
    import torch._dynamo

    torch._dynamo.reset()
    try:
        yield
    finally:
        torch._dynamo.reset()
