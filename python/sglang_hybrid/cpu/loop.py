"""Drive SGLang's real ``Scheduler`` in process, on the CPU, with a CPU worker.

Contract:
- ``InProcessScheduler(model_path, worker=..., record_logits=False, worker_class=None,
  **server_args_overrides)`` installs the CPU worker (``install.install_cpu_worker``; a
  ``worker_class`` subclass of that kind replaces it, for test instruments), builds
  ``ServerArgs`` from ``install.cpu_server_args`` plus the overrides (radix cache backend,
  ``disable_radix_cache``, page size, chunk size, pool sizes, mamba strategy, ...) and
  ``server_args_attrs`` (underscore attributes a plugin's CLI hook would set), publishes the
  runtime context as a scheduler process would, builds the genuine ``Scheduler`` and runs the
  CPU part of its ``run_event_loop`` prologue. The detokenizer sender is replaced by an
  ``OutputSink``.
- ``submit`` hands a ``TokenizedGenerateReqInput`` to the Scheduler's own dispatcher
  (``process_input_requests``) and then sets ``extra_req_attrs`` on the created ``Req`` (e.g.
  ``hybrid_state_taps``). ``abort`` sends an ``AbortReq`` the same way.
- ``step`` is one iteration of ``Scheduler.event_loop_normal`` (or ``event_loop_overlap``, below)
  without the ZMQ receive:
  ``get_next_batch_to_run`` -> ``run_batch`` -> ``process_batch_result``, or ``on_idle`` when
  there is nothing to run (skippable with ``idle_check=False``). It returns the batch it ran,
  or None.
- ``run_until_idle`` steps until nothing is waiting, running or chunked, then (unless
  ``idle_check=False``) calls ``on_idle``: SGLang's idle path on the drained scheduler, whose
  pool-leak and tree invariant checks raise ``ValueError`` on a violation (SGLang's strict
  default).
- ``results`` maps each request id to a ``RequestResult`` (prompt tokens, cached tokens, output
  ids, finish reason). With ``record_logits`` the model worker keeps every request's logits by
  position (``first_token_logits`` reads the one that sampled the first output token).
- ``close`` (or leaving a ``with`` block) releases the Scheduler's sockets and SGLang's process
  groups and disarms its watchdogs; SGLang builds those groups once per process, so a second
  ``InProcessScheduler`` in the same process needs the first one closed. SGLang's hard watchdog
  signals the parent process, never right in process: its default timeout here is a year.
- With ``disable_overlap_schedule=False`` each ``step`` is one iteration of
  ``event_loop_overlap`` instead (the next batch is scheduled and run before the previous batch's
  results are processed; on the CPU a launch runs to completion). ``processed`` is the batch
  whose results the last step processed. Only with ``skip_tokenizer_init``.
- ``device="cuda"`` (a ServerArgs override) builds SGLang's pools on the GPU and runs every
  step inside the Scheduler's schedule stream, as ``run_event_loop`` does on CUDA; the model
  worker then computes on the GPU in ``dtype`` (the GPU check, ``benchmark/gpu/``).
- ``stream_model=StreamModel(...)`` (``cpu/stream_model``) runs the scheduler under the CPU
  stream model: it is entered before the Scheduler is built (so SGLang's pools are device memory
  and the cache sees ``cuda:0``), attached once it is (the scheduler's streams become the
  model's, the cache's per-pass entry points become budgets), steps run inside the schedule
  stream, and ``close`` leaves it.
"""

from __future__ import annotations

import collections
import contextlib
import os
from array import array
from typing import Any

import torch

from sglang_hybrid.cpu.install import WorkerKind, cpu_server_args, install_cpu_worker
from sglang_hybrid.cpu.outputs import OutputSink, RequestResult


def _destroy_parallel_runtime() -> None:
    from sglang.srt.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )

    destroy_model_parallel()
    destroy_distributed_environment()


_PORT_ATTEMPTS = 4

# SGLang's scheduler watchdog sends SIGQUIT to its *parent* process when a batch stays current
# for ``watchdog_timeout`` seconds: in a scheduler process that is the server's launcher, but in
# process it is the caller's parent (pytest's controller, make, a shell). A test that stops
# mid-batch or fails inside a pass leaves a batch current, and 300 s later the whole test run
# died of SIGQUIT. In process the caller owns the loop, so the default is a watchdog that never
# fires (an explicit ``watchdog_timeout`` override still wins), and ``close`` disarms it.
_IN_PROCESS_WATCHDOG_S = 365 * 86400.0


def _disarm_watchdogs(scheduler: object) -> None:
    """Stop a closed Scheduler's watchdogs from watching it, and let it (and its pools) be freed.

    SGLang's watchdog threads never stop and their callbacks close over the Scheduler: left
    alone they keep every Scheduler built in a process alive (a replay sweep grew by the pools'
    size per replay) and may fire on a batch left current. The callbacks are replaced by inert
    ones; the daemon threads keep sleeping.
    """
    for name in ("watchdog", "soft_watchdog"):
        dog = getattr(scheduler, name, None)
        if dog is not None and hasattr(dog, "is_active"):
            dog.is_active = lambda: False
            dog.get_counter = lambda: 0
            dog.dump_info = None


def _port_taken(exc: BaseException) -> bool:
    """True when building the Scheduler failed only because its drawn port was in use."""
    return isinstance(exc, RuntimeError) and "EADDRINUSE" in str(exc)


class InProcessScheduler:
    """SGLang's Scheduler with a CPU worker, stepped by the caller (see the module contract)."""

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        worker: WorkerKind = "tokens",
        record_logits: bool = False,
        worker_class: type | None = None,
        server_args_attrs: dict[str, Any] | None = None,
        stream_model: Any = None,
        **server_args_overrides: Any,
    ) -> None:
        self.stream_model = stream_model
        if stream_model is not None:
            stream_model.__enter__()
        try:
            self._build(
                model_path,
                worker,
                record_logits,
                worker_class,
                server_args_attrs,
                server_args_overrides,
            )
            if stream_model is not None:
                from sglang_hybrid.cpu.stream_model.scheduler import attach

                attach(stream_model, self.scheduler)
        except BaseException:
            if stream_model is not None:
                stream_model.__exit__(None, None, None)
            raise

    def _build(
        self,
        model_path: str | os.PathLike[str],
        worker: WorkerKind,
        record_logits: bool,
        worker_class: type | None,
        server_args_attrs: dict[str, Any] | None,
        server_args_overrides: dict[str, Any],
    ) -> None:
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.runtime_context import SpawnRanks, publish
        from sglang.srt.server_args import PortArgs, ServerArgs

        if record_logits and worker != "model":
            raise ValueError("record_logits needs worker='model' (the token worker has no logits)")
        kwargs = cpu_server_args(
            model_path=str(model_path),
            **{"watchdog_timeout": _IN_PROCESS_WATCHDOG_S, **server_args_overrides},
        )
        # The model worker's conv state follows its compute dtype (float32 on the CPU).
        dtype = str(kwargs["dtype"])
        install_cpu_worker(
            worker, conv_dtype=dtype if dtype in ("bfloat16", "float16") else "float32"
        )
        if worker_class is not None:  # a subclass of the chosen kind, e.g. a test instrument
            from sglang_hybrid.cpu.worker import CpuTpWorker

            CpuTpWorker.select(worker_class)
        if not kwargs["skip_tokenizer_init"]:
            raise ValueError("the in-process driver reads output ids: keep skip_tokenizer_init")
        self.server_args = ServerArgs(**kwargs)
        # Plugins keep their options as underscore attributes (what their CLI hooks would set).
        for name, value in (server_args_attrs or {}).items():
            setattr(self.server_args, name, value)
        # SGLang draws the process group's TCP port at random below the ephemeral range and
        # binds it only later, so another process (a parallel test worker, a server on a
        # shared machine) can take it in between: a taken port is drawn again, not fatal.
        for attempt in range(_PORT_ATTEMPTS):
            # Published per attempt: tearing down a failed attempt's groups unwrites the ranks.
            publish(
                self.server_args,
                role="scheduler",
                ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0),
            )
            self.port_args = PortArgs.init_new(self.server_args)
            try:
                self.scheduler = Scheduler(self.server_args, self.port_args)
                break
            except BaseException as exc:
                # A half-built Scheduler may already own the process groups; free them so the
                # caller (or the next attempt) can build another one.
                _destroy_parallel_runtime()
                if attempt + 1 < _PORT_ATTEMPTS and _port_taken(exc):
                    continue
                raise
        self._closed = False
        self.overlap = bool(self.scheduler.enable_overlap)
        # The batch whose results the last step processed: the batch it ran, or with overlap
        # scheduling the one before (None: no result was processed).
        self.processed: Any = None
        self._prepare_loop()
        self.sink = OutputSink()
        # Nobody listens on the ZMQ peers: every reply the scheduler sends lands in the sink.
        channels = self.scheduler.ipc_channels
        channels.send_to_detokenizer.send_output = self.sink.send_output  # type: ignore[method-assign]  # an instance attribute over the method
        channels.send_to_tokenizer.send_output = self.sink.send_output  # type: ignore[method-assign]  # as above
        if record_logits:
            self.worker.record_logits = True

    def _prepare_loop(self) -> None:
        """The CPU branch of ``Scheduler.run_event_loop`` before it dispatches the loop."""
        from sglang.srt.environ import envs
        from sglang.srt.utils.common import is_cuda

        s = self.scheduler
        if s.device == "cpu":
            s.schedule_stream.synchronize = lambda: None  # type: ignore[union-attr]  # None only under MLX (SGLang's CPU branch does this too)
        s._war_barrier_enabled = is_cuda() or envs.SGLANG_ENABLE_WAR_BARRIER.get()
        s.metrics_reporter.start_scheduler_time_accounting()
        if self.overlap:  # the prologue of event_loop_overlap
            s.enable_skip_finishing_decode = True
            s.result_queue = collections.deque()

    def stream(self) -> Any:
        """The Scheduler's schedule stream as a context (SGLang's event loop runs inside it on
        CUDA, and the forward runs on it with overlap off); nothing on the CPU."""
        s = self.scheduler
        if s.device == "cpu" and self.stream_model is None:
            return contextlib.nullcontext()
        return s.device_module.StreamContext(s.schedule_stream)

    def close(self) -> None:
        """Close the Scheduler's sockets and SGLang's process groups, so another can be built.

        SGLang initialises its parallel runtime once per process; a second in-process Scheduler
        needs the groups of the first one destroyed (``destroy_model_parallel``).
        """
        if self._closed:
            return
        self._closed = True
        channels = self.scheduler.ipc_channels
        for sock in (
            channels.recv_from_tokenizer,
            channels.recv_from_rpc,
            channels.send_to_tokenizer.socket,
            channels.send_to_detokenizer.socket,
            channels.send_metrics_from_scheduler,
        ):
            close = getattr(sock, "close", None)
            if close is not None:
                close(linger=0)
        _disarm_watchdogs(self.scheduler)
        _destroy_parallel_runtime()
        if self.stream_model is not None:
            self.stream_model.__exit__(None, None, None)

    def __enter__(self) -> InProcessScheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ accessors
    @property
    def tree_cache(self) -> Any:
        return self.scheduler.tree_cache

    @property
    def worker(self) -> Any:
        return self.scheduler.tp_worker

    # ------------------------------------------------------------------ requests
    def submit(
        self,
        rid: str,
        input_ids: list[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int | None = None,
        *,
        sampling_overrides: dict[str, Any] | None = None,
        **extra_req_attrs: Any,
    ) -> Any:
        """Queue a request through the Scheduler's dispatcher; return the created ``Req``."""
        from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
        from sglang.srt.sampling.sampling_params import SamplingParams

        params = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            sampling_seed=seed,
            **(sampling_overrides or {}),
        )
        params.normalize(None)
        params.verify(vocab_size=self.scheduler.model_config.vocab_size)
        request = TokenizedGenerateReqInput(
            rid=rid,
            input_text=None,
            input_ids=array("q", input_ids),
            input_embeds=None,
            mm_inputs=None,
            token_type_ids=None,
            sampling_params=params,
            return_logprob=False,
            logprob_start_len=-1,
            top_logprobs_num=0,
            token_ids_logprob=None,
            stream=False,
        )
        with self.stream():
            self.scheduler.process_input_requests([request])
        req = self._waiting_req(rid)
        for name, value in extra_req_attrs.items():
            setattr(req, name, value)
        return req

    def _waiting_req(self, rid: str) -> Any:
        for req in reversed(self.scheduler.waiting_queue):  # SGLang appends arrivals
            if req.rid == rid:
                return req
        reason = self.sink.results.get(rid)
        raise RuntimeError(f"request {rid!r} was not queued (reported: {reason})")

    def abort(self, rid: str) -> None:
        from sglang.srt.managers.io_struct import AbortReq

        with self.stream():
            self.scheduler.process_input_requests([AbortReq(rid=rid)])

    # ------------------------------------------------------------------ loop
    def step(self, *, idle_check: bool = True) -> Any:
        """One iteration of ``event_loop_normal`` (minus the receive); the batch run, or None.

        An iteration that runs nothing calls SGLang's ``on_idle`` as the loop does, unless
        ``idle_check`` is False (for callers holding pool slots SGLang does not know about).
        """
        with self.stream():
            return self._step(idle_check)

    def _step(self, idle_check: bool) -> Any:
        if self.overlap:
            return self._step_overlap(idle_check)
        from sglang.srt.environ import envs

        s = self.scheduler
        plan = s.get_next_batch_to_run(running_batch=s.running_batch, last_batch=s.last_batch)
        s.running_batch = plan.running_batch
        batch = plan.batch_to_run
        s.cur_batch_for_debug = batch
        self.processed = None
        if batch:
            with torch.no_grad():
                result = s.run_batch(batch)
            s.process_batch_result(batch, result)
            self.processed = batch
        else:
            s._sched_idled = True
            if idle_check:
                s.on_idle()
        s.last_batch = batch
        if envs.SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY.get():
            s.invariant_checker.self_check_during_busy()
        return batch

    def _step_overlap(self, idle_check: bool) -> Any:
        """One iteration of ``event_loop_overlap`` (minus the receive): batch N+1 is scheduled
        and launched before the results of batch N are processed. On the CPU the launch runs the
        forward to completion, so what this reproduces is SGLang's ordering of cache calls (a
        result's checkpoint and release come after the next batch was built and run), not the
        GPU's concurrency."""
        from sglang.srt.environ import envs

        s = self.scheduler

        self.processed = None

        def pop_and_process() -> None:
            done, result = s.result_queue.popleft()
            s.process_batch_result(done, result)
            self.processed = done

        plan = s.get_next_batch_to_run(running_batch=s.running_batch, last_batch=s.last_batch)
        s.running_batch = plan.running_batch
        batch = plan.batch_to_run
        s.cur_batch_for_debug = batch
        sync = s.is_disable_overlap_for_batch(batch, last_batch=s.last_batch)  # type: ignore[arg-type]  # SGLang's own loop passes None too
        if sync:
            pop_and_process()
        result = None
        if batch:
            with torch.no_grad():
                result = s.run_batch(batch)
            s._apply_war_barrier()
            s.result_queue.append((batch.copy(), result))
        else:
            s._sched_idled = True
        if s.last_batch:
            if not sync:
                pop_and_process()
        elif batch is None and idle_check:
            s.on_idle()
        if s.is_generation:
            with torch.no_grad():
                s.launch_batch_sample_if_needed(result, batch)  # type: ignore[arg-type]  # as above
        s.last_batch = batch
        if envs.SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY.get():
            s.invariant_checker.self_check_during_busy()
        return batch

    def has_work(self) -> bool:
        """Anything waiting, running, chunked, a prefill batch that has not yet joined the
        running batch (that happens at the next ``get_next_batch_to_run``), or host-tier copies
        the next iterations retire (the event loop keeps polling them)."""
        s = self.scheduler
        last = s.last_batch
        copies = getattr(s.tree_cache, "copies_in_flight", None)  # the hybrid host tier's
        return (
            bool(s.waiting_queue)
            or not s.running_batch.is_empty()
            or s.chunked_req is not None
            or (last is not None and not last.is_empty())
            or bool(getattr(s, "result_queue", None))  # overlap: a result not processed yet
            or (copies is not None and copies())
        )

    def run_until_idle(self, max_steps: int = 100_000, *, idle_check: bool = True) -> int:
        """Step until no request is waiting, running or chunked; return the batches run.

        With ``idle_check`` (default) SGLang's idle path then runs on the drained scheduler
        (``on_idle``), so a pool leak or a broken tree raises here.
        """
        ran = 0
        for _ in range(max_steps):
            batch = self.step(idle_check=idle_check)
            if batch:
                ran += 1
            elif not self.has_work():
                if idle_check:
                    self.on_idle()
                return ran
        raise RuntimeError(f"the scheduler did not drain within {max_steps} steps")

    def on_idle(self) -> None:
        """SGLang's idle path on a drained scheduler, including its invariant checks.

        The Scheduler checks only when fully idle, which includes "the previous iteration's
        batch is gone"; if the last step ran a batch, one empty iteration runs first, as in the
        event loop.
        """
        if self.has_work():
            raise RuntimeError("on_idle needs a drained scheduler: requests are still queued")
        if self.scheduler.last_batch is not None:
            self.step(idle_check=False)
        with self.stream():
            self.scheduler.on_idle()

    # ------------------------------------------------------------------ outputs
    def results(self) -> dict[str, RequestResult]:
        return self.sink.results

    def first_token_logits(self, rid: str) -> torch.Tensor:
        """Logits that sampled ``rid``'s first output token (needs ``record_logits``)."""
        result = self.sink.results[rid]
        return self.worker.logits_at(rid, result.prompt_tokens)
