"""Generated token ids -> text, paired with the tokenizer that encoded the prompt, streamed or whole."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from contract.errors import InvalidInput
from contract.stops import matched_stop, visible_text
from contract.tokenizer import decode_text, load_tokenizer, vocab_fingerprint


@dataclass(frozen=True)
class PostprocessConfig:
    """``postprocess`` config parameters."""

    tokenizer_dir: str


@dataclass(frozen=True)
class LLMResponse:
    """One llm response: every id so far, how many an earlier response already covered, and whether
    this is the last one. ``logprobs`` (when the request asked) has a row per id: its log-probability,
    then its top alternatives', whose ids are ``top_ids``."""

    output_ids: list[int]
    sent_tokens: int
    finished: bool
    stop: tuple[str, ...] = ()
    stop_after: int = 0  # stop strings count only when they end after this character of the ids' text (min_tokens)
    logprobs: list[list[float]] | None = None
    top_ids: list[list[int]] | None = None


@dataclass(frozen=True)
class Delta:
    """What one response adds: its text, and (when asked) the tokens that text shows, in OpenAI's shape."""

    text: str
    logprobs: list[dict] | None = None
    stop_reason: str = ""  # in the last response: the stop string that ended the reply, if one did


class Detokenizer:
    def __init__(self, config: PostprocessConfig, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        self.tokenizer = tokenizer or load_tokenizer(config.tokenizer_dir)
        self.fingerprint = vocab_fingerprint(self.tokenizer)
        self.vocab_size = len(self.tokenizer)

    def check(self, tokenizer_fingerprint: str) -> None:
        if tokenizer_fingerprint != self.fingerprint:
            raise InvalidInput(
                f"tokenizer_fingerprint {tokenizer_fingerprint!r} does not match postprocess's tokenizer "
                f"({self.fingerprint!r}): load preprocess and postprocess with the same tokenizer vocabulary"
            )

    def delta(self, response: LLMResponse) -> Delta:
        """The text this response adds to the reply (the whole reply when nothing was sent before).

        Stateless incremental detokenization: the text visible after all ids minus the text that was
        visible after the ids already sent. Visible text never ends inside a UTF-8 character or in a
        tail that could still become a stop string, so chunks are always valid UTF-8, never leak a stop
        string, and add up to exactly the text of a non-streamed reply.

        A token's logprobs go with the response whose text first shows all of that token's text, so a
        client that joins chunks gets each token once, beside its text; the last response carries the
        rest (a stop string's tokens, whose text is never shown).
        """
        ids = response.output_ids
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise InvalidInput(f"output_ids holds id {bad[0]}, outside the tokenizer vocabulary of {self.vocab_size}")
        sent = response.sent_tokens
        if not 0 <= sent <= len(ids):
            raise InvalidInput(f"sent_tokens must be in [0, {len(ids)}], got {sent}")
        after = response.stop_after
        decoded = self._decode(ids)
        now = visible_text(decoded, response.stop, response.finished, after)
        before = visible_text(self._decode(ids[:sent]), response.stop, False, after) if sent else ""
        text = now[len(before):]
        stop_reason = (matched_stop(decoded, response.stop, after) or "") if response.finished else ""
        if response.logprobs is None:
            return Delta(text, stop_reason=stop_reason)
        if len(response.logprobs) != len(ids) or len(response.top_ids or []) != len(ids):
            raise InvalidInput(f"output_logprobs and top_logprob_ids need a row per output id ({len(ids)})")
        first = self._shown(ids[:sent], len(before))
        last = len(ids) if response.finished else self._shown(ids, len(now))
        return Delta(text, [self._entry(ids[i], response.logprobs[i], response.top_ids[i]) for i in range(first, last)],
                     stop_reason)

    def prompt_entries(self, logprobs: list[list[float]], ids: list[list[int]]) -> list[dict]:
        """The prompt's tokens as the same items: a row each, the token's id then its alternatives' ids
        (``ids``) and their log-probabilities (``logprobs``); the first token's are NaN, so its logprob is
        None (nothing comes before it, as vLLM reports it)."""
        if len(logprobs) != len(ids) or not ids:
            raise InvalidInput(f"input_logprobs and input_logprob_ids need a row per prompt id ({len(ids)})")
        first = {**self._token(ids[0][0]), "logprob": None, "top_logprobs": []}
        return [first, *(self._entry(row[0], values, row[1:]) for values, row in zip(logprobs[1:], ids[1:]))]

    def _decode(self, ids: list[int]) -> str:
        return decode_text(self.tokenizer, ids)

    def _shown(self, ids: list[int], visible: int) -> int:
        """How many of ``ids`` have all their text among the first ``visible`` characters."""
        for count in range(len(ids), 0, -1):
            text = self._decode(ids[:count])
            if len(text) <= visible and not text.endswith("\ufffd"):
                return count
        return 0

    def _token(self, token: int) -> dict:
        piece = self.tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return {"token": piece, "bytes": list(piece.encode("utf-8"))}

    def _entry(self, token: int, logprobs: list[float], top_ids: list[int]) -> dict:
        """One token as OpenAI's chat ``logprobs.content`` item: its text, bytes and top alternatives."""
        top = [{**self._token(i), "logprob": lp} for i, lp in zip(top_ids, logprobs[1:])]
        return {**self._token(token), "logprob": logprobs[0], "top_logprobs": top}
