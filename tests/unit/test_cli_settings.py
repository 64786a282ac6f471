"""A bad setting in the environment is reported on one line naming its variable, exit 2."""

from __future__ import annotations

import pytest

from services.cli import main


def test_a_bad_environment_setting_is_one_line_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("REFINERY_SESSION_TIMEOUT_S", "3")
    assert main(["topics", "list", "--json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("refinery: error: REFINERY_SESSION_TIMEOUT_S: "), err
    assert "greater than or equal to 6" in err and "'3'" in err, err
