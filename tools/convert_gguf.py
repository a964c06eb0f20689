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
import tempfile
from typing import Callable

# Run from a checkout without installing ssdlib: the package sits next to tools/.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from ssdlib.errors import SSDError  # noqa: E402
from ssdlib.loading.checkpoint import load_checkpoint  # noqa: E402
from ssdlib.loading.registry import resolve_named  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _write_atomic(path: str, write: Callable[[str], None]) -> None:
    """``write(tmp)`` into a temporary file beside ``path``, then rename it to ``path``: an
    interrupted conversion never leaves a truncated file. The temporary file is created 0600
    (and safetensors writes 0600 of its own), so the result gets the mode an ordinary file
    would: 0666 less the umask."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".tmp-")
    os.close(fd)
    try:
        write(tmp)
        mask = os.umask(0)  # os has no getter for it (a one-threaded tool: set and restore)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _write_json(path: str, data: dict) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, ensure_ascii=False)
            f.write("\n")

    _write_atomic(path, write)


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
    _write_atomic(os.path.join(out_dir, "model.safetensors"),
                  lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a .gguf file or a named checkpoint (e.g. smollm2-135m)")
    parser.add_argument("out_dir", help="output directory (created if missing)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="dtype of the written weights (default float32)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing checkpoint")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
