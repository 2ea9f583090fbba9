"""A large ``nn.Linear`` computed by blocks of rows as its copy lands.

A pass streams its units in order, each unit's copy hidden behind the compute of the one before.
The last unit's compute has nothing to hide behind: it starts once its last byte has landed. In a
decoder the last unit is the LM head, the largest of all (a 128k-entry vocabulary of width 4096
is 1 GiB, and its product with 4096 tokens some 6 ms of compute), so a pass ends that long after
the link has gone quiet.

A unit that is one ``nn.Linear`` whose weight is large is therefore copied in parts, a block of
rows each, with an event after each part (the engine's ``prefetch(parts=...)``); its forward
computes the output's columns block by block, each after the part that holds its rows
(``claim_part``), the first while the others are still crossing. What is left after the last byte
is one block's product. Each block's product is written into its columns of the output in place
(``torch.mm(..., out=...)`` with the output's row stride). The backward is ``F.linear``'s, made of
the same products, with the weight's gradient first and by the same blocks: each block leaves for
the host as soon as it is computed (the engine's ``push_grad_by_rows``), so the gradients' copies
down start a block's product after the LM head's backward begins rather than after all of it, and
the input's gradient is computed while they cross.

The module's class becomes :class:`RowsLinear` (an ``nn.Linear`` with this forward; its state,
``repr`` and ``isinstance`` are ``nn.Linear``'s) while it streams. A forward runs by blocks only
where nothing else can read the weight in between: one input of the weight's dtype on its device
(under autocast, of any floating dtype where the weight has autocast's dtype: the input is then
cast to it, as autocast casts a linear's inputs), no other hooks, not a recomputation; else the
unit's copy is waited for whole, as for any unit. Traced by ``torch.compile``, the forward waits
for the whole copy before the graph's product (:func:`settle`, a graph break). The kernel that
computes a block's product may round differently from the one that computes the whole product
(as cuBLAS's choices may from run to run): under ``torch.use_deterministic_algorithms(True)``,
where the offloaded model's outputs are bitwise the resident model's, the forward is never cut.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import _codec
from .compiling import is_compiling, opaque

if TYPE_CHECKING:
    from .units import _Unit

#: A weight of at least this many bytes is copied and computed by blocks of rows.
MIN_BYTES = 64 << 20
#: At most this many blocks, each of at least ``MIN_PART_BYTES``.
MAX_PARTS = 8
MIN_PART_BYTES = 16 << 20
#: Blocks start at multiples of this many rows (aligned columns of the output).
ROW_ALIGN = 64


class Blocks:
    """How a unit's weight is cut: per block ``(first row, end row, bytes of the unit's copy it
    needs)``, and the byte offsets where the copy's parts end (all but the last)."""

    __slots__ = ("blocks", "parts")

    def __init__(self, blocks: list[tuple[int, int, int]], parts: list[int]) -> None:
        self.blocks = blocks
        self.parts = parts


def blocks_of(u: _Unit) -> Blocks | None:
    """``u``'s blocks (kept while its layout is), or ``None`` where it does not go by rows."""
    if type(u.module) is not RowsLinear:
        return None
    return u.per_layout("rows", _cut)


def _cut(u: _Unit) -> Blocks | None:
    layout = u.layout
    assert layout is not None
    if u.tree is not None or not decodes_by_parts(u) or u.gather:
        return None
    m = u.module
    spans: dict[str, tuple[int, int]] = {}
    for e in u.entries:
        if e.owner is not m or e.name not in ("weight", "bias"):
            return None  # another module's parameter in the unit: it goes whole
        entry = layout.entries[e.index]
        if entry is None:
            return None
        off, shape, dtype = entry
        spans[e.name] = (off, off + _numel(shape) * dtype.itemsize)
        if e.name == "weight" and len(shape) != 2:
            return None
    if "weight" not in spans or len(u.params) != len(spans):
        return None
    # A bias lying after the weight is needed by every block: then every block waits for it.
    bias_end = spans["bias"][1] if "bias" in spans else 0
    blocks = row_blocks(spans["weight"], m.weight.shape[0], bias_end)
    if blocks is None:
        return None
    ends = sorted({b[2] for b in blocks if b[2] < layout.nbytes})
    if not ends:
        return None
    return Blocks(blocks, ends)


def row_blocks(weight: tuple[int, int], rows: int, bias_end: int = 0) -> list[tuple[int, int, int]] | None:
    """Blocks of rows of a weight lying at bytes ``weight`` (start, end) of a unit's layout: per
    block ``(first row, end row, bytes of the unit's copy it needs)``; ``None`` where the weight
    is too small to cut."""
    w0, w1 = weight
    size = w1 - w0
    if size < MIN_BYTES or rows < 2 * ROW_ALIGN:
        return None
    k = min(MAX_PARTS, size // MIN_PART_BYTES)
    if k < 2:
        return None
    step = -(-rows // k)
    step = -(-step // ROW_ALIGN) * ROW_ALIGN
    row_bytes = size // rows
    blocks = []
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        blocks.append((r0, r1, max(w0 + r1 * row_bytes, bias_end)))
    return blocks if len(blocks) >= 2 else None


def decodes_by_parts(u: _Unit) -> bool:
    """Whether ``u``'s bytes can be had part by part: it streams raw, or in a codec that decodes
    by parts (``offload(compress="fp8")`` and ``"lossless"``: :func:`ramtorch._codec.by_parts`)."""
    return u.codec is None or _codec.by_parts(u.codec)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def copy_parts(u: _Unit) -> list[int]:
    """Byte offsets where ``u``'s copy is cut into parts (none for a unit that goes whole)."""
    b = blocks_of(u)
    return [] if b is None else b.parts


def by_rows(u: _Unit, module: nn.Module, args: tuple, kwargs: dict, device: torch.device) -> Blocks | None:
    """The blocks ``u``'s forward on ``args`` computes by, or ``None`` (the copy is then waited
    for whole before the forward)."""
    b = blocks_of(u) if takes(module, args, kwargs, device) else None
    return b


def takes(module: nn.Module, args: tuple, kwargs: dict, device: torch.device) -> bool:
    """Whether ``module``'s forward on ``args`` can be computed by blocks of rows: a
    :class:`RowsLinear` given one input on ``device`` of its weight's dtype (under autocast, of
    any floating dtype where the weight has autocast's: :func:`compute_dtype`), no hooks but the
    unit's two, not under deterministic algorithms."""
    if type(module) is not RowsLinear or "forward" in module.__dict__ or kwargs or len(args) != 1:
        return False
    if torch.are_deterministic_algorithms_enabled():
        return False  # a block's product may round unlike the whole product's kernel
    x = args[0]
    weight = module.weight
    if (
        type(x) is not torch.Tensor
        or x.device != device
        or x.dim() < 2
        or x.shape[-1] != weight.shape[1]
        or compute_dtype(module, x) is None
    ):
        return False
    # Nothing may read the weight between the pre-hook and the forward, nor after the forward
    # before the post-hook: the unit's own two hooks, no others.
    if len(module._forward_pre_hooks) != 1 or len(module._forward_hooks) != 1:
        return False
    hooks = nn.modules.module
    return not (hooks._global_forward_pre_hooks or hooks._global_forward_hooks)


def compute_dtype(module: nn.Module, x: torch.Tensor) -> torch.dtype | None:
    """The dtype ``module``'s product on input ``x`` computes in, where it can go by rows: the
    weight's, for an input of that dtype; under autocast, the autocast dtype where the weight
    (and bias) have it already, a floating-point input then cast to it as autocast casts a
    linear's inputs. ``None`` otherwise (another op would run: a cast weight, a promoted input),
    and the product goes whole."""
    weight, bias = module.weight, module.bias
    if not torch.is_autocast_enabled(x.device.type):
        return weight.dtype if x.dtype == weight.dtype else None
    dt = torch.get_autocast_dtype(x.device.type)
    if weight.dtype != dt or (bias is not None and bias.dtype != dt) or not x.is_floating_point():
        return None
    return dt


class RowsLinear(nn.Linear):
    """An ``nn.Linear`` whose forward, while its unit streams by rows, computes block by block as
    the blocks land (see the module's docstring)."""

    #: Set by the unit's pre-hook for the forward that follows it: (wait for the first bytes of
    #: the copy, wait for all of it, the blocks); taken by that forward.
    _ramtorch_armed: tuple[Callable[[int], None], Callable[[], None], Blocks] | None = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if is_compiling():
            # Traced, the product is the graph's: the graph waits for the whole copy first (a
            # graph break; the hooks around a streamed unit break the graph anyway).
            opaque(settle, self)
            return F.linear(input, self.weight, self.bias)
        armed = self.__dict__.get("_ramtorch_armed")
        if armed is None:
            return F.linear(input, self.weight, self.bias)
        self.__dict__["_ramtorch_armed"] = None
        dt = compute_dtype(self, input)
        if dt is None:  # (the pre-hook saw the input, so this does not happen)
            settle_armed(armed)
            return F.linear(input, self.weight, self.bias)
        if input.dtype != dt:
            input = input.to(dt)  # what autocast does to a linear's input (the weight has dt)
        with torch.autocast(input.device.type, enabled=False):  # the products take dt as given
            return _ByRows.apply(input, self.weight, self.bias, armed)


RowsLinear.__name__ = RowsLinear.__qualname__ = "Linear"  # prints as the nn.Linear it stands for
Linear = RowsLinear  # the name pickle looks it up by


def adopt(module: nn.Module) -> bool:
    """Makes ``module`` (an ``nn.Linear``, not a subclass) a :class:`RowsLinear`; whether it did."""
    if type(module) is not nn.Linear or "forward" in module.__dict__:
        return False
    module.__class__ = RowsLinear
    return True


def release(module: nn.Module) -> None:
    """Undoes :func:`adopt`."""
    if type(module) is RowsLinear:
        module.__dict__.pop("_ramtorch_armed", None)
        module.__class__ = nn.Linear


def arm(module: nn.Module, armed: tuple[Callable[[int], None], Callable[[], None], Blocks]) -> None:
    module.__dict__["_ramtorch_armed"] = armed


def settle_armed(armed: tuple[Callable[[int], None], Callable[[], None], Blocks]) -> None:
    """Waits (on the current stream) for the whole copy that ``armed`` stands for."""
    armed[1]()


def settle(module: nn.Module) -> None:
    """Waits (on the current stream) for the whole copy of ``module``'s unit, if its pre-hook
    left the wait to a forward that did not take it."""
    left = disarm(module)
    if left is not None:
        left[1]()


def disarm(module: nn.Module) -> tuple[Callable[[int], None], Callable[[], None], Blocks] | None:
    """What :func:`arm` left that no forward took (then the caller waits for the whole copy)."""
    return module.__dict__.pop("_ramtorch_armed", None)


class _ByRows(torch.autograd.Function):
    """``F.linear(x, w, b)`` computed by blocks of ``w``'s rows, each after its part of the copy.
    The backward is ``F.linear``'s (the products torch's ``mm``/``addmm`` backward makes)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor | None,
        armed: tuple[Callable[[int], None], Callable[[], None], Blocks],
    ) -> torch.Tensor:
        wait_part, wait_all, blocks = armed
        x2 = x.reshape(-1, x.shape[-1])
        out = torch.empty((x2.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
        try:
            for r0, r1, upto in blocks.blocks:
                wait_part(upto)
                if b is None:
                    torch.mm(x2, w[r0:r1].t(), out=out[:, r0:r1])
                else:
                    torch.addmm(b[r0:r1], x2, w[r0:r1].t(), out=out[:, r0:r1])
        finally:
            wait_all()  # what follows on this stream may read any of the unit's bytes
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        ctx.rows = [(r0, r1) for r0, r1, _ in blocks.blocks]
        # Set by the unit's graph walk when the weight's gradient leaves early (see
        # ``functions._EarlyGrad.by_rows``): this node then sends it itself, block by block.
        ctx.send_weight_grad = None
        return out.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        x, w = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        gx = gw = gb = None
        # The weight's gradient first, by the forward's blocks of rows, each block sent to the host
        # as soon as it is computed: at the turn from forward to backward (the LM head's backward
        # comes first) nothing else is there for the link to carry, and the input's gradient is
        # computed while the first blocks cross.
        if ctx.needs_input_grad[1]:
            # (With ``create_graph`` the products are recorded, which ``out=`` forbids: whole.
            # A unit whose weights a create_graph backward reached sends none early.)
            send = None if torch.is_grad_enabled() else ctx.send_weight_grad
            if send is not None and not send.u.early_grads:
                send = None
            if send is None:
                gw = g2.t().mm(x2)
            else:

                def fill(r0: int, r1: int, out: torch.Tensor) -> None:
                    torch.mm(g2[:, r0:r1].t(), x2, out=out)

                gw = send.by_rows(g2.dtype, ctx.rows, fill)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        if ctx.needs_input_grad[0]:
            gx = g2.mm(w).view(x.shape)
        return gx, gw, gb, None


#: The node of a forward computed by rows, and the position of the weight among its inputs.
ByRowsBackward = _ByRows._backward_cls
WEIGHT_INPUT = 1
