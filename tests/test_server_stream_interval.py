"""``STREAM_INTERVAL``: a streamed reply's tokens go out that many at a time, on a real server."""

from __future__ import annotations

import pytest

from client import ChatClient, Prompt
from launcher.tritonserver import TritonServer
from conftest import exact_repository, running_server

INTERVAL = 4


@pytest.fixture(scope="module")
def coalescing(model_dir, tmp_path_factory) -> TritonServer:
    """The repository of the shared ``server`` (float32 activations), with ``STREAM_INTERVAL=4``."""
    yield from running_server(model_dir, tmp_path_factory, exact_repository(tmp_path_factory), STREAM_INTERVAL=str(INTERVAL))


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_streamed_reply_comes_interval_tokens_at_a_time_and_adds_up_to_the_whole(coalescing, protocol):
    port = coalescing.ports.http if protocol == "http" else coalescing.ports.grpc
    client = ChatClient(f"127.0.0.1:{port}", protocol)
    prompt = Prompt("Tell me a short story about a lighthouse keeper.", 23, ignore_eos=True)
    chunks = list(client.stream(prompt))
    counts = [c.completion_tokens for c in chunks]
    steps = [b - a for a, b in zip([0] + counts, counts)]
    # The first token at once (time to first token is not traded), then at least INTERVAL a chunk, the
    # rest in the last: 23 tokens make 1 + 4 x 5 + 2 at most 7 chunks.
    assert counts[-1] == 23 and len(chunks) <= 7, counts
    assert steps[0] >= 1 and all(step >= INTERVAL for step in steps[1:-1]), counts
    assert all(not c.finish_reason for c in chunks[:-1]) and chunks[-1].finish_reason == "length"
    whole = client.generate(prompt)
    client.close()
    assert "".join(c.text_output for c in chunks) == whole.text_output


def test_the_llm_log_says_how_replies_are_streamed(coalescing):
    assert f"streamed {INTERVAL} tokens at a time" in coalescing.log_path.read_text()
