"""Test helpers shared by the test modules (test modules never import each other; they import from here).

- :mod:`helpers.tiny`: the one tiny-model factory (any supported family, heads, head_dim, layers, dtype, seed,
  positions), a saved tiny model directory with a word-level tokenizer, a tiny :class:`LoadedModel` with a
  character tokenizer.
- :mod:`helpers.calib`: seeded random rotations and layer transforms, a tiny calibration recipe.
- :mod:`helpers.layers`: driving one cache layer through chunked prefill and decode steps.
- :mod:`helpers.evaldata`: a small essay-like prose folder and a ``load_model`` stand-in.
- :mod:`helpers.fakehub`: an in-process Hugging Face Hub server (its fixtures are registered by conftest.py).

``tests/`` is on ``sys.path`` because ``tests/conftest.py`` is a rootdir conftest (pytest's default
``prepend`` import mode), so ``from helpers.tiny import tiny_causal_lm`` works from any test module.
"""
