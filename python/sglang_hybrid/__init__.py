"""sglang-hybrid: a prefix cache for hybrid (recurrent + attention) LLMs, served by SGLang.

Layers, lowest first (imports point down only):

- ``index``   block tree, snapshots, eviction policy, tap planner, cost model (no torch, no sglang)
- ``store``   bytes: host slab pool, copies between SGLang's pools and slabs
- ``sglang``  the SGLang radix-cache backend ``hybrid`` and its plugin registration
- ``cpu``     CPU model workers that stand in for SGLang's TpModelWorker (tests, demo, replay)
- ``replay``  traces, offline replay through SGLang's scheduler, live client, reports
"""

__version__ = "0.1.0"
