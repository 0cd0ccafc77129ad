"""oscar_kernels: the INT2 KV-cache format and its kernels.

- :mod:`oscar_kernels.reference` — the pure-torch CPU specification (formulas, bit order, what can be asserted).
- Triton kernels (``int2_pack``, ``int2_decode``, ``tier_copy``, ``rotate_kv``, ``history``) hold only
  ``@triton.jit`` code; ``ops`` holds the launchers (``write_ops``, ``decode_ops``, ``tier_ops``, ``rotate_ops``,
  ``history_ops``, their shared ``launch_checks``).

Shape alphabet used in every docstring and comment: ``B`` batch, ``H_q`` query heads, ``H_kv`` KV heads,
``g = H_q / H_kv``, ``T`` tokens, ``D`` head_dim, ``G`` quantization group size, ``S`` splits.
"""
