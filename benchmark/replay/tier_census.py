"""What the two tiers hold during a replay: a census of blocks and state images (issue #37).

Runs ``sglang-hybrid replay run`` with the arguments given (one ``hybrid`` cache) and, every
``--every`` calls of the cache's ``evict`` (SGLang asks for device room once per pass that
needs it), walks the index and counts:

- KV blocks by tier: ``host`` (a host copy, no device copy), ``dup`` (a copy on both tiers),
  ``device`` (a device copy only, running requests' blocks included);
- each by what lies below it: ``host_snap`` (a live snapshot whose image the host holds: the
  host alone can serve a resume through it), ``device_snap`` (only device-held images),
  ``none`` (dead KV);
- state images by where they are: ``H`` host only, ``D`` device only, ``HD`` both;
- ``lanes``: the index's lanes opened so far, the census's clock (a retried or re-admitted
  request opens another, so it runs past the trace's request count).

A copy on both tiers is what an exclusive hierarchy (``--hybrid-host-exclusive``) can give back;
``dup`` blocks and ``HD`` images bound what it can gain. The walk is O(tree) per census, so this
is a benchmark tool, not something the cache does.

    python benchmark/replay/tier_census.py --every 1500 --json OUT.json -- \
        --trace=chat --geometry=qwen3.5-27b --device=h200 --budget-gib 32 --host-gib=96 \
        --caches=hybrid [--host-exclusive] --out=/tmp/census --no-progress

Prints one line per census (to stderr, beside the replay's log) and writes them to ``--json``.

    python benchmark/replay/tier_census.py plot A.json B.json ... --out census.png

draws each file's mean composition (blocks and images, in host slabs) as one stacked bar.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any


def census(index: Any) -> dict[str, Any]:
    """One walk of ``index``'s tree, children before parents."""
    from sglang_hybrid.index.node import FastResidency as R

    host_below: dict[Any, bool] = {}
    device_below: dict[Any, bool] = {}
    blocks: Counter[str] = Counter()
    for node in index.tree.subtree_postorder(index.tree.root):
        snaps = [s for s in (node.snapshots or ()) if not s.superseded]
        h = any(s.host_state is R.RESIDENT for s in snaps)
        d = any(s.device_state is R.RESIDENT for s in snaps)
        for c in node.iter_children():
            h, d = h or host_below[c], d or device_below[c]
        host_below[node], device_below[node] = h, d
        if node is index.tree.root:
            continue
        on_host = node.host_state is R.RESIDENT
        on_device = node.device_state is R.RESIDENT
        if not (on_host or on_device):
            continue
        tier = "dup" if on_host and on_device else "host" if on_host else "device"
        below = "host_snap" if h else "device_snap" if d else "none"
        blocks[f"{tier}/{below}"] += 1
    images: Counter[str] = Counter()
    for s in index.snapshots.values():
        where = ("H" if s.host_state is R.RESIDENT else "") + (
            "D" if s.device_state is R.RESIDENT else ""
        )
        images[(where or "-") + ("/superseded" if s.superseded else "")] += 1
    host = index.host
    return {
        "lanes": index.requests,  # lanes opened so far (retried and re-admitted ones too)
        "blocks": dict(sorted(blocks.items())),
        "images": dict(sorted(images.items())),
        "host_free_slabs": host.free if host is not None else 0,
        "host_slabs": host.n_slabs if host is not None else 0,
    }


def means(censuses: list[dict[str, Any]]) -> dict[str, float]:
    """Mean blocks per tier (``host``, ``dup``, ``device``; ``dead`` of those: none below) and
    images per place (``H``, ``HD``, ``D``) over ``censuses``."""
    out: Counter[str] = Counter()
    for c in censuses:
        for key, n in c["blocks"].items():
            tier, below = key.split("/")
            out[tier] += n
            if below == "none":
                out["dead"] += n
        for key, n in c["images"].items():
            out[key.split("/")[0]] += n
    return {k: v / max(1, len(censuses)) for k, v in out.items()}


def plot(files: list[Path], out: Path, image_slabs: list[int]) -> None:
    """One stacked bar per file: its mean blocks and images, in slabs (an image is
    ``image_slabs[i]`` slabs: 48 at the 80B geometry, 37 at the 27B one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [
        ("host", "KV on the host only", "#4c72b0"),
        ("dup", "KV on both tiers", "#dd8452"),
        ("device", "KV on the device only", "#55a868"),
        ("H", "images on the host only", "#8172b3"),
        ("HD", "images on both tiers", "#c44e52"),
    ]
    fig, ax = plt.subplots(figsize=(3.8 + 1.6 * len(files), 4.2))
    for i, (f, slabs) in enumerate(zip(files, image_slabs, strict=True)):
        m = means(json.loads(f.read_text())["censuses"])
        bottom = 0.0
        for key, label, color in parts:
            v = m.get(key, 0.0) * (slabs if key in ("H", "HD") else 1)
            ax.bar(i, v, bottom=bottom, color=color, label=label if i == 0 else None)
            bottom += v
    ax.set_xticks(range(len(files)), [f.stem for f in files])
    ax.set_ylabel("mean slabs held (a KV block is one)")
    ax.set_title("What the two tiers hold (replay censuses)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plot"]:
        pp = argparse.ArgumentParser(description="plot censuses' mean composition")
        pp.add_argument("files", type=Path, nargs="+")
        pp.add_argument("--out", type=Path, required=True)
        pp.add_argument(
            "--image-slabs", type=int, nargs="+", required=True, help="slabs per image, per file"
        )
        a = pp.parse_args(argv[1:])
        if len(a.image_slabs) != len(a.files):
            pp.error("give one --image-slabs value per file")
        plot(a.files, a.out, a.image_slabs)
        print(f"wrote {a.out}")
        return 0
    if "--" not in argv:
        print("usage: tier_census.py [--every N] [--json OUT] -- REPLAY-RUN-ARGS", file=sys.stderr)
        return 2
    cut = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--every", type=int, default=1500, help="evict calls between censuses")
    ap.add_argument("--json", type=Path, help="write the censuses here")
    args = ap.parse_args(argv[:cut])
    if args.every < 1:
        ap.error("--every must be at least 1")

    from sglang_hybrid.cli import main as cli_main
    from sglang_hybrid.sglang import cache as cache_mod

    taken: list[dict[str, Any]] = []
    calls = [0]
    evict = cache_mod.HybridRadixCache.evict

    def counted(cache: Any, params: Any) -> Any:
        calls[0] += 1
        if calls[0] % args.every == 0:
            c = census(cache.index)
            c["evict_calls"] = calls[0]
            taken.append(c)
            print(f"census {json.dumps(c)}", file=sys.stderr, flush=True)
        return evict(cache, params)

    cache_mod.HybridRadixCache.evict = counted  # type: ignore[method-assign]
    rc = cli_main(["replay", "run", *argv[cut + 1 :]])
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": argv[cut + 1 :], "censuses": taken}, indent=1))
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
