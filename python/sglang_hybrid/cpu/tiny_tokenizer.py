"""A small byte-level BPE tokenizer and a Qwen3-style chat template for the tiny test models.

Contract:
- ``build_tokenizer()`` trains a byte-level BPE with the ``tokenizers`` library on text embedded in
  this module (no file or network access), so every machine builds the same vocabulary. The
  vocabulary, specials included, is at most ``MAX_VOCAB`` (the tiny models' vocab size) entries.
- Every marker the chat template emits (``<|im_start|>``, ``<|im_end|>``, ``<think>``,
  ``</think>``, ``<tool_call>``, ``</tool_call>``, ``<tool_response>``, ``</tool_response>``) and
  ``<|endoftext|>`` is a single token. The chat markers and ``<|endoftext|>`` are special tokens;
  the thinking and tool tags are plain added tokens, as in Qwen3, so decoding keeps them.
- ``write_tokenizer_files(out_dir)`` writes ``tokenizer.json`` and ``tokenizer_config.json`` (with
  ``CHAT_TEMPLATE``) that ``transformers.AutoTokenizer`` and SGLang's tokenizer manager load.

The chat template renders system / user / assistant / tool messages in ChatML. A ``tools`` list
goes into the system block. Assistant ``tool_calls`` are rendered as
``<tool_call>{"name": ..., "arguments": ...}</tool_call>``. An assistant's ``reasoning_content``
(or a ``<think>...</think>`` prefix of its content) is rendered as a thinking block only in the
last turn, i.e. for assistant messages after the last user message (a turn may hold several
assistant messages between tool calls); earlier turns lose it. That is how Qwen3-family templates
re-render history, and why a state saved at the end of one turn never matches the next prompt.
Consecutive tool messages share one user block of ``<tool_response>`` entries.
``add_generation_prompt`` opens ``<|im_start|>assistant\\n``.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

MAX_VOCAB = 2048
# BPE merges trained beyond the byte alphabet; the embedded corpus supports about this many.
_TRAIN_VOCAB = 1400

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)
# Single tokens that decoding keeps (Qwen3 marks them non-special as well).
TAG_TOKENS: tuple[str, ...] = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)

CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- set has_system = messages and messages[0]['role'] == 'system' -%}"
    "{%- if tools -%}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if has_system -%}{{ messages[0]['content'] + '\\n\\n' }}{%- endif -%}"
    "{{ '# Tools\\n\\nYou may call functions. Their signatures are listed in <tools></tools>:'"
    " + '\\n<tools>' }}"
    "{%- for tool in tools -%}{{ '\\n' + (tool | tojson) }}{%- endfor -%}"
    "{{ '\\n</tools>\\n\\nAnswer a call with '"
    ' + \'<tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\\n\' }}'
    "{%- elif has_system -%}"
    "{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' and loop.first -%}"
    "{%- elif m['role'] == 'system' or m['role'] == 'user' -%}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{%- set content = m['content'] if m['content'] is string else '' -%}"
    "{%- set reasoning = '' -%}"
    "{%- if m['reasoning_content'] is defined and m['reasoning_content'] is string -%}"
    "{%- set reasoning = m['reasoning_content'] -%}"
    "{%- elif '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_user and reasoning.strip('\\n') -%}"
    "{{ '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}"
    "{%- endif -%}"
    "{{ content }}"
    "{%- if m['tool_calls'] is defined and m['tool_calls'] -%}"
    "{%- for call in m['tool_calls'] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{%- if content or not loop.first -%}{{ '\\n' }}{%- endif -%}"
    "{{ '<tool_call>{\"name\": ' + (fn['name'] | tojson) + ', \"arguments\": ' }}"
    "{%- if fn['arguments'] is string -%}{{ fn['arguments'] }}"
    "{%- else -%}{{ fn['arguments'] | tojson }}{%- endif -%}"
    "{{ '}</tool_call>' }}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- elif m['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}"
    "{{ '<|im_start|>user' }}"
    "{%- endif -%}"
    "{{ '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- else -%}"
    "{{ raise_exception('unknown role: ' + m['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

# Training text, written for this file: a few KB of prose, dialogue, JSON and code-like lines so
# that the merges cover what the chat template and the tests produce.
_CORPUS = """\
The cache keeps the state of every request that finished, so a later request that starts with
the same words can skip the work it would otherwise repeat. A hybrid model mixes two kinds of
layers: attention layers that remember every token they have seen, and recurrent layers that
fold the whole past into one fixed-size state. The attention memory can be cut at any token;
the recurrent state exists only at the positions where somebody saved it.
Hello, how are you today? I am a tiny test model with random weights. I do not know anything,
but I answer quickly and always the same way when the seed is the same.
The quick brown fox jumps over the lazy dog. A lazy dog sleeps in the warm afternoon sun while
the fox runs through the field, across the river and into the forest.
User: What is the weather in Paris? Assistant: Let me check the weather service for you.
User: Please summarise the last three messages. Assistant: Here is a short summary of them.
User: Can you call the search tool with the query "prefix cache"? Assistant: Calling it now.
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"name": "search", "arguments": {"query": "prefix cache", "limit": 5}}
{"name": "read_file", "arguments": {"path": "/tmp/notes.txt"}}
{"type": "function", "function": {"name": "get_weather", "description": "Current weather for a
city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
{"temperature": 21, "condition": "sunny", "humidity": 0.4, "wind": "light breeze"}
def schedule(requests, budget):
    for request in sorted(requests, key=lambda r: r.arrival):
        if request.tokens <= budget:
            budget -= request.tokens
            yield request
class Block:
    def __init__(self, tokens, parent=None):
        self.tokens = tuple(tokens)
        self.parent = parent
        self.children = {}
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 16 32 64 128 256 512 1024 2048 4096 8192.
Thinking step by step: first find the longest cached prefix, then restore the saved state, then
run only the new tokens. If no state was saved at the right place, run everything again.
The system prompt describes the tools. The user asks a question. The assistant thinks, calls a
tool, reads the tool response, and writes the final answer. Then the next turn begins, and the
template renders the whole history again, without the thinking of the earlier turns.
Agents repeat the same long preamble thousands of times; a good cache serves it from memory.
Errors happen: the file was not found, the network timed out, the result was empty. Retry once.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. January, February, March, April.
Red, green, blue, yellow, black, white. North, south, east, west. Yes, no, maybe, always, never.
The answer is 42. The total is 17.5 dollars. The meeting starts at 10:30 and ends at 11:15.
"""


def build_tokenizer() -> Tokenizer:
    """Train the byte-level BPE on the embedded corpus and add the single-token markers."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_TRAIN_VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The template's own words are part of the training text, so prompts tokenise compactly.
    tok.train_from_iterator([_CORPUS, CHAT_TEMPLATE], trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    if tok.get_vocab_size(with_added_tokens=True) > MAX_VOCAB:
        raise RuntimeError(f"tokenizer vocabulary exceeds {MAX_VOCAB}")
    return tok


def tokenizer_config() -> dict[str, object]:
    """The ``tokenizer_config.json`` contents (loaded by transformers' fast tokenizer class)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer_files(out_dir: Path) -> dict[str, int]:
    """Write ``tokenizer.json`` and ``tokenizer_config.json``; return the special token ids."""
    tok = build_tokenizer()
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    ids: dict[str, int] = {}
    for t in (*SPECIAL_TOKENS, *TAG_TOKENS):
        token_id = tok.token_to_id(t)
        if token_id is None:
            raise RuntimeError(f"marker {t!r} is not a single token")
        ids[t] = token_id
    return ids
