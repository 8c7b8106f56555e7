"""docs/settings.md is generated from the settings models; the checked-in page must match the code."""

from __future__ import annotations

from pathlib import Path

from infra import settings_doc
from infra.settings import Settings

DOC = Path(__file__).resolve().parents[2] / "docs" / "settings.md"


def test_the_settings_page_matches_the_code() -> None:
    assert DOC.read_text() == settings_doc.render(), "run `python -m infra.settings_doc > docs/settings.md`"


def test_every_option_and_variable_is_on_the_page_with_its_description() -> None:
    page = settings_doc.render()
    for option in Settings.__dataclass_fields__.values():
        assert f"| `{option.name}` |" in page and option.metadata["description"] in page
    assert "| `SPOTCR_EBS_HANDOVER_SECONDS` | whole number | 3600 |" in page
