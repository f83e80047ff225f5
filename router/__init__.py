"""``kvtier router``: an OpenAI-compatible front that sends each request to the engine
that holds its prefix (or is least loaded), and runs prefill/decode disaggregation.

See ``docs/router.md``.
"""
