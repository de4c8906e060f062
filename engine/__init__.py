"""pdserve's shared core: config, request state, paged KV cache, scheduler, model runner, sampling.

Torch-free modules (``types``, ``errors``, ``validation``, ``prefix_hash``, ``tokenizer_files``, ``grammar``) are safe to
import from the router; everything else pulls in torch and transformers.
"""
