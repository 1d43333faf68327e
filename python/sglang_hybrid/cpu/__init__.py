"""CPU stand-ins for SGLang's ``TpModelWorker``, so SGLang's real Scheduler runs on a CPU.

Importing this package installs nothing and imports neither torch nor sglang. Modules:

- ``tiny_model`` / ``tiny_tokenizer``: write a tiny random-weight hybrid model directory
  (Qwen3.5 or Qwen3-Next, float32) with a local BPE tokenizer and a Qwen3-style chat template.
- ``install``: ``install_cpu_worker(kind)`` (HookRegistry REPLACE of ``TpModelWorker``) and
  ``cpu_server_args(**overrides)``.
- ``runner``: the model-runner object (pools built by SGLang's ``KVCacheConfigurator``).
- ``worker``: the base worker (every TpModelWorker method works or is refused by name).
- ``token_worker``: no model; deterministic tokens and per-batch work counts.
- ``model_worker``: runs the tiny model with transformers, SGLang's pools as its state
  (``state_io``, ``split_invariant``, ``sampling``, ``hf_model``), with exact state taps
  (``taps``).
- ``triton_interpret``: SGLang's own Triton kernels on CPU tensors under ``TRITON_INTERPRET=1``
  (``enable_interpreter()`` in a fresh process, then ``with interpreted():``; four shims, each with
  its reason).
- ``loop``: ``InProcessScheduler``, an in-process driver of SGLang's real Scheduler
  (``outputs`` collects what it reports).

See ``docs/cpu-worker.md``.
"""
