"""tools/convert_gguf.py on a tiny synthetic GGUF: every file it writes gets the mode an ordinary
file would (0666 less the umask), the weights are the GGUF's, and no temporary file is left."""

import os
import stat

import pytest
import torch

from ssdlib.loading import load_checkpoint
from tests.loading.tiny_llama_gguf import write_tiny_gguf
from tools.convert_gguf import main

WRITTEN = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
           "tokenizer_config.json"]


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077], ids=oct)
def test_written_files_honour_the_umask(tmp_path, umask):
    gguf = write_tiny_gguf(str(tmp_path / "tiny.gguf")).path
    out = tmp_path / "hf"
    old = os.umask(umask)
    try:
        assert main([gguf, str(out)]) == 0
    finally:
        os.umask(old)
    assert sorted(os.listdir(out)) == WRITTEN  # no temporary file left behind
    modes = {name: stat.S_IMODE(os.stat(out / name).st_mode) for name in WRITTEN}
    assert modes == {name: 0o666 & ~umask for name in WRITTEN}, \
        {name: oct(mode) for name, mode in modes.items()}
    src, hf = load_checkpoint(gguf).weights, load_checkpoint(str(out)).weights
    assert sorted(hf.names()) == sorted(src.names())
    for name in src.names():
        assert torch.equal(hf.get(name), src.get(name)), name
