"""``oscar bench``: INT2 decode-attention kernels against the best BF16 decode, on one CUDA GPU.

:func:`oscar_cli.bench.harness.run` takes a :class:`~oscar_cli.bench.config.BenchConfig` and returns a
:class:`~oscar_cli.bench.report.BenchResult`. The parts: :mod:`.shapes` (real models' attention shapes),
:mod:`.environment` (what a record says about where it ran), :mod:`.timing` (eager and CUDA-graph medians over
rotating inputs), :mod:`.cases` (INT2 decode inputs, launch plans, bytes moved), :mod:`.backends` (INT2, SDPA,
FlashInfer, quantize-on-write), :mod:`.report` (the record, its JSON reload and plot), :mod:`.kernel_options`
(``--kernel KEY=VALUE``).
"""

from oscar_cli.bench.shapes import NAMED_SHAPES, AttnShape, parse_shape

__all__ = ["NAMED_SHAPES", "AttnShape", "parse_shape"]
