"""What ``preprocess``, ``llm`` and ``postprocess`` agree on, with no Triton in it: the request schema
(``schema``), the client-error type and the wire prefixes (``errors``), finish reasons, stop strings
(``stops``), and how tokenizers are loaded and fingerprinted (``tokenizer``, ``paths``).

The bottom layer: it imports nothing of this repository.
"""
