"""``fusec serve``: an OpenAI-compatible HTTP server over a generation plan, with continuous batching.

* ``batcher``: the engine thread. Each request takes a free row of the plan's batch; new requests
  join at a step boundary (one prefill admits them, writing only their rows) while the other rows
  keep decoding; a row is freed on an end-of-sequence token, ``max_tokens``, or a cancel (a stop
  string, a client that went away). Nothing here knows HTTP.
* ``text``: token ids to streamed text (whole characters only, stop strings held back).
* ``protocol``: the OpenAI request fields, their checks and the response/error objects.
* ``app`` (and ``metrics``): the HTTP side (Starlette on uvicorn; prometheus_client), imported only
  by ``fusec serve``: the optional ``serve`` extra; ``import fusec`` never needs it.
"""
