"""``make demo``: SGLang's server on the CPU replaying an agent session under three caches.

``session`` (the embedded session), ``report`` (tables, totals, JSON, plot), ``__main__`` (the
command). See ``python -m sglang_hybrid.demo --help``.
"""
