"""What a step may not do inside a CUDA graph capture, checked on any device.

A captured step replays device work only. Inside a capture, CUDA refuses a copy from pageable
host memory and a read-back to the host (``.item()``, a sync); both fail only there, so a step
that breaks the rule passes every CPU test and stops the first GPU run that captures it.
:class:`CaptureRules` sees the same step run eagerly (``EagerPool``'s warm-up call, the CPU's
stand-in for a capture: ``SSDLIB_STEP_GRAPHS=eager``) and raises :class:`CaptureRuleError`
where the step would:

- read a value back to the host (``aten._local_scalar_dense``: ``.item()``, ``int(t)``, ``if t``);
- make a tensor of more than one element from host data (``torch.tensor([...])`` in the
  step: on a GPU, a host-to-device copy);
- hand a host scalar made in the step (``x[rows] = -1`` makes one; views of it and what is
  computed from host scalars alone are host data too) to an op that copies it to the device
  instead of reading it as a scalar argument: ``index_put_`` (advanced-index assignment),
  ``copy_``, ``cat``, ``stack``, a device move (``_to_copy``).

A host scalar that an op reads as a scalar (``x[:, 3:] = -1`` is ``fill_``; arithmetic with a
Python number; ``torch.where`` with one) is allowed: it travels as a kernel argument.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# ops that copy a host scalar tensor argument to the device (rather than read its value)
_COPYING = {"index_put_", "index_put", "_index_put_impl_", "copy_", "cat", "stack", "_to_copy"}
_LIFTED = {"lift_fresh", "lift_fresh_copy"}


class CaptureRuleError(RuntimeError):
    """A step does what a CUDA graph capture refuses (see the module doc)."""


class CaptureRules(TorchDispatchMode):
    """A dispatch mode over one run of step ``name``: raises :class:`CaptureRuleError` at the
    first op that a capture of it would refuse (module doc)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        # host scalars made in the step, by id (a dead one's id may return: the reference says)
        self._host: dict[int, weakref.ref] = {}

    def _refuse(self, what: str) -> None:
        raise CaptureRuleError(f"step {self.name!r} {what}: a CUDA graph capture refuses it "
                               f"(ssdlib/ops/capture_rules.py)")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = func.overloadpacket.__name__
        if op == "_local_scalar_dense":
            self._refuse("reads a value back to the host (.item(), int(t) or a tensor's truth)")
        if op in _COPYING:
            inputs, _ = tree_flatten((args, kwargs))
            if any(isinstance(t, torch.Tensor) and self._made_here(t) for t in inputs):
                self._refuse(f"copies a host scalar made in the step to the device ({op}; "
                             f"write it from a device tensor, e.g. torch.full_like)")
        out = func(*args, **kwargs)
        if op in _LIFTED:
            if out.numel() > 1:
                self._refuse(f"makes a tensor of {out.numel()} elements from host data "
                             f"(torch.tensor in the step)")
            self._mark(out)
        elif op not in _COPYING:  # what is computed from host scalars alone stays on the host
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            if tensors and all(self._made_here(t) for t in tensors):
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        self._mark(t)
        return out

    def _mark(self, t: torch.Tensor) -> None:
        self._host[id(t)] = weakref.ref(t)

    def _made_here(self, t: torch.Tensor) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t
