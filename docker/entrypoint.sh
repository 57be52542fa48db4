#!/bin/sh
# Start Triton on the chat pipeline; llm runs on the GPUs when the container sees any, else on the CPU
# (ensemble_repo/llm/configs/cpu.pbtxt), so one image serves both without edits.
set -e
# `openai`: the OpenAI-compatible front end instead (python -m openai_frontend; TRITON_GRPC_URL says where
# Triton is, API_KEYS or API_KEYS_FILE turn keys on). Compose runs it as its own service from this image.
if [ "$1" = "openai" ]; then
  shift
  exec python3 -m openai_frontend "$@"
fi
if nvidia-smi -L >/dev/null 2>&1; then
  config=""
else
  echo "entrypoint: no GPU visible, serving llm on the CPU (--model-config-name=cpu)" >&2
  config="--model-config-name=cpu --pinned-memory-pool-byte-size=0 --cuda-memory-pool-byte-size=0:0 --allow-gpu-metrics=false"
fi
# The APIs that change the server (model load/unload, shared memory, logging, tracing) need the header
# admin-key: $ADMIN_KEY. Without ADMIN_KEY the key is random, so they stay shut.
if [ -z "${ADMIN_KEY}" ]; then
  echo "entrypoint: ADMIN_KEY is not set, the model repository API is locked" >&2
  ADMIN_KEY=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
fi
# Models and tokenizers load only from inside these folders (contract/folders.py).
export MODEL_ROOTS="${MODEL_ROOTS:-/opt/chat/cache/models:/models}"
restricted="model-repository,shared-memory,logging,trace:admin-key=${ADMIN_KEY}"
# launcher supervise runs tritonserver as its child, with the watchdog beside it (Triton 2.51 does not
# notice a Python stub that dies: launcher/watchdog.py reloads its model). exec: it replaces this shell as
# PID 1, so docker stop's SIGTERM reaches it, and it drains first: new requests are refused, those running
# get up to DRAIN_TIMEOUT seconds (30) to finish, then tritonserver gets its SIGTERM (docs/operations.md).
# thread-pool-size: the Python backend's threads per model instance (launcher/tritonserver.py, PYTHON_BACKEND_THREADS, says why).
# Explicit model control lets operators reload preprocess (a new tokenizer) without touching llm.
ADMIN_KEY="$ADMIN_KEY" exec python3 -m launcher supervise \
  tritonserver --model-repository="${MODEL_REPOSITORY:-/opt/chat/ensemble_repo}" --model-control-mode=explicit \
  --http-port="${HTTP_PORT:-8000}" --grpc-port="${GRPC_PORT:-8001}" --metrics-port="${METRICS_PORT:-8002}" \
  --load-model='*' --exit-timeout-secs=30 --backend-config=python,thread-pool-size=512 \
  --http-restricted-api="$restricted" --grpc-restricted-protocol="$restricted" \
  $config "$@"
