from ssdlib.loading.checkpoint import Checkpoint, WeightSource, load_checkpoint

__all__ = ["Checkpoint", "WeightSource", "load_checkpoint"]
