"""API key files: both formats, their errors, and lookups (no server needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hlserve.server.openai_api.auth import KeyTable


def test_json_and_line_formats(tmp_path: Path) -> None:
    j = tmp_path / "keys.json"
    j.write_text(json.dumps({"sk-a": "agent", "sk-i": "interactive", "sk-n": None}))
    t = tmp_path / "keys.txt"
    t.write_text("# ops\nsk-a agent\n\nsk-i   interactive  # the chat UI\nsk-n\n")
    for path in (j, t):
        keys = KeyTable.load("sk-main", path)
        assert len(keys) == 4 and keys.enabled
        assert keys.find("sk-a").request_class == "agent"
        assert keys.find("sk-i").request_class == "interactive"
        assert keys.find("sk-n").request_class is None
        assert keys.find("sk-main").request_class is None
        assert keys.find("sk-") is None
        assert keys.find("") is None
        assert keys.find(None) is None


def test_no_keys_means_no_auth() -> None:
    assert not KeyTable.load(None, None).enabled


@pytest.mark.parametrize("text, message", [
    ("sk-a admin\n", "expected 'KEY [interactive|agent]'"),
    ("sk-a agent extra\n", "expected 'KEY [interactive|agent]'"),
    ("# nothing\n", "holds no API keys"),
    ('{"sk-a": "admin"}', "class must be one of"),
    ('{"sk-a": 1}', "expected a JSON object"),
    ('{"sk-a": ', "not valid JSON"),
])
def test_bad_key_files_name_the_problem(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("|", r"\|")):
        KeyTable.load(None, path)
    with pytest.raises(ValueError, match="cannot read"):
        KeyTable.load(None, tmp_path / "missing")
