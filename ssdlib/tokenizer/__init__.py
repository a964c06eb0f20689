"""Tokenizers: one :class:`Tokenizer` type for HF directories and GGUF files.

``load_tokenizer_dir`` reads an HF checkpoint's tokenizer files, ``tokenizer_from_gguf`` rebuilds
the tokenizer a GGUF file describes; both give ids identical to transformers' ``AutoTokenizer``.
"""

from ssdlib.tokenizer.gguf_vocab import tokenizer_from_gguf
from ssdlib.tokenizer.hf_files import load_tokenizer_dir
from ssdlib.tokenizer.stream import StreamDecoder
from ssdlib.tokenizer.tokenizer import Tokenizer

__all__ = ["StreamDecoder", "Tokenizer", "load_tokenizer_dir", "tokenizer_from_gguf"]
