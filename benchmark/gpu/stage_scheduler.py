"""Stage B: SGLang's real Scheduler with ``--radix-cache hybrid``, the tiny model on the GPU.

The CUDA build of the model worker (``sglang_hybrid.cpu.model_worker``: the tiny Qwen3-Next
model in bf16 on the GPU, GDN layers through SGLang's own Triton ``chunk_gated_delta_rule``,
SGLang's pools on the GPU: KV and conv state bf16, recurrent state fp32) serves the exactness
programs of ``test/exactness/programs.py`` (resume, multi-turn endpoint with a copied tail,
re-rendered history, deep edit, shared preamble, identical prompts together, a new prefix
arriving together (coalescing), host-only restore, cancel mid-prefill, a disabled request),
the pressure program of ``test/exactness/conftest.py`` and a retraction program, under the
cache configurations of the CPU suite (``hybrid``, ``hybrid+host``, ``hybrid-small``,
``hybrid-small+host``).

"Against an uncached run with the same split schedule": the GDN kernels are not split-invariant,
so a reference must cut the sequence exactly where the cached run's state was computed. The
worker (``CheckWorker``) records, for every state it stores (pass ends, taps) and every KV row
it writes, a fingerprint of the bytes together with the token prefix and the chain of model-call
boundaries that produced them. Whatever the cache hands a later pass (a resumed state, prefix KV
slots, restored from the host or copied as a tail) must match such a record for the same tokens
(else the check fails: the cache served bytes the model never computed for that prefix); the
record names the schedule. After each configuration, each request is recomputed with no cache
at all, standalone with the same model and kernels, cut at that schedule, and compared at its
prompt end: every KV row and the conv state bitwise, the recurrent (SSM) state within
``SSM_TOL``, and every greedy token (at every position the worker sampled, under the schedule it
sampled with). The reuse the CPU suite asserts is asserted again. A request that went on from
prefix KV computed by another request under another schedule (a deduplicated block) has no
single-schedule reference: it is listed apart (``mixed_schedule_requests``), its provenance
still checked. Retraction is forced with SGLang's own test switch (``SGLANG_TEST_RETRACT``).
"""

from __future__ import annotations

import importlib.util
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from common import ROOT, Ctx, add_paths, log, tiny_model

SSM_TOL = 1e-5  # max |Δ| of the fp32 recurrent state against the same-schedule reference
MOD = (1 << 61) - 1


def _exactness_conftest() -> Any:
    """test/exactness/conftest.py under its own name (its CONFIGS and pressure program)."""
    spec = importlib.util.spec_from_file_location(
        "exactness_conftest", ROOT / "test" / "exactness" / "conftest.py"
    )
    assert spec is not None and spec.loader is not None
    if "exactness_conftest" in sys.modules:
        return sys.modules["exactness_conftest"]
    mod = importlib.util.module_from_spec(spec)
    sys.modules["exactness_conftest"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------- fingerprints
class Fingerprint:
    """Exact 2 x ~60-bit fingerprints of tensor bytes, computed on the tensors' device."""

    def __init__(self) -> None:
        self._w: dict[tuple[int, str], torch.Tensor] = {}

    def _weights(self, n: int, device: torch.device) -> torch.Tensor:
        key = (n, str(device))
        if key not in self._w:
            g = torch.Generator().manual_seed(1234 + n)
            self._w[key] = torch.randint(1, 4096, (2, n), generator=g, dtype=torch.int64).to(device)
        return self._w[key]

    @staticmethod
    def _ints(x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        size = x.element_size()
        view = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
        return x.view(view).to(torch.int64)

    def rows(self, x: torch.Tensor) -> list[tuple[int, int]]:
        """One fingerprint per row of ``x`` ([n, ...], any dtype)."""
        if x.shape[0] == 0:
            return []
        ints = self._ints(x.reshape(x.shape[0], -1))
        w = self._weights(ints.shape[1], ints.device)
        h = (ints[:, None, :] * w[None, :, :]).sum(-1).cpu().tolist()
        return [(a, b) for a, b in h]

    def whole(self, parts: list[torch.Tensor]) -> tuple[int, int]:
        flat = torch.cat([self._ints(p.reshape(-1)) for p in parts])
        w = self._weights(flat.numel(), flat.device)
        a, b = (flat[None, :] * w).sum(-1).cpu().tolist()
        return (a, b)


def token_hashes(tokens: list[int]) -> list[int]:
    """h[i] fingerprints tokens[:i] (h[0] = 0)."""
    out, h = [0], 0
    for t in tokens:
        h = (h * 1_000_003 + int(t) + 1) % MOD
        out.append(h)
    return out


@dataclass
class Capture:
    """A request's state at the end of its prompt (first pass reaching it), as the pools hold it."""

    end: int
    chain: tuple[int, ...]
    conv: torch.Tensor  # [linear layers, conv_dim, W-1]
    temporal: torch.Tensor  # [linear layers, Hv, V, K]
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per full layer (K, V) [end, Hkv, D]
    # The schedule and the token list of the pass that produced each row (None: unknown).
    kv_chains: list[tuple[tuple[int, ...], list[int]] | None]
    tokens: list[int] = field(default_factory=list)


def make_worker_class(standin_gdn: Any = None, interpreted: bool = False) -> type:
    """``CheckWorker``: the model worker plus the provenance records described above.

    ``standin_gdn`` (CPU only): a function with the signature of SGLang's Triton
    ``chunk_gated_delta_rule``, used through the same adapter the CUDA build uses: the torch
    stand-in (smoke mode), or with ``interpreted`` SGLang's kernel itself under Triton's
    interpreter (``sglang_hybrid.cpu.triton_interpret``).
    """
    from sglang_hybrid.cpu import gdn_kernels
    from sglang_hybrid.cpu.model_worker import ModelWorker
    from sglang_hybrid.cpu.taps import taps_inside

    class CheckWorker(ModelWorker):
        # On the CPU (smoke mode) too, compute as the CUDA build does: bf16 pools and model.
        AS_SERVED_ON_CPU = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if standin_gdn is not None and interpreted:
                self.gdn = gdn_kernels.GdnKernels.sglang(standin_gdn, name="sglang-triton")
                self.gdn_note = "SGLang's Triton chunk_gated_delta_rule, Triton interpreter (CPU)"
            elif standin_gdn is not None:
                self.gdn = gdn_kernels.GdnKernels.sglang(standin_gdn, name="sglang-api-torch")
                self.gdn_note = "CPU smoke: SGLang's kernel API over transformers' torch GDN"
            self.fp = Fingerprint()
            self.state_origin: dict[tuple, tuple[int, tuple[int, ...]]] = {}
            self.kv_origin: dict[tuple, tuple[int, tuple[int, ...], list[int]]] = {}
            self.chain: dict[str, tuple[int, ...] | None] = {}
            self.captures: dict[str, Capture] = {}
            self.sampled: dict[str, list[tuple[int, tuple[int, ...] | None, int]]] = {}
            self.problems: list[str] = []
            self._tok: dict[str, tuple[list[int], list[int]]] = {}
            self.resumes = 0
            # Requests that went on from prefix KV another request computed under another
            # schedule (a block deduplicated onto the tree's copy): no single-schedule reference
            # reproduces them, so they are reported apart.
            self.mixed: set[str] = set()

        # ---------------------------------------------------------- helpers
        def _tokens(self, req: Any) -> tuple[list[int], list[int]]:
            """The request's tokens and their prefix hashes: lists that only grow (appended in
            place), so a record can keep a reference and slice it later."""
            toks = [*req.origin_input_ids, *req.output_ids]
            cached = self._tok.get(req.rid)
            if cached is None or cached[0] != toks[: len(cached[0])]:
                cached = (toks, token_hashes(toks))
                self._tok[req.rid] = cached
            else:
                seq, hashes = cached
                h = hashes[-1]
                for t in toks[len(seq) :]:
                    seq.append(t)
                    h = (h * 1_000_003 + int(t) + 1) % MOD
                    hashes.append(h)
            return cached

        def _slot_parts(self, slot: int) -> list[torch.Tensor]:
            v = self._view
            return [v.conv[:, slot], v.temporal[:, slot]]

        def _kv_rows(self, locs: torch.Tensor) -> torch.Tensor:
            v = self._view
            parts = []
            for layer, kind in enumerate(v.layer_types):
                if kind == "full_attention":
                    for buf in (v.kv_pool.get_key_buffer(layer), v.kv_pool.get_value_buffer(layer)):
                        parts.append(buf[locs].reshape(locs.numel(), -1))
            return torch.cat(parts, dim=1)

        # ---------------------------------------------------------- the pass
        def _next_tokens(self, batch: Any, spans: list[Any]) -> torch.Tensor:
            skip = {
                s.req.rid
                for s in spans
                if s.req.finished() or getattr(s.req, "to_finish", None) is not None
            }
            out = super()._next_tokens(batch, spans)
            for span, tok in zip(spans, out.tolist()):
                rid = span.req.rid
                if rid in skip:
                    continue
                end = span.prefix_len + span.extend_len
                self.sampled.setdefault(rid, []).append((end, self.chain.get(rid), int(tok)))
            return out

        def _forward_request(
            self, span: Any, input_ids: Any, out_cache_loc: Any, req_pool_idx: int, slot: int
        ) -> torch.Tensor:
            req, rid = span.req, span.req.rid
            prefix, end = span.prefix_len, span.prefix_len + span.extend_len
            toks, th = self._tokens(req)
            chain: tuple[int, ...] | None = ()
            if prefix > 0:
                digest = self.fp.whole(self._slot_parts(slot))
                hit = self.state_origin.get(digest)
                if hit is None:
                    self.problems.append(
                        f"{rid}: the state resumed at {prefix} matches no state the model computed"
                    )
                    chain = None
                elif hit[0] != th[prefix] or hit[1][-1] != prefix:
                    self.problems.append(
                        f"{rid}: the state resumed at {prefix} was computed for other tokens or "
                        f"another position ({hit[1][-1]})"
                    )
                    chain = None
                else:
                    chain = hit[1]
                    if self.chain.get(rid) is None or self.chain[rid] != chain:
                        self.resumes += 1
                if chain is not None and span.extend_len > 1:
                    self._check_prefix_kv(rid, req_pool_idx, prefix, chain, toks, th)
            logits = super()._forward_request(span, input_ids, out_cache_loc, req_pool_idx, slot)
            taps = taps_inside(req, prefix, span.extend_len)
            bounds = sorted({t.position for t in taps} | {end})
            if chain is None:
                self.chain[rid] = None
                return logits
            full = chain + tuple(bounds)
            for tap in taps:
                k = full.index(tap.position) + 1
                digest = self.fp.whole(self._slot_parts(tap.dst_slot))
                self.state_origin[digest] = (th[tap.position], full[:k])
            self.state_origin[self.fp.whole(self._slot_parts(slot))] = (th[end], full)
            locs = self._view.kv_slots(req_pool_idx, prefix, end)
            digests = self.fp.rows(self._kv_rows(locs))
            start, k = prefix, len(chain)
            for bound in bounds:
                k += 1
                piece_chain = full[:k]
                for i in range(start, bound):
                    self.kv_origin[digests[i - prefix]] = (th[i + 1], piece_chain, toks)
                start = bound
            self.chain[rid] = full
            if rid not in self.captures and end >= len(req.origin_input_ids):
                self._capture(rid, req_pool_idx, slot, end, full, toks, th)
            return logits

        def _check_prefix_kv(
            self,
            rid: str,
            req_pool_idx: int,
            prefix: int,
            chain: tuple[int, ...],
            toks: list[int],
            th: list[int],
        ) -> None:
            """The prefix KV a prefill pass reads: computed by the model for these tokens, and
            (else the request is *mixed*) under a schedule consistent with ``chain``."""
            locs = self._view.kv_slots(req_pool_idx, 0, prefix)
            for i, d in enumerate(self.fp.rows(self._kv_rows(locs))):
                hit = self.kv_origin.get(d)
                if hit is None or hit[0] != th[i + 1]:
                    self.problems.append(
                        f"{rid}: a pass read KV at position {i} that the model never computed "
                        "for these tokens"
                    )
                    return
                if not (_is_prefix(hit[1], chain) and hit[2][: hit[1][-1]] == toks[: hit[1][-1]]):
                    self.mixed.add(rid)

        def _capture(
            self,
            rid: str,
            req_pool_idx: int,
            slot: int,
            end: int,
            chain: tuple[int, ...],
            toks: list[int],
            th: list[int],
        ) -> None:
            v = self._view
            locs = v.kv_slots(req_pool_idx, 0, end)
            kv = []
            for layer, kind in enumerate(v.layer_types):
                if kind == "full_attention":
                    kv.append(
                        (
                            v.kv_pool.get_key_buffer(layer)[locs].cpu(),
                            v.kv_pool.get_value_buffer(layer)[locs].cpu(),
                        )
                    )
            kv_chains: list[tuple[tuple[int, ...], list[int]] | None] = []
            for i, d in enumerate(self.fp.rows(self._kv_rows(locs))):
                hit = self.kv_origin.get(d)
                if hit is None or hit[0] != th[i + 1]:
                    self.problems.append(
                        f"{rid}: the KV at position {i} matches no KV the model computed for "
                        "these tokens"
                    )
                    kv_chains.append(None)
                else:
                    kv_chains.append((hit[1], hit[2]))
            self.captures[rid] = Capture(
                end=end,
                chain=chain,
                conv=v.conv[:, slot].cpu().clone(),
                temporal=v.temporal[:, slot].cpu().clone(),
                kv=kv,
                kv_chains=kv_chains,
                tokens=toks[:end],
            )

    return CheckWorker


# ---------------------------------------------------------------- the reference
@dataclass
class Ref:
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    conv: torch.Tensor
    temporal: torch.Tensor
    logits: dict[int, torch.Tensor]


def reference(worker: Any, tokens: list[int], chain: tuple[int, ...]) -> Ref:
    """No cache, no SGLang: the worker's model over ``tokens`` cut at ``chain``."""
    from transformers.cache_utils import DynamicCache

    from sglang_hybrid.cpu import gdn_kernels
    from sglang_hybrid.cpu.split_invariant import split_invariant_conv

    model, dev = worker.hf_model, worker.device
    cache = DynamicCache(config=worker.hf_config)
    ids = torch.tensor(tokens[: chain[-1]], dtype=torch.int64, device=dev)
    logits: dict[int, torch.Tensor] = {}
    start = 0
    with (
        torch.no_grad(),
        split_invariant_conv(model),
        gdn_kernels.swapped(model, worker.gdn),
    ):
        for bound in chain:
            out = model(
                input_ids=ids[start:bound].unsqueeze(0),
                position_ids=torch.arange(start, bound, dtype=torch.int64, device=dev).unsqueeze(0),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            logits[bound] = out.logits[0, -1].to(torch.float32).cpu()
            start = bound
    view = worker._view
    keep = view.conv_kernel - 1
    kv, conv, temporal = [], [], []
    for layer, kind in enumerate(view.layer_types):
        lay = cache.layers[layer]
        if kind == "full_attention":
            kv.append((lay.keys[0].permute(1, 0, 2).cpu(), lay.values[0].permute(1, 0, 2).cpu()))
        else:
            conv.append(lay.conv_states[0][0, :, -keep:].to(view.conv.dtype).cpu())
            temporal.append(lay.recurrent_states[0][0].transpose(-1, -2).cpu())
    return Ref(kv, torch.stack(conv), torch.stack(temporal), logits)


def _is_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return len(a) <= len(b) and b[: len(a)] == a


def verify(worker: Any, reqs: dict[str, Any]) -> dict[str, Any]:
    """Every capture and every sampled token against same-schedule references."""
    refs: dict[tuple, Ref] = {}

    def ref(tokens: list[int], chain: tuple[int, ...]) -> Ref:
        key = (tuple(tokens[: chain[-1]]), chain)
        if key not in refs:
            refs[key] = reference(worker, tokens, chain)
        return refs[key]

    kv_mismatch = conv_mismatch = 0
    ssm_max = logit_max = 0.0
    states_checked = kv_rows_checked = 0
    per_req: dict[str, Any] = {}
    mixed = sorted(worker.mixed)
    for rid, cap in worker.captures.items():
        if rid in worker.mixed:
            continue
        r = ref(cap.tokens, cap.chain)
        conv_eq = torch.equal(cap.conv, r.conv)
        ssm = (cap.temporal.float() - r.temporal.float()).abs().max().item()
        got_logits = worker.logits.get(rid, {}).get(cap.end)
        dlog = (
            (got_logits.float() - r.logits[cap.end]).abs().max().item()
            if got_logits is not None
            else None
        )
        rows_bad = 0
        # Rows grouped by the pass that produced them; a pass on this request's own schedule
        # and tokens is covered by ``r``, another one (a block deduplicated from another
        # request) gets its own reference.
        groups: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[list[int], list[int]]] = {}
        for i, c in enumerate(cap.kv_chains):
            if c is not None:  # keyed by the producer's tokens, not by the list object
                groups.setdefault((c[0], tuple(c[1])), (c[1], []))[1].append(i)
        for (chain, _), (producer_tokens, positions) in groups.items():
            own = _is_prefix(chain, cap.chain) and (
                producer_tokens[: chain[-1]] == cap.tokens[: chain[-1]]
            )
            rr = r if own else ref(producer_tokens, chain)
            idx = torch.tensor(positions)
            for (k, v), (rk, rv) in zip(cap.kv, rr.kv):
                bad = ~(
                    (k[idx] == rk[idx]).reshape(len(positions), -1).all(1)
                    & (v[idx] == rv[idx]).reshape(len(positions), -1).all(1)
                )
                rows_bad += int(bad.sum())
            kv_rows_checked += len(positions)
        kv_mismatch += rows_bad
        conv_mismatch += 0 if conv_eq else 1
        ssm_max = max(ssm_max, ssm)
        if dlog is not None:
            logit_max = max(logit_max, dlog)
        states_checked += 1
        per_req[rid] = {
            "prompt_end": cap.end,
            "pieces": len(cap.chain),
            "kv_rows_bitwise": rows_bad == 0,
            "conv_bitwise": conv_eq,
            "ssm_max_abs": ssm,
            "first_logits_max_abs": dlog,
        }
    # Greedy tokens: each sampled position against a reference with the schedule it had.
    token_checked = token_bad = 0
    bad_examples: list[str] = []
    for rid, recs in worker.sampled.items():
        req = reqs.get(rid)
        if req is None or rid in worker.mixed:
            continue
        tokens = [*req.origin_input_ids, *req.output_ids]
        chains = [c for _, c, _ in recs if c is not None]
        maximal = [c for c in chains if not any(c != d and _is_prefix(c, d) for d in chains)]
        for end, chain, tok in recs:
            if chain is None:
                continue
            cover = next(m for m in maximal if _is_prefix(chain, m))
            if cover[-1] > len(tokens):
                continue
            got = int(torch.argmax(ref(tokens, cover).logits[end]))
            token_checked += 1
            if got != tok:
                token_bad += 1
                if len(bad_examples) < 5:
                    bad_examples.append(f"{rid}@{end}: sampled {tok}, reference {got}")
    return {
        "states_checked": states_checked,
        "kv_rows_checked": kv_rows_checked,
        "kv_rows_not_bitwise": kv_mismatch,
        "conv_states_not_bitwise": conv_mismatch,
        "ssm_max_abs": ssm_max,
        "first_token_logits_max_abs": logit_max,
        "tokens_checked": token_checked,
        "tokens_differing": token_bad,
        "token_examples": bad_examples,
        "reference_runs": len(refs),
        "mixed_schedule_requests": mixed,
        "per_request": per_req,
    }


# ---------------------------------------------------------------- programs and configs
# (prompt, max_new) of the retraction program and SGLang's forced-retraction interval (in
# forward passes; SGLANG_TEST_RETRACT's mechanism), full and in the CPU smoke mode.
RETRACT = {
    "lengths": (600, 700),
    "interval": 100,
    "quick_lengths": (300, 300),
    "quick_interval": 60,
}


def retraction(chat: Any, rng: random.Random, quick: bool = False) -> Any:
    """Two long decodes, admitted together (the configuration runs with
    ``schedule_conservativeness=0.01``), under SGLang's own retraction test switch
    (``SGLANG_TEST_RETRACT``: ``retract_decode`` every N passes, here set on the scheduler module
    for this program only): SGLang retracts one (releases its row through the cache, re-queues
    it) and re-admits it later from what the cache kept of it. Memory pressure alone does not
    provoke it reliably: the cache's admission budget keeps decode within the pool."""
    from programs import Req, Wave

    n, new = RETRACT["quick_lengths" if quick else "lengths"]
    a = [rng.randrange(20, 1500) for _ in range(n)]
    b = [rng.randrange(20, 1500) for _ in range(n)]
    yield Wave([Req("rt-0", a, new, to_length=True), Req("rt-1", b, new, to_length=True)])


def plan(quick: bool) -> dict[str, list[str]]:
    """Programs per configuration (quick: the CPU smoke mode's subset)."""
    from programs import PROGRAMS

    if quick:
        return {
            "hybrid+host": [
                "multi_turn",
                "host_only_restore",
                "new_prefix_together",
                "cancel_mid_prefill",
            ],
            "hybrid-small+host": ["retraction"],
        }
    # Most informative first: a stage stopped at its time limit keeps the configurations done.
    return {
        "hybrid+host": list(PROGRAMS),
        "hybrid-small+host": ["pressure", "retraction"],
        "hybrid": list(PROGRAMS),
        "hybrid-small": ["pressure", "retraction"],
    }


# CPU-suite reuse that depends on bookkeeping only: the same on any device.
def expected_reuse(name: str, results: dict[str, Any], asked: dict[str, Any]) -> dict[str, Any]:
    from programs import CHUNK, floor64

    out: dict[str, Any] = {}

    def cached(rid: str) -> int | None:
        r = results.get(rid)
        return None if r is None else r.cached_tokens

    if "re-resume" in results:
        out["re-resume == floor64(599)"] = (cached("re-resume"), floor64(599))
    if "cm-2" in results:
        out["cm-2 == 3 chunks"] = (cached("cm-2"), 3 * CHUNK)
    if "it-0" in results:
        out["it-* == 448"] = ([cached(f"it-{i}") for i in range(8)], [448] * 8)
    if "np-0" in results:
        got = sorted(cached(f"np-{i}") or 0 for i in range(6))
        out["np-* == [0] + [640] * 5"] = (got, [0] + [640] * 5)
    if "mt-2" in results and "mt-1" in results:
        end = len(asked["mt-1"].ids) + len(results["mt-1"].output_ids) - 1
        out["mt-2 == endpoint"] = (cached("mt-2"), end)
    if "ho-2" in results and "ho-1" in results:
        end = len(asked["ho-1"].ids) + len(results["ho-1"].output_ids) - 1
        out["ho-2 == endpoint"] = (cached("ho-2"), end)
    return out


def run_config(ctx: Ctx, name: str, programs: list[str], model: Path, chat: Any) -> dict:
    from programs import PROGRAMS
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_hybrid.cpu.loop import InProcessScheduler
    from sglang_hybrid.sglang import plugin
    from sglang_hybrid.sglang.flags import HybridOptions

    ex = _exactness_conftest()
    plugin.register()
    HookRegistry.apply_hooks()
    cfg = {**ex.BASE, **ex.CONFIGS[name]}
    host_mib = cfg.pop("host_mib")
    extra_opts = {}
    if "tap_mode" in cfg:  # split / zero-split, as the CPU suite runs this configuration
        extra_opts["tap_mode"] = cfg.pop("tap_mode")
    cfg["radix_cache_backend"] = "hybrid"
    if "retraction" in programs:
        cfg["schedule_conservativeness"] = 0.01  # admit both, so both decode together
    options = HybridOptions(
        host_cache_mib=host_mib,
        tap_ladder=ex.LADDER,
        tap_min_gap=ex.MIN_GAP,
        taps_per_request=ex.TAPS,
        **extra_opts,
    )
    standin = None
    interpret = False
    if not ctx.cuda:
        from stage_chunk import interpreted

        interpret = interpreted()
        if interpret:  # SGLang's own kernel, interpreted (the caller applied the shims)
            from sglang.kernels.ops.attention.fla.chunk import chunk_gated_delta_rule

            standin = chunk_gated_delta_rule
        else:
            import torch_gdn

            standin = torch_gdn.chunk_gated_delta_rule
    worker_class = make_worker_class(standin, interpret)
    dtype = "bfloat16"  # as served; the CPU smoke mode runs the same dtype path
    t0 = time.perf_counter()
    all_programs = {
        **PROGRAMS,
        "pressure": ex._pressure,
        "retraction": lambda chat, rng: retraction(chat, rng, ctx.quick),
    }
    sched = InProcessScheduler(
        model,
        worker="model",
        worker_class=worker_class,
        record_logits=True,
        device=ctx.device,
        dtype=dtype,
        server_args_attrs={"_hybrid_options": options},
        **cfg,
    )
    try:
        worker = sched.worker
        import sglang.srt.managers.scheduler as scheduler_module
        from program_driver import drive

        def before(pname: str) -> None:
            scheduler_module.TEST_RETRACT = pname == "retraction"
            scheduler_module.TEST_RETRACT_INTERVAL = RETRACT[
                "quick_interval" if ctx.quick else "interval"
            ]

        asked, reqs, results = drive(sched, programs, all_programs, chat, before_program=before)
        run_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        checks = verify(worker, reqs)
        verify_s = time.perf_counter() - t1
        tc = sched.tree_cache
        out = {
            "programs": programs,
            "options": {"host_cache_mib": host_mib, **extra_opts},
            "gdn": worker.gdn.name if worker.gdn is not None else worker.gdn_note,
            "gdn_source": worker.gdn_note,
            "dtype": dtype,
            "requests": len(results),
            "reuse": {rid: r.cached_tokens for rid, r in sorted(results.items())},
            "resumes_checked": worker.resumes,
            "provenance_problems": worker.problems[:20],
            "provenance_problem_count": len(worker.problems),
            "retractions": sum(getattr(r, "retraction_count", 0) for r in reqs.values()),
            "coalesce_waiters": tc.stats().get("coalesce_waiters"),
            "host_restored_bytes": tc.host_tier.restored_bytes if tc.host_tier is not None else 0,
            "run_s": run_s,
            "verify_s": verify_s,
            "expected_reuse": expected_reuse(name, results, asked),
            **checks,
        }
        return out
    finally:
        import sglang.srt.managers.scheduler as scheduler_module

        scheduler_module.TEST_RETRACT = False
        sched.close()


def run(ctx: Ctx) -> None:
    add_paths()
    import os

    from transformers import AutoTokenizer

    if ctx.cuda:
        torch.use_deterministic_algorithms(True, warn_only=True)
    from programs import Chat

    model = tiny_model(ctx.tmp)
    chat = Chat(AutoTokenizer.from_pretrained(model))
    configs: dict[str, Any] = {}
    ctx.note("ssm_tolerance", SSM_TOL)
    ctx.note("cublas_workspace_config", os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    ctx.result["configs"] = configs
    for name, programs in plan(ctx.quick).items():
        log(f"  config {name}: {', '.join(programs)}")
        try:
            res = run_config(ctx, name, programs, model, chat)
        except Exception as e:  # one configuration failing must not hide the others
            import traceback

            configs[name] = {"error": "".join(traceback.format_exception(e))[-4000:]}
            ctx.check(f"{name}: ran", False, error=repr(e)[:300])
            ctx.flush()
            continue
        configs[name] = res
        _judge(ctx, name, res)
        ctx.flush()


def _judge(ctx: Ctx, name: str, r: dict) -> None:
    ctx.check(
        f"{name}: every resumed state and prefix KV row is one the model computed",
        r["provenance_problem_count"] == 0,
        problems=r["provenance_problems"][:3],
        resumes=r["resumes_checked"],
    )
    if r["mixed_schedule_requests"]:
        log(
            f"  {name}: not compared (prefix KV from another schedule): "
            + ", ".join(r["mixed_schedule_requests"])
        )
    ctx.check(
        f"{name}: greedy tokens equal the same-schedule uncached reference",
        r["tokens_differing"] == 0 and r["tokens_checked"] > 0,
        checked=r["tokens_checked"],
        differing=r["tokens_differing"],
        examples=r["token_examples"][:2],
    )
    ctx.check(
        f"{name}: KV rows bitwise",
        r["kv_rows_not_bitwise"] == 0 and r["kv_rows_checked"] > 0,
        rows=r["kv_rows_checked"],
        not_bitwise=r["kv_rows_not_bitwise"],
    )
    ctx.check(
        f"{name}: conv states bitwise",
        r["conv_states_not_bitwise"] == 0 and r["states_checked"] > 0,
        states=r["states_checked"],
        not_bitwise=r["conv_states_not_bitwise"],
    )
    ctx.check(
        f"{name}: SSM states within {SSM_TOL:g}",
        r["ssm_max_abs"] <= SSM_TOL,
        max_abs=r["ssm_max_abs"],
        first_token_logits_max_abs=r["first_token_logits_max_abs"],
    )
    for label, (got, want) in r["expected_reuse"].items():
        ctx.check(f"{name}: reuse {label}", got == want, got=got, want=want)
    if "retraction" in r["programs"]:
        ctx.check(f"{name}: a decode was retracted", r["retractions"] > 0, n=r["retractions"])


def dry(ctx: Ctx) -> None:
    """Imports, the worker class, the plan, and the GDN adapter against transformers' torch."""
    add_paths()
    import programs  # noqa: F401
    import torch_gdn
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    from sglang_hybrid.cpu import gdn_kernels

    ex = _exactness_conftest()
    make_worker_class()
    full = plan(False)
    for name, progs in full.items():
        assert name in ex.CONFIGS, name
        log(f"  {name}: {', '.join(progs)}")
    ctx.note("plan", full)
    # The adapter (the CUDA path's code) over the stand-in vs transformers' own torch GDN.
    g = torch.Generator().manual_seed(0)
    b, t, h, k, v = 1, 150, 4, 16, 24
    q, kk = torch.randn(b, t, h, k, generator=g), torch.randn(b, t, h, k, generator=g)
    vv = torch.randn(b, t, h, v, generator=g)
    gg = -torch.rand(b, t, h, generator=g)
    beta = torch.rand(b, t, h, generator=g)
    s0 = torch.randn(b, h, k, v, generator=g)
    adapter = gdn_kernels.GdnKernels.sglang(torch_gdn.chunk_gated_delta_rule).chunk
    o1, s1 = adapter(
        q, kk, vv, gg, beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    o2, s2 = torch_gdn._REFERENCE(
        q,
        kk,
        vv,
        g=gg,
        beta=beta,
        initial_state=s0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    err = max((o1 - o2).abs().max().item(), (s1 - s2).abs().max().item())
    ctx.check(
        "the GDN adapter (SGLang's layout) computes transformers' GDN",
        err < 1e-4,
        max_abs=err,
        module=m.__name__,
    )
    if torch.cuda.is_available():  # the device-imports variant: CUDA faked present
        ok, detail = _resolve_cuda_args(ctx)
        ctx.check("the CUDA build's server arguments resolve", ok, **detail)


def _resolve_cuda_args(ctx: Ctx) -> tuple[bool, dict[str, Any]]:
    """ServerArgs as stage B builds them, resolved by SGLang with CUDA (faked) present."""
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    from sglang_hybrid.cpu.install import cpu_server_args
    from sglang_hybrid.sglang import plugin
    from sglang_hybrid.sglang.flags import HybridOptions

    ex = _exactness_conftest()
    cfg = {**ex.BASE, **ex.CONFIGS["hybrid+host"]}
    cfg.pop("host_mib")
    cfg.pop("tap_mode", None)
    kw = cpu_server_args(
        model_path=str(tiny_model(ctx.tmp)),
        device="cuda",
        dtype="bfloat16",
        radix_cache_backend="hybrid",
        **cfg,
    )
    plugin.register()
    HookRegistry.apply_hooks()
    sa = ServerArgs(**kw)
    sa._hybrid_options = HybridOptions(host_cache_mib=64)
    try:
        publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0))
    except Exception as e:
        return False, {"error": repr(e)[:500]}
    return True, {
        "device": sa.device,
        "dtype": sa.dtype,
        "linear_attn_backend": getattr(sa, "linear_attn_backend", None),
        "mamba_radix_cache_strategy": sa.mamba_radix_cache_strategy,
        "disable_overlap_schedule": sa.disable_overlap_schedule,
    }
