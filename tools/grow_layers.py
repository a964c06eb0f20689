"""Write a deeper copy of a draft that computes the same function (a capacity probe for issue 12).

    python tools/grow_layers.py ssdlib/assets/smollm2-135m-draft 12 OUT_DIR

The source's L layers keep their order; N - L new layers are inserted evenly, each a copy of the
layer before it with its two output projections (``self_attn.o_proj``, ``mlp.down_proj``) set to
zero, so each new layer adds nothing to the residual stream until training moves them (block
expansion). The grown draft's logits equal the source's; ``distill_draft.py --init-from
OUT_DIR`` then trains it. Other files of the source directory (tokenizer_source.json, ...) are
copied; MODEL_CARD.md is not.
"""

from __future__ import annotations

import os
import re
import sys

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(TOOLS), TOOLS]  # the repository (ssdlib) and tools/

from ssdlib.loading import load_checkpoint  # noqa: E402
from truncate_layers import copy_side_files, write_layers  # noqa: E402

LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
ZEROED = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def layer_plan(old: int, new: int) -> list[tuple[int, bool]]:
    """Per new layer: (source layer, is a zeroed copy). Copies go after evenly spaced layers."""
    if new < old:
        raise ValueError(f"cannot grow {old} layers to {new}")
    extra = new - old
    plan = []
    for i in range(old):
        plan.append((i, False))
        # copies after layer i: those whose even share falls in (i, i + 1]
        for _ in range((i + 1) * extra // old - i * extra // old):
            plan.append((i, True))
    return plan


def main(argv=None) -> int:
    src, n, out = (argv or sys.argv[1:])[:3]
    n = int(n)
    ck = load_checkpoint(src)
    old = ck.config.num_hidden_layers
    plan = layer_plan(old, n)
    tensors, per_layer = {}, {}
    for name in ck.weights.names():
        m = LAYER.match(name)
        if m is None:
            tensors[name] = ck.weights.get(name).contiguous()
        else:
            per_layer.setdefault(int(m.group(1)), {})[m.group(2)] = ck.weights.get(name)
    for j, (i, copy) in enumerate(plan):
        for part, t in per_layer[i].items():
            t = t.clone()
            if copy and part in ZEROED:
                t.zero_()
            tensors[f"model.layers.{j}.{part}"] = t.contiguous()
    write_layers(ck, tensors, n, out)
    copy_side_files(src, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
