"""Code that runs inside Triton's Python backend stubs: the one layer that knows Triton.

``<model>_model.py`` holds each model's ``TritonPythonModel`` (``ensemble_repo/<model>/1/model.py`` only
re-exports it, so the benchmark and unit tests can import the glue); ``tensors`` converts tensors and
builds per-request responses; ``params`` reads config parameters; ``metrics`` exports the engine's
events as Triton custom metrics; ``inflight`` bounds accepted requests. What the stubs share with each
other and with the processes around Triton (cancel marks, the drain notice, which stubs run) is ``ipc``'s.
Wire prefixes such as ``overloaded:`` are added here, never inside the engine.
"""
