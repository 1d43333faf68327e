"""``make demo``: SGLang's server on the CPU replaying an agent session under three caches.

``report`` (tables, totals, JSON, plot), ``__main__`` (the command); the embedded session is
``replay.chat_session`` (``replay live --trace demo-session`` sends it too). See
``python -m sglang_hybrid.demo --help``.
"""
