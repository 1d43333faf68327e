"""``python -m sglang_hybrid.scaleout.launch_router [router args]``: SGLang's router, all policies.

The arguments are ``python -m sglang_router.launch_router``'s, parsed by its own parser, and the
router is started by its own ``launch_router``. Only ``--policy`` may also name a policy that the
router's Rust core implements (``sglang_router.router.policy_from_str``) but the 0.3.2 command
line does not list: ``consistent_hashing`` (a hash ring over the workers, keyed by the
``X-SMG-Routing-Key`` header) and ``prefix_hash``. For those the parser sees ``round_robin`` and
the policy is set on the parsed ``RouterArgs`` before the router is built — nothing in the router
is changed.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

# Policies the router's core takes that its 0.3.2 parser rejects.
EXTRA_POLICIES = ("consistent_hashing", "prefix_hash")


def split_policy(argv: Sequence[str]) -> tuple[list[str], str | None]:
    """``argv`` with an extra policy replaced by one the parser accepts, and that policy."""
    out = list(argv)
    for i, a in enumerate(out):
        if a == "--policy" and i + 1 < len(out) and out[i + 1] in EXTRA_POLICIES:
            policy = out[i + 1]
            out[i + 1] = "round_robin"
            return out, policy
        if a.startswith("--policy=") and a.split("=", 1)[1] in EXTRA_POLICIES:
            out[i] = "--policy=round_robin"
            return out, a.split("=", 1)[1]
    return out, None


def main(argv: Sequence[str] | None = None) -> None:
    from sglang_router.launch_router import launch_router, parse_router_args

    args, policy = split_policy(sys.argv[1:] if argv is None else argv)
    router_args = parse_router_args(args)
    if policy is not None:
        router_args.policy = policy
    launch_router(router_args)


if __name__ == "__main__":
    main()
