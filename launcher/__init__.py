"""Run the chat pipeline on a real tritonserver: locate the binary, prepare the model, start and stop."""
