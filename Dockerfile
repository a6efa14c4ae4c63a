# agentmw images, one multi-target Dockerfile (docs/deploy.md):
#   docker build --target host       -t agentmw-host:0.1.0 .
#   docker build --target middleware -t agentmw-middleware:0.1.0 .
# The wheel is built in its own stage (setup.py generates the gRPC stubs into it); the runtime
# stages install only the wheel and its pinned dependencies.

FROM python:3.11-slim AS build
WORKDIR /src
COPY . .
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim AS runtime
RUN useradd --system --uid 10001 agentmw
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER agentmw
WORKDIR /home/agentmw

# The agent host: AgentHost gRPC on 50070, Prometheus metrics on 9464, sessions in /data.
FROM runtime AS host
LABEL org.opencontainers.image.title="agentmw-host"
USER root
RUN mkdir /data && chown agentmw /data
USER agentmw
VOLUME /data
EXPOSE 50070 9464
ENTRYPOINT ["agent-host"]
CMD ["--listen", "0.0.0.0:50070", "--db", "/data/agentmw.db", "--metrics-port", "9464"]

# A middleware server: any MiddlewareBase subclass, given as module:Class (the Python ones of this
# repository are in the image), e.g. mw_servers.examples.timing:TimingMiddleware.
FROM runtime AS middleware
LABEL org.opencontainers.image.title="agentmw-middleware"
EXPOSE 50061
ENTRYPOINT ["python", "-m", "agentmw.sdk"]
CMD ["mw_servers.examples.timing:TimingMiddleware", "--address", "0.0.0.0:50061"]
