# liverl image for gateway, workers and trainer (docker-compose.yml). CPU torch by default;
# on GPU hosts build with --build-arg TORCH_INDEX=<a CUDA wheel index> if you need one.
FROM python:3.11-slim
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY pipeline ./pipeline
COPY topics ./topics
COPY schemas ./schemas
# Editable, so schemas/ and topics/ (the contracts) are found next to the package.
RUN pip install -e .
# Settings come from LIVERL_* variables (see README); state and weights live on volumes.
ENV LIVERL_STATE_DIR=/var/lib/liverl
VOLUME ["/var/lib/liverl"]
ENTRYPOINT ["liverl"]
CMD ["--help"]
