"""Evaluations: RULER needle-in-a-haystack (``oscar eval-ruler``) and next-token KL (``oscar eval-kl``)."""
