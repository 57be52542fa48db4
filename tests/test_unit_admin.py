"""The tokenizer swap's checks before a server is asked (``client/admin.py``, ``contract/folders.py``)."""

from __future__ import annotations

import pytest


def test_a_relative_folder_is_refused_naming_the_parameter():
    from contract.folders import allowed_folder

    with pytest.raises(ValueError, match="parameter 'tokenizer_dir': models/x is a relative path"):
        allowed_folder("tokenizer_dir", "models/x")


def test_the_admin_client_drops_the_python_stack_from_a_failed_load():
    from client.admin import reason

    message = ("load failed for model 'preprocess': version 1 is at UNAVAILABLE state: Internal: ValueError: "
               "parameter 'tokenizer_dir': /etc is outside MODEL_ROOTS (/m)\n\nAt:\n  /r/contract/folders.py(23): "
               "allowed_folder\n  /r/preprocess/__init__.py(42): __init__\n;\n")
    assert reason(message).endswith("parameter 'tokenizer_dir': /etc is outside MODEL_ROOTS (/m)")


def test_the_admin_client_refuses_a_relative_tokenizer_dir_before_asking_the_server():
    from client.admin import swap_tokenizer

    with pytest.raises(RuntimeError, match="absolute path"):
        swap_tokenizer("127.0.0.1:1", "models/x")
