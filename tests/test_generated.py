"""The files written from contract/schema.py (``make generate``) say what the schema says."""

from __future__ import annotations

from contract import generate, schema


def test_no_generated_file_is_stale():
    assert [str(p.relative_to(generate.ROOT)) for p in generate.stale()] == [], "run make generate"


def test_the_staleness_check_sees_a_changed_field(monkeypatch):
    """The check can fail: a field whose type changes makes every config that declares it stale."""
    changed = tuple(f if f.name != "top_k" else schema.Field("top_k", "TYPE_INT64", to=f.to) for f in schema.REQUEST)
    monkeypatch.setattr(generate, "REQUEST", changed)
    monkeypatch.setattr(generate, "MODELS", {**generate.MODELS, "ensemble": (
        generate._inputs(changed, ragged=False), generate._outputs(schema.RESPONSE), (True, True))})
    stale = {str(p.relative_to(generate.ROOT)) for p in generate.stale()}
    assert {"ensemble_repo/ensemble/config.pbtxt", "docs/api.md"} <= stale
