"""What ``preprocess``, ``llm`` and ``postprocess`` agree on, with no Triton in it: the request schema
(``schema``), the client-error type and the wire prefixes (``errors``), finish reasons, stop strings
(``stops``), a thinking model's reasoning apart from its answer (``reasoning``), and how tokenizers are loaded
and fingerprinted (``tokenizer``, ``paths``).

The bottom layer: it imports nothing of this repository.
"""
