"""Triton loads ``ensemble_infer`` from here; the glue lives in the importable ``triton_glue/ensemble_infer_model.py``."""

from triton_glue.ensemble_infer_model import TritonPythonModel  # noqa: F401  (the class python_backend looks for)
