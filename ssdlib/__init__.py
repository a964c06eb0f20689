"""ssdlib: exact speculative speculative decoding (SSD / Saguaro) for Llama models."""

from ssdlib.engine.leader.sequence import Output
from ssdlib.errors import SSDError
from ssdlib.generator import Generator
from ssdlib.sampling import SamplingParams

__all__ = ["Generator", "SamplingParams", "Output", "SSDError"]
__version__ = "0.1.0"
