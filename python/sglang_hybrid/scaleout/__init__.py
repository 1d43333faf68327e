"""Past one server: SGLang's router in front of several CPU servers, and data parallelism.

- ``launch_router``: ``python -m sglang_hybrid.scaleout.launch_router`` starts SGLang's router
  (``sglang-router``, unmodified) with its own argument parser, plus the two policies its Rust
  core offers that the 0.3.2 command line does not list (``consistent_hashing``, ``prefix_hash``).
- ``router``: ``RouterConfig`` / ``RouterProcess``, the router as a managed subprocess.
- ``fleet``: ``Fleet``, N CPU servers behind one router, started and stopped together.
- ``bench``: reuse and TTFT of a workload through the router, per policy and worker count, against
  one server with the same total memory (``python -m sglang_hybrid.scaleout --help``).

``docs/scale-out.md`` has the commands, the measured table and the recommended deployment.
"""
