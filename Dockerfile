# CUDA image for serving lightllm on NVIDIA GPUs (Hopper or newer recommended).
FROM pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime

WORKDIR /opt/lightllm
COPY requirements.txt setup.py ./
COPY constraints ./constraints
COPY lightllm ./lightllm
RUN pip install --no-cache-dir -c constraints/cuda.txt -r requirements.txt \
    && pip install --no-cache-dir -c constraints/cuda.txt -e .

EXPOSE 8000
ENTRYPOINT ["python", "-m", "lightllm.server.api_server", "--host", "0.0.0.0", "--port", "8000"]
