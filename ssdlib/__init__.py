"""ssdlib: exact speculative speculative decoding (SSD / Saguaro) for Llama models."""

from ssdlib import bytecode_cache

bytecode_cache.enable()  # before torch is imported (ssdlib.bytecode_cache)

from ssdlib.engine.leader.sequence import Output  # noqa: E402
from ssdlib.errors import SSDError  # noqa: E402
from ssdlib.generator import Generator  # noqa: E402
from ssdlib.sampling import SamplingParams  # noqa: E402

__all__ = ["Generator", "SamplingParams", "Output", "SSDError"]
__version__ = "0.1.0"
