"""``pdserve bench``: an open-loop serving benchmark after vLLM's ``benchmark_serving``.

One run, per request rate: seeded synthetic requests (``dataset``) arrive as a Poisson (or gamma,
``--burstiness``) process; each is sent through a backend (``backends``: our gRPC router, or any
OpenAI-compatible HTTP server) that times its tokens; ``runner`` bounds the run in count and time;
``report`` turns the per-request outcomes into vLLM's numbers plus goodput and SLO attainment and
saves them as JSON; ``plots`` draws attainment and goodput against rate and latency CDFs, for one
run or several systems side by side. ``cli.main`` is the ``pdserve bench`` subcommand.

Definitions (also printed with every result):
  goodput        requests that completed and met every given SLO, per second of the run (vLLM's)
  SLO attainment those good requests over every request submitted: failures and rejections
                 (gRPC RESOURCE_EXHAUSTED, HTTP 429/503) count as misses
  TPOT           (e2e - TTFT) / (output tokens - 1), per request with at least 2 tokens
  ITL            gaps between consecutive tokens; tokens that arrive in one stream message share
                 its arrival time, so their gaps are 0
Exit status: 0 when requests were served and every other one was refused by admission; 1 (with
a line saying why) when any request failed, none was served, or the server cannot be reached or
driven (nothing answers within 30 s, every warm-up request fails); 2 for a usage error.
"""
