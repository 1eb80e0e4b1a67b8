"""Whether a ``torch.func`` transform or a forward-mode AD level is active (a leaf module:
torch only).

The portable passes update their own temporaries in place (on the CPU a fresh tensor of a
layer's size costs about as much as a pass over it). Under ``torch.func.vmap`` an operand may
be batched while the temporary it updates is not, and PyTorch refuses that in-place update;
some out= forms have neither a batching rule nor a forward-mode derivative. Under a transform
or forward-mode AD the passes therefore make a new tensor for each operation instead: the same
operations in the same order, so the same values, at the transform's own cost. The Triton
fast paths do not run there at all (`mpsnn.ops.triton`): they would be handed batched or dual
tensors they cannot read.
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as _forward_ad

__all__ = ["under_transform"]

# PyTorch's own torch.func machinery reads its interpreter stack through this function; a
# PyTorch without it (none known) is taken as never transforming
_peek = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)


def under_transform() -> bool:
    """True inside ``torch.func.vmap``, ``grad``, ``jvp``, ``jacrev``, ``jacfwd`` and the
    like (a functorch interpreter on the stack), and inside a
    ``torch.autograd.forward_ad.dual_level()``."""
    if _forward_ad._current_level >= 0:
        return True
    return _peek is not None and _peek() is not None
