"""Triton loads ``llm`` from here; the glue lives in the importable ``triton_glue/llm_model.py``."""

from triton_glue.llm_model import TritonPythonModel  # noqa: F401  (the class python_backend looks for)
