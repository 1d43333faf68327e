"""Trace replay: how much prefill would ``--radix-cache hybrid`` save on given traffic?

Replays traces (Mooncake, our session format, bench_serving's generated-shared-prefix shape) and
generated agent workloads through SGLang's real Scheduler on the CPU, with a worker that
computes nothing and a clock that prices each forward pass on a modelled device and model.
Caches compared under equal budgets: ``hybrid``, SGLang's ``no_buffer`` and ``extra_buffer``
placements, and an infinite-memory oracle. CLI: ``sglang-hybrid replay`` (``cli``).

Modules, one concept each: ``tokens`` (ids in the tiny vocabulary), ``trace`` (requests),
``errors``, ``traces/`` (loaders), ``generators/`` (workloads), ``budget`` (bytes to pools),
``caches`` (the compared configurations), ``clock`` (virtual time per pass), ``worker`` (scripted
answers, per-request counts), ``oracle_store`` / ``oracle_cache`` (the oracle), ``driver`` (the
replay loop), ``results``, ``report``, ``warmup`` (unrelated traffic that pre-fills the pools),
``steady`` (flushed against pre-filled runs), ``live`` (a running server), ``chat_session``
(the demo's agent chat session), ``progress``, ``cli``. Importing this package imports neither
torch nor sglang.
"""
