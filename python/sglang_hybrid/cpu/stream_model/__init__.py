"""A CUDA stream model for the CPU: the stream sanitizer (issue #35).

SGLang's overlap scheduler runs two CUDA streams (it schedules on one, runs the forward on the
other) and the cache shares them. A CPU run computes everything at once, so it can neither show
a missing order nor a host sync. Under ``StreamModel`` the same code runs on CPU tensors with
``torch.cuda``'s stream API emulated (``clock.py``), every device storage tracked (``storage.py``,
fed by two torch modes, ``modes.py``), and it fails (``StreamViolation``) when:

- ``race``: memory is read (or written) on one stream, or by the host, while its last write on
  another stream (or a pending read, for a write) is not ordered before it by a
  ``wait_stream`` / ``wait_event`` / host synchronize;
- ``free``: a device tensor is freed while a stream other than the one that allocated it may
  still use it and ``record_stream`` did not name that stream (the caching allocator reuses the
  memory on the allocating stream at once);
- ``host_sync``: inside a budgeted region (``StreamModel.budget``) the host waits for the device:
  ``item()`` / ``int()`` / ``bool()`` / ``float()`` of a device tensor, ``tolist()``, ``.cpu()``
  or a blocking copy, ``nonzero`` and other ops whose result size is on the device, a factory from
  Python data with a device, a copy from pageable host memory, a device op given a host tensor,
  an explicit synchronize;
- ``numpy``: ``numpy()`` of a device tensor.

How "device tensors" exist on a CPU: residency is a property of each storage, decided when the
storage is born (``modes.py``): ``device="cuda"`` anywhere, SGLang's memory pools and allocators
(which on a GPU allocate device memory), and everything the CPU worker's forward allocates (a
*device region*: it stands in for kernels) are device memory; ops with a device operand produce
device memory; the rest is host memory, pinned when asked. The backend sees device memory as
``cuda:0`` (``Tensor.device``, ``is_cuda``, the pools' device), so it takes its CUDA branches.

What it cannot check: real timing and throughput (nothing runs late, only completion is
deferred: every order is checked, none is measured); CUDA graph capture rules (no graph is
captured); the caching allocator's block splitting and cross-stream pools beyond "freed memory
is reused on its stream"; kernels' own behaviour (Triton kernels run under the interpreter
elsewhere: ``cpu/triton_interpret.py``); work on other threads (torch modes are per thread); and
element ranges: a storage is tracked whole, so two streams touching disjoint parts of one tensor
are reported like a true race (SGLang's ``req_to_token`` table is ordered by its own coarse WAR
barrier, so this does not arise there).

``scheduler.attach(model, scheduler)`` wires a built SGLang ``Scheduler`` to the model: its
schedule, forward and copy streams become the model's, the WAR barrier is enabled as on CUDA,
the worker's forward is a device region, and the cache's per-pass entry points are budgets.
"""

from .clock import HOST, EmuEvent, EmuStream
from .model import StreamModel
from .storage import StreamViolation

__all__ = ["HOST", "EmuEvent", "EmuStream", "StreamModel", "StreamViolation"]
