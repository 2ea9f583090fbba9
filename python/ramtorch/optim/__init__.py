"""Optimizers that update parameters in host RAM with Rust kernels (all cores, SIMD), overlapped
with the backward pass.

``ramtorch.optim.AdamW``, ``SGD`` and ``Lion`` are real :class:`torch.optim.Optimizer` s: param
groups, LR schedulers, ``state_dict``/``load_state_dict`` and ``zero_grad`` work as usual, and
parameters that are not in host RAM (units kept resident on the GPU, norms) are updated too, with
torch's own kernels on their device and the numerics of host parameters (an fp32 master and fp32
states on the device for bf16/fp16 weights; bf16 states and stochastic rounding with
``precision="bf16"``), so that a model trains the same with or without ``gpu_budget``.

**Torch's step, by default.** Nothing changes before ``step()``: no weight, gradient or state
moves during ``backward()``, and ``step()`` uses the gradients and hyperparameters as they are
when it is called, bitwise as ``overlap=False``. A skipped step (non-finite loss), a learning rate
set after ``backward()``, a backward with no step, a growing number of micro-batches, torch's
``clip_grad_norm_`` or a late ``GradScaler`` all train as under torch.

**Overlap, by speculation** (``_speculation``). In a model streamed by :func:`ramtorch.offload`, a
unit's update can be computed as soon as the last of its gradients for the step has reached host
RAM, on a CPU thread, while the GPU runs the backward of the units before it. The default computes
it out of place, into spare buffers, and ``step()`` commits it (states swapped, weight copied)
only if everything it read is unchanged and nothing clips or scales; otherwise ``step()`` computes
it. The spare buffers cost host memory (14 bytes a parameter with fp32 masters and AdamW) and the
out-of-place update more host memory traffic, so the default measures a few speculative steps and
a few steps updated in ``step()`` on the run itself, and keeps the cheaper
(``_speculation.AutoChoice``). Only the last backward before ``step()`` speculates: the optimizer
learns from the first step (whose updates run in ``step()``) how many backward passes a step has,
k, and the first k - 1 of each step only accumulate, as inside ``with opt.accumulate():`` (which
also works); a wrong guess costs time, never a different result.

``overlap="backward"`` commits each update during the last backward instead (no spare memory, the
fastest when host memory bounds the step), which changes the semantics: the weights change before
``step()``, hyperparameters changed between ``backward()`` and ``step()`` make ``step()`` raise,
and gradients changed between ``backward()`` and ``step()`` (``clip_grad_norm_``, a
``GradScaler`` unscaling them, more backwards than any step before outside ``accumulate()``) make
``step()`` raise. Use ``max_grad_norm=`` for clipping then (the updates then run in ``step()``), or
``opt.clip_grad_norm_(max_norm)`` in place of torch's (it returns the norm and folds the clip into
``step()``; transformers' ``Trainer``: ``ramtorch.integrations.transformers.RamtorchTrainer``). A
``torch.amp.GradScaler`` shows itself in ``step()`` and the optimizer then updates in ``step()``
from then on, with the unscaling and the inf check folded into the kernels. ``overlap=False`` runs
every update in ``step()``.

**Pipelined steps** (``pipeline=True``; commits during backward, as ``overlap="backward"``).
The optimizer work of a step (reading and writing
every state in host RAM) usually takes longer than the backward it overlaps, and the first unit's
gradient arrives last. With ``pipeline=True``, ``backward()`` and ``step()`` return without waiting
for the updates still queued: they run on while the next forward starts, in the order that forward
needs them (the newest gradients that have landed first), and the forward waits for each unit's
update before streaming its weights. What reads the weights through ramtorch waits the same way:
``model.state_dict()``, ``opt.state_dict()``, ``ramtorch.save_checkpoint``,
``ramtorch.synchronize()`` and ``opt.synchronize()``. Code of yours that reads host parameters
directly between ``step()`` and the next forward (an EMA of the weights, logging their norms) must
call ``opt.synchronize()`` first, or it may see a mix of old and new weights. Not with ZeRO
(``shard()``), where ``step()`` publishes the new weights to the other ranks.

**States of GPU-resident parameters in host RAM** (``states="host"``; ``_resident``). When the
weights fit on the GPU but their optimizer state does not (ZeRO-Offload's case), every parameter
that lives on a GPU (a model on the GPU that :func:`ramtorch.offload` does not stream, or the units
it keeps resident) keeps its states in host RAM in the format of a host parameter (``precision``
applies) and is updated by the Rust kernels: its gradient is copied to pinned host memory as
backward produces it, its update is speculated during the rest of backward and committed by
``step()`` under the rules above, and ``step()`` copies the new weight back (``upload_wait``:
the compute stream waits at the end of ``step()``, or each module's forward for its own
parameters). Nothing changes before ``step()`` in any mode.

:func:`ramtorch.trace` shows where a step's optimizer time goes: each update, on the worker
thread (during backward, pipelined) or in ``step()``, and each wait of a forward or another reader
for a pipelined update, on the timeline of the device's copies and compute.

**Precision.** Parameters in fp32 are updated in place with fp32 states. bf16/fp16 parameters get
an fp32 master copy in host RAM (``precision="fp32-master"``, the default; 16 bytes a parameter with
the bf16 weight and gradient) and the weight is rewritten from it, rounded to nearest. With
``precision="bf16"``, bf16 parameters keep bf16 states and are written with stochastic rounding
(8 bytes a parameter), trading some accuracy for capacity. ``precision="compact"`` keeps 8-bit
block-quantized moments and the bf16 weight with a bf16 compensation (6.03 bytes a parameter held,
8.03 with the gradient; 14.06 bytes moved per step), at about the fp32 master's quality.

Where each part lives:

- ``_rules.py``: the update rules :class:`AdamW`, :class:`SGD`, :class:`Lion` (hyperparameters,
  checked once for all in ``_check_hyperparameters``; each rule's kernel hyperparameters and torch
  fallback) and :class:`HostOptions`, the options every optimizer takes.
- ``_optimizer.py``: ``_HostOptimizer``, the :class:`torch.optim.Optimizer` the rules subclass:
  ``step()``, clipping, ``zero_grad``, ``state_dict``, ``shard``/``consolidate_state_dict``.
- ``_state.py``: host state and precision (moments, fp32 masters, bf16 states, 8-bit states and
  compensations), the update of one host parameter through the one kernel entry
  (``_core.optim_step``), and the loading of states, each checked against its parameter.
- ``_schedule.py``: the overlap and pipeline scheduler (:class:`UpdateMode`): updates started as
  gradients land (``on_grads``), speculative or committed, the end of backward
  (``before_finish``/``after_finish``), the commit of speculations (``_commit``), ``drain``; the
  registration of optimizers with the engines.
- ``_resident.py``: ``states="host"``: the host copies of a GPU-resident parameter's weight and
  gradient, the copies between them on side CUDA streams, the speculation and commit of its
  update, and what waits for its new weight.
- ``_speculation.py``: what a speculative update read and where it is computed (spare buffers
  made while the host can spare them), and the per-run choice between speculating and updating in
  ``step()``.
- ``_jobs.py``: the worker thread and its queue of update jobs.
- ``_zero.py``: ZeRO as a strategy object (``Zero``): ownership, gradient reduction, publication
  of new weights, consolidation of states.

The package builds on the engine (``ramtorch._engine``, ``_arena``, ``_core``) and imports nothing
above it.
"""

from __future__ import annotations

# The names of the module this package was stay importable from it (``X as X``: re-exported).
from ._jobs import _Jobs as _Jobs
from ._optimizer import _HostOptimizer as _HostOptimizer
from ._rules import _LIMITS as _LIMITS
from ._rules import SGD, AdamW, HostOptions, Lion
from ._rules import _check_hyperparameters as _check_hyperparameters
from ._rules import _real as _real
from ._schedule import _LISTENING as _LISTENING
from ._schedule import UpdateMode
from ._schedule import _describe as _describe
from ._schedule import listen as listen
from ._schedule import listen_on as listen_on
from ._state import _DTYPES as _DTYPES
from ._state import _PRECISIONS as _PRECISIONS
from ._state import HostStates as HostStates
from ._state import _is_host as _is_host
from ._zero import Zero as Zero
from ._zero import _first_diff as _first_diff

__all__ = ["SGD", "AdamW", "HostOptions", "Lion", "UpdateMode"]

for _public in (SGD, AdamW, HostOptions, Lion, UpdateMode):
    _public.__module__ = __name__  # documented, shown and pickled as ramtorch.optim.<name>
del _public
