"""The start-up speed machinery and every private torch / Triton API monorl uses, behind this one package boundary:
`private_apis` (each private call, by name: Dynamo's lazy disable, the compile caches and counters, `_grouped_mm`,
`_foreach_copy_`, AdamW's unwrapped methods, Triton's availability), `precompile` (monorl's Triton kernels compiled
ahead in threads from a kept list, Triton's cache key computed in a child) and `preload` (the ATen kernels an
earlier run launched, replayed in a thread). `tests/test_private_apis.py` fails by name when an upgrade removes one,
and fails when a private API is used outside this package. It imports nothing of monorl's but `fsutil`: every layer
may use it."""
