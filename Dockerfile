# agentmw images, one multi-target Dockerfile (docs/deploy.md):
#   docker build --target host       -t agentmw-host:0.1.0 .
#   docker build --target middleware -t agentmw-middleware:0.1.0 .
# The wheels of both distributions are built in their own stage (sdk/setup.py generates the gRPC
# stubs into agentmw-sdk's); each runtime stage installs only what it runs: the host everything,
# a middleware server only the core/SDK (agentmw-sdk: grpcio, protobuf, jsonschema, the
# OpenTelemetry API) and its own code.

FROM python:3.11-slim AS build
WORKDIR /src
COPY . .
RUN pip wheel --no-cache-dir --wheel-dir /wheels . ./sdk

FROM python:3.11-slim AS runtime
RUN useradd --system --uid 10001 agentmw
WORKDIR /home/agentmw

# The agent host: AgentHost gRPC on 50070, Prometheus metrics on 9464, sessions in /data.
FROM runtime AS host
LABEL org.opencontainers.image.title="agentmw-host"
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links /wheels agentmw
RUN mkdir /data && chown agentmw /data
USER agentmw
VOLUME /data
EXPOSE 50070 9464
ENTRYPOINT ["agent-host"]
CMD ["--listen", "0.0.0.0:50070", "--db", "/data/agentmw.db", "--metrics-port", "9464"]

# A middleware server: any MiddlewareBase subclass, given as module:Class. The image holds the SDK
# alone (no host) and this repository's example middleware (mw_servers.examples, which need nothing
# more); yours go in an image built FROM this one, with their own dependencies.
FROM runtime AS middleware
LABEL org.opencontainers.image.title="agentmw-middleware"
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links /wheels agentmw-sdk
COPY mw_servers/__init__.py /opt/agentmw/mw_servers/
COPY mw_servers/examples/*.py /opt/agentmw/mw_servers/examples/
ENV PYTHONPATH=/opt/agentmw
USER agentmw
EXPOSE 50061
ENTRYPOINT ["python", "-m", "agentmw.sdk"]
CMD ["mw_servers.examples.timing:TimingMiddleware", "--address", "0.0.0.0:50061"]
