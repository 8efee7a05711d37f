"""The image workload's engines: Flow-GRPO on a diffusers flow-matching generator (Liu et al. 2025).

Each denoising step of an image is an action. The modules, bottom up:

- :mod:`~engines.diffusion.payload`: ``ImagePayload``, what an image trajectory carries (the
  chain of latents, the schedule, the decoded image);
- :mod:`~engines.diffusion.model`: loading a generator folder (diffusers' pipeline layout)
  and the guided velocity both engines compute;
- :mod:`~engines.diffusion.rollout`: the continuously batched SDE sampler, weight sync between
  denoising steps;
- :mod:`~engines.diffusion.train`: per-step log-probs recomputed, the loss in micro-batches of
  (sample, step) pairs, the exact KL to the initial weights;
- :mod:`~engines.diffusion.workflow`: the flow's rollout requests as sampling plans (denoising
  reduction, Flow-GRPO-Fast windows, ``rollout.with_reward``), and the pictures of each evaluation
  (drawn by :mod:`~engines.diffusion.grid`);
- :mod:`~engines.diffusion.build` and :mod:`~engines.ray.image`: the bundles
  ``pipeline.builders.WORKLOADS`` names for tasks of kind ``image``, in process and on Ray.

Nothing is imported here: the modules pull in torch and diffusers, which a config never needs.
"""
