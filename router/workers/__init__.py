"""Local models' engines in worker processes of their own.

- :mod:`.wire`: the messages between the router and a worker, and their framing.
- :mod:`.process`: a worker process (``python -m router.workers --model NAME``).
- :mod:`.host`: the worker's side: one engine, its requests, their steps batched a frame a turn.
- :mod:`.client`: the router's side: :class:`~.client.WorkerEngine`, an
  :class:`~router.engine.Engine` whose engine runs in a worker; :class:`~.client.InlineEngine`
  for one in the router's own process.

Which models are loaded, and when, is :mod:`router.fleet`'s business.
"""
