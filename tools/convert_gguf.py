"""Convert a Llama GGUF file to a Hugging Face checkpoint directory.

    python tools/convert_gguf.py MODEL.gguf|NAME OUT_DIR [--dtype float32|float16|bfloat16]

Writes config.json, model.safetensors (dequantized weights, q/k in HF layout), tokenizer.json,
tokenizer_config.json (with the chat template) and generation_config.json. Both
``transformers.AutoModelForCausalLM``/``AutoTokenizer`` and ``ssdlib.loading.load_checkpoint`` load
the result. Errors are printed as one line; the exit code is then 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# Run from a checkout without installing ssdlib: the package sits next to tools/.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from ssdlib.errors import SSDError  # noqa: E402
from ssdlib.loading.checkpoint import load_checkpoint  # noqa: E402
from ssdlib.loading.registry import resolve_named  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")


def convert(spec: str, out_dir: str, dtype: str = "float32", force: bool = False) -> None:
    """Convert GGUF file or named checkpoint ``spec`` into the HF directory ``out_dir``."""
    path = resolve_named(spec) or spec
    if not path.endswith(".gguf"):
        raise SSDError(f"{spec}: expected a .gguf file or the name of a GGUF checkpoint")
    if os.path.exists(os.path.join(out_dir, "config.json")) and not force:
        raise SSDError(f"{out_dir} already holds a checkpoint (config.json); use --force to "
                       "overwrite it")
    ckpt = load_checkpoint(path)
    tokenizer = ckpt.tokenizer
    os.makedirs(out_dir, exist_ok=True)
    tensors = {name: ckpt.weights.get(name).to(DTYPES[dtype]).contiguous()
               for name in ckpt.weights.names()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config = ckpt.config.to_hf_dict()
    config["torch_dtype"] = dtype
    _write_json(os.path.join(out_dir, "config.json"), config)
    generation = {}
    if ckpt.config.bos_token_id is not None:
        generation["bos_token_id"] = ckpt.config.bos_token_id
    eos = ckpt.config.eos_token_ids
    if eos:
        generation["eos_token_id"] = eos[0] if len(eos) == 1 else list(eos)
    _write_json(os.path.join(out_dir, "generation_config.json"), generation)
    if tokenizer is not None:
        tokenizer.save_hf(out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a .gguf file or a named checkpoint (e.g. smollm2-135m)")
    parser.add_argument("out_dir", help="output directory (created if missing)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="dtype of the written weights (default float32)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing checkpoint")
    args = parser.parse_args(argv)
    try:
        convert(args.model, args.out_dir, args.dtype, args.force)
    except SSDError as e:
        print(f"convert_gguf: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"convert_gguf: error: cannot write {args.out_dir}: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
