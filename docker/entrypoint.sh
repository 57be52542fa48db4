#!/bin/sh
# Start Triton on the chat pipeline; llm runs on the GPUs when the container sees any, else on the CPU
# (ensemble_repo/llm/configs/cpu.pbtxt), so one image serves both without edits.
set -e
if nvidia-smi -L >/dev/null 2>&1; then
  config=""
else
  echo "entrypoint: no GPU visible, serving llm on the CPU (--model-config-name=cpu)" >&2
  config="--model-config-name=cpu"
fi
# Explicit model control lets operators reload preprocess (a new tokenizer) without touching llm.
exec tritonserver --model-repository="${MODEL_REPOSITORY:-/opt/chat/ensemble_repo}" --model-control-mode=explicit \
  --load-model='*' --exit-timeout-secs=30 $config "$@"
