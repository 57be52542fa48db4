"""Pieces shared by the three Python models: config parameters, client errors and tokenizer loading."""
