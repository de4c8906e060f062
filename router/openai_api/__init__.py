"""The OpenAI-compatible HTTP API of the router (FastAPI + uvicorn in the router's own event
loop): ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming as server-sent events
or not), ``GET /v1/models`` and ``GET /health``.

It is a second front door over the same request path as gRPC (``router.generation``): an
OpenAI request becomes a ``GenerateRequest`` (``requests.py``), runs through the shared
``GenerationCore`` (limits, identity, tokenizing off the loop, admission, metrics, error words),
and its events become OpenAI's JSON (``responses.py``); errors take OpenAI's shape and status
codes (``errors.py``). ``run.py`` drives one request inside its HTTP connection's task (a client
that disconnects cancels it), ``app.py`` routes and authenticates, ``server.py`` runs uvicorn.
"""
