"""Seeded, token-level workload generators rendered through the tiny models' chat template.

- ``template``: the token-level renderer of ``sglang_hybrid.cpu.tiny_tokenizer.CHAT_TEMPLATE``
  (role headers, tools block, tool calls, thinking kept only after the last user message,
  generation opener) that also reports message boundaries as tap hints.
- ``content``: seeded token text that never contains a template marker.
- ``conversation``: a message list rendered into prompts, hints and scripted answers.
- ``compaction``: keep a head, replace the middle with a summary (cache-coherence workload).
- ``agent``: agent sessions: tool loops, re-rendered history, retries, deep edits, subagents
  sharing the preamble, fan-outs over a new shared document.
- ``workload``: the agent workload mix used by the benchmark (``agent_workload``).
"""
