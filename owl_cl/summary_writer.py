"""The run's TensorBoard writer (tensorboardX), imported without torch.

tensorboardX's writer module imports torch whenever torch is installed (the 'hf' and 'test'
extras install it), only so that it can accept torch tensors: 1.2 to 1.5 s of every
`owl_cl.main` process on 2 CPU cores, a tenth of a cached tiny run (docs/tests.md). owl_cl
logs Python floats, so this module imports tensorboardX while `torch` reads as absent, then
makes torch importable again: tensorboardX then treats NumPy arrays as its tensor type, which
is what it does on a machine without torch.
"""

from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def _torch_hidden():
  """While inside, `import torch` raises ImportError, unless torch is already imported."""
  if "torch" in sys.modules:
    # Already paid for (a process that uses torch): nothing to hide.
    yield
    return
  sys.modules["torch"] = None  # The import system's marker of a module that cannot be found.
  try:
    yield
  finally:
    # Only the marker is removed: a later `import torch` loads it as usual.
    if sys.modules.get("torch", 0) is None:
      del sys.modules["torch"]


with _torch_hidden():
  from tensorboardX import SummaryWriter  # noqa: E402 (inside the context, on purpose)

__all__ = ["SummaryWriter"]
