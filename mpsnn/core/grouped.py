"""Several kernels' reloads recorded as one command (what a training step records after its
updates): the read counts they consume, and the copy that does them.

A grouped reload must behave as the kernels' own reloads encoded one after the other: each pair
consumes one read of its state, so a temporary state listed more often than its read count
allows raises at encode (as the second of two separate reloads would); and the copies happen in
list order where that matters (a destination listed twice, or a source that is another pair's
destination), which one multi-tensor copy does not promise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from mpsnn.core.state import State
from mpsnn.errors import StaleResourceError

__all__ = ["check_grouped_reads", "pair_copier"]


def check_grouped_reads(uses: Sequence[tuple[str, State]]) -> None:
    """Raise `StaleResourceError` when a temporary state of ``uses`` (``(kernel name, state)``
    pairs) is read more often than its read count allows."""
    reads: dict[int, int] = {}
    for who, state in uses:
        if not state.is_temporary:
            continue
        n = reads.get(id(state), 0) + 1
        reads[id(state)] = n
        if n > state._read_count:
            raise StaleResourceError(
                f"[{who}] {state._describe()} must have a read_count of at least its {n} reads "
                f"in one grouped reload, got {state._read_count}"
            )


def pair_copier(dst: list[torch.Tensor], src: list[torch.Tensor]) -> Callable[[], None]:
    """A function doing ``dst[i].copy_(src[i])`` for every ``i`` as if in list order: one
    multi-tensor copy (one launch on CUDA), or pair by pair where a destination repeats or a
    source shares memory with a destination (decided now: the tensors are the encode's)."""
    if _ordered(dst, src):

        def in_order() -> None:
            for d, s in zip(dst, src, strict=True):
                d.copy_(s)

        return in_order
    return lambda: torch._foreach_copy_(dst, src)


def _ordered(dst: list[torch.Tensor], src: list[torch.Tensor]) -> bool:
    """Whether the copies' order can matter: the storages of the destinations repeat, or a
    source lies in one of them."""
    storages = {t.untyped_storage().data_ptr() for t in dst}
    if len(storages) < len(dst):
        return True
    return any(t.untyped_storage().data_ptr() in storages for t in src)
