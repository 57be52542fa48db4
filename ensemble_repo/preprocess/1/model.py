"""Triton loads ``preprocess`` from here; the glue lives in the importable ``triton_glue/preprocess_model.py``."""

from triton_glue.preprocess_model import TritonPythonModel  # noqa: F401  (the class python_backend looks for)
