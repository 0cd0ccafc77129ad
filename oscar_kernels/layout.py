"""Default sizes of the INT2 serving layout (docs/METHOD.md): the one place they are written down.

Torch-free, so recipes and help texts can use them without importing torch.

- ``DEFAULT_SINK`` (``S0``): the first tokens of a sequence, kept in BF16.
- ``DEFAULT_RECENT`` (``W``): the newest tokens, kept in BF16; decode demotes ``DEMOTION_BLOCK`` at a time,
  so the recent tier holds ``W .. W + DEMOTION_BLOCK - 1`` tokens.
- ``UNIFORM_INNER``: the inner INT2 level of uniform min-max quantization (levels ``0, 1, 2, 3`` in units of the
  scale; ``oscar_kernels.reference`` formula 8, recipe ``quant.levels``).
"""

DEFAULT_SINK = 64
DEFAULT_RECENT = 256
DEMOTION_BLOCK = 8
UNIFORM_INNER = 1.0 / 3.0
