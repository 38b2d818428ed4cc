"""Which chat format each registered model_type gets: every type names a registered renderer, except the
types whose released chat template no public copy was found of (docs/renderers.md, "Families without a
renderer"); a multi-turn run with no `environment.renderer` refuses those by family and type."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from archon.agents.renderer import default_renderer_name, renderer_names
from archon.spec import get_spec, supported_model_types

WITHOUT_RENDERER = ("kimi_linear",)
"""The model_types with no default renderer: no public copy of their released chat template was found."""
DOCS = Path(__file__).resolve().parents[1] / "docs" / "renderers.md"


def test_every_model_type_names_a_registered_renderer_or_is_refused_by_name():
    registered = set(renderer_names())
    for model_type in supported_model_types():
        if model_type in WITHOUT_RENDERER:
            family = get_spec(model_type).name
            refusal = f"family '{family}' names no renderer for model_type '{model_type}'; set the environment's"
            with pytest.raises(ValueError, match=re.escape(refusal)):
                default_renderer_name(model_type)
        else:
            assert default_renderer_name(model_type) in registered, model_type


def test_the_docs_say_where_each_missing_template_was_looked_for():
    section = DOCS.read_text().split("## Families without a renderer", 1)[1]
    for model_type in WITHOUT_RENDERER:
        assert f"(`{model_type}`)" in section, model_type
