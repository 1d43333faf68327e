"""The shared third tier, L3: stores, object format, and the work of its threads (issue #39)."""
