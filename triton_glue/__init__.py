"""Code that runs inside Triton's Python backend stubs, or watches them: the one layer that knows Triton.

``<model>_model.py`` holds each model's ``TritonPythonModel`` (``ensemble_repo/<model>/1/model.py`` only
re-exports it, so the benchmark and unit tests can import the glue); ``tensors`` converts tensors and
builds per-request responses; ``params`` reads config parameters; ``metrics`` exports the engine's
events as Triton custom metrics; ``cancel`` carries a client's cancellation to llm; ``inflight`` bounds
accepted requests; ``stubs`` watches the stub processes from outside (``/proc``). Wire prefixes such as
``overloaded:`` are added here, never inside the engine.
"""
