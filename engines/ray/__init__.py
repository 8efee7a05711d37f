"""The Ray placement: the torch engines as Ray actors, for text, episodes and images.

- :mod:`~tandem.engines.ray.actors`: the actor classes (rollout, trainer, trainer ranks,
  reference, reward);
- :mod:`~tandem.engines.ray.build` and :mod:`~tandem.engines.ray.image`: the bundles
  ``pipeline.builders.WORKLOADS`` names for ``engines.type: ray``.

Nothing is imported here: ``import ray`` happens only when a config places engines on Ray.
"""
