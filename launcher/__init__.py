"""Run the chat pipeline on a real tritonserver (``python -m launcher``, behind ``make run`` / ``make serve``):
locate the binary, prepare and check the model folder, start Triton and the OpenAI front end, watch the
Python stubs (reloading a model whose stub died), and stop them all, draining first."""
