"""The roles: one state machine per role, each owning its loop, its error policy and its metrics.

What it owns: ``base`` (states, the error policy, locks, the ``Stage`` users subclass), one
module per role (dataloader, generate, rollout, logp, ref_logp, teacher_logp, critic, reward, train,
param_update, validate) and the ``registry`` the flow builds them from.

What it may import: ``core`` (records, channels, gate, ledger, history, the engine protocols) and
``algorithms`` (the train role applies the configured advantages and loss); never ``engines``,
``param_sync``, ``tasks`` or ``pipeline``: a role sees engines only through protocols.
"""
