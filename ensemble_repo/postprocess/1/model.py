"""Triton loads ``postprocess`` from here; the glue lives in the importable ``triton_glue/postprocess_model.py``."""

from triton_glue.postprocess_model import TritonPythonModel  # noqa: F401  (the class python_backend looks for)
