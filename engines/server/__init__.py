"""Rollout servers: generation in processes of its own behind sglang's HTTP API.

``app`` is ``tandem serve`` (the embedded engine behind sglang's native API and OpenAI's
``/v1`` completions); ``client`` speaks that API to one server (ours or a real sglang one);
``router`` is the ``RolloutEngine`` over N servers; ``weights`` moves the trainer's weights into
them (shared memory, a torch.distributed group, disk); ``launcher`` starts and stops server
processes; ``components`` builds the flow's bundle around them; ``agent`` trains agents written
against the ``openai`` client from the records the server keeps.
"""
