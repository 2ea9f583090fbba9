"""The streaming layer: model weights in host RAM, streamed to the compute device unit by unit.

A *unit* is a module whose parameters cross the link together: by default each block of the
model's largest ``nn.ModuleList`` (or ``nn.Sequential`` of blocks of one class) plus, outside those
blocks, every module that holds parameters of its own. Each streamed unit's parameters are packed
into one host-arena region; they stay CPU ``nn.Parameter``s (optimizers, ``state_dict`` and
``torch.save`` see them as usual).

How a unit runs:

- **forward pre-hook**: the unit's region is in a device slot (prefetched along the learned
  itinerary, or copied now); the compute stream waits for that copy; device views of the slot
  replace the unit's parameters for the duration of its forward. With grad enabled the views come
  out of :class:`_Fetch` (whose backward sends the weight gradients to the host) and tensors saved
  for backward that point into the slot are packed as references, not kept: backward fetches the
  unit again. Inputs pass through :class:`_PostBackward`, whose backward marks the unit's backward
  as done.
- **forward post-hook** (always called, even if the forward raised): weights the forward wrote in
  place (the slot's version counter moved: an EMA codebook, ``nn.Embedding(max_norm=...)``; or,
  through ``.data``, the slot's bytes changed in the unit's first forward of a mode, which is
  compared) are copied back to the host region; outputs that live in the slot (a weight returned
  as is, or a view of it) are replaced by copies, through autograd; parameters restored, slot
  released after the queued kernels, and a hook on the outputs' gradients prefetches the unit for
  backward. The unit's autograd graph is walked from its outputs to find, for each weight, the one
  node that consumes it (``TBackward`` of a linear layer, say); a hook on that node sends the
  weight's gradient to the host as soon as it is computed, while the rest of the unit's backward
  runs on, and hands it to the optimizers once every forward of the step has delivered it.
  Weights used by several nodes wait for :class:`_Fetch`'s backward, at the end of the unit's.

The *itinerary* is the order in which units ran in the last forward (and the last backward); the
next pass prefetches along it, ``MAX_INFLIGHT`` copies ahead at most, and slots are evicted
farthest-next-use first (a released slot keeps its unit, so the units that end a forward pass start
the backward pass without a copy). A pass that strays from the itinerary is still correct: every
use checks the unit's key (its identity and its parameters' version counters) and copies when the
slot holds anything else; the itinerary is then relearned. By default a copy never serves a later
forward pass: user code between passes may edit weights in ways no version counter sees
(``param.data``), so a pass's start renews every unit's key (:meth:`_Unit.forget_copies`) and
copies its first units. Inside a decoding span (one ``generate()`` call, :mod:`.decoding`), after
its first pass, and inside ``ramtorch.weights_unchanged``, keys are not renewed: a pass takes the
copies prefetched at the end of the one before, each checked against its unit's key.

Files, one concept each:

- :mod:`.units`: unit discovery (:func:`collect_units`) and :class:`_Unit` (a unit's parameters
  packed into one host-arena region, its key, its per-step gradient counts);
- :mod:`.itinerary`: slots, the itinerary and prefetch along it (:class:`Prefetcher`);
- :mod:`.functions`: the autograd functions (:class:`_Fetch`, :class:`_PostBackward`), the
  saved-tensor hooks and the graph walk that sends weight gradients early (:class:`GradientHooks`);
- :mod:`.streamer`: :class:`Streamer`, the per-unit state machine driven by module hooks;
- :mod:`.shared`: free-standing units (``ramtorch.nn.Linear``, ``Embedding``, ``Conv2d``) on one
  shared streamer per device, streamed through their forward hooks, whose itinerary records them
  in the order they run;
- :mod:`.placement`: the planner (which units stay resident, how many slots);
- :mod:`.compiling`: under ``torch.compile`` the hooks run as in eager mode, between compiled
  regions (a graph break at each streamed unit).
- :mod:`.decoding`: decoding spans (a ``generate()`` call), whose passes take each other's copies;
- :mod:`.added`: parameters added to an offloaded model after ``offload`` (in no unit), found
  through torch's registration hooks and refused by name at the next forward.
- :mod:`.pipeline`: one model over several devices (``offload(devices=...)``): the stage cut, the
  hand-off of activations between stages, and the relay of micro-batches, one streamer a stage.

This layer imports only the engine layer (``_engine``, ``_arena``, ``_core``, ``_config``,
``_units``); features (``ramtorch.offload``, ``ramtorch.nn``, ``ramtorch.plan``, ``ramtorch.trace``)
build on it.
"""
