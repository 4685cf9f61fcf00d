"""Gradient compression for FSDP2: compressors, error feedback, and the communicators that move payloads.

Three parts, as in GRACE: a *compressor* turns a tensor into a ``Payload`` and back and knows nothing
of process groups; ``ErrorFeedback`` wraps any compressor; a *communicator* (``compress.communicator``)
is the FSDP2 reduce-scatter / all-reduce hook that moves payloads between ranks.
"""
