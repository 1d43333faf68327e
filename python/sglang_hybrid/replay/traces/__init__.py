"""Trace loaders: each turns a file (or a benchmark's shape) into a ``Trace``.

- ``mooncake``: the Mooncake FAST'25 trace format (512-token hash blocks, ms timestamps).
- ``sessions``: our own JSONL format with token ids, sessions, turns, dependencies, scripted
  answers and tap hints (``load_sessions`` / ``write_sessions``).
- ``shared_prefix``: the shape of SGLang bench_serving's ``generated-shared-prefix`` dataset.
- ``lines``: one JSON line decoded into a ``msgspec.Struct`` (the loaders' field checks).

Malformed input raises ``sglang_hybrid.replay.errors.TraceFormatError`` (file, line, reason).
"""
