"""The gRPC router: validation, tokenization, SLO-aware admission, pair choice, streaming, metrics.

Never imports torch: it runs in the Ray driver next to grpc.aio.
"""
