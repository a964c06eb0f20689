"""Write an HF directory holding the first N layers of a checkpoint (a baseline "draft").

    python tools/truncate_layers.py smollm2-135m 4 OUT_DIR
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from safetensors.torch import save_file  # noqa: E402

from ssdlib.loading import load_checkpoint  # noqa: E402


def write_layers(ck, tensors: dict, n: int, out: str) -> None:
    """``out``: ``tensors`` as model.safetensors and ``ck``'s config with ``n`` layers (also
    tools/grow_layers.py's)."""
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    cfg = ck.config.to_hf_dict()
    cfg["num_hidden_layers"] = n
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def copy_side_files(src: str, out: str) -> None:
    """The other files of the source directory ``src`` (tokenizer_source.json, ...) into
    ``out``: not its weights, config.json or MODEL_CARD.md (tools/grow_layers.py's and
    tools/widen_draft.py's)."""
    if os.path.isdir(src):
        for fname in os.listdir(src):
            path = os.path.join(src, fname)
            if fname not in ("model.safetensors", "config.json", "MODEL_CARD.md") and \
                    os.path.isfile(path):
                shutil.copy(path, os.path.join(out, fname))


def main(argv=None) -> int:
    spec, n, out = (argv or sys.argv[1:])[:3]
    n = int(n)
    ck = load_checkpoint(spec)
    layer = re.compile(r"model\.layers\.(\d+)\.")
    tensors = {}
    for name in ck.weights.names():
        m = layer.match(name)
        if m is None or int(m.group(1)) < n:
            tensors[name] = ck.weights.get(name).contiguous()
    write_layers(ck, tensors, n, out)
    if ck.tokenizer is not None:
        ck.tokenizer.save_hf(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
