"""``ov-kvcrush serve``: an OpenAI-compatible HTTP server over one continuous-batching pipeline
(:class:`~ov_kvcrush.serving.ContinuousBatchingPipeline`) and its compressed KV pool.

:mod:`~ov_kvcrush.server.protocol` turns request bodies into validated settings (and errors into
OpenAI-shaped bodies), :mod:`~ov_kvcrush.server.backend` runs them on the pipeline and streams
their text, :mod:`~ov_kvcrush.server.metrics` counts what Prometheus scrapes, and
:mod:`~ov_kvcrush.server.app` is the ASGI app (Starlette, served by uvicorn).
"""
