"""``oscar bench``: INT2 decode-attention kernels against the best BF16 decode, on one CUDA GPU.

:func:`oscar_cli.bench.harness.run` takes a :class:`~oscar_cli.bench.harness.BenchConfig` and returns a
:class:`~oscar_cli.bench.harness.BenchResult`; :mod:`oscar_cli.bench.shapes` names real models' shapes.
"""

from oscar_cli.bench.shapes import NAMED_SHAPES, AttnShape, parse_shape

__all__ = ["NAMED_SHAPES", "AttnShape", "parse_shape"]
