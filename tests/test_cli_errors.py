"""Both command lines (``hlserve`` and ``python -m hlserve.cli.simulate``) report a user's
mistake as one ``hlserve: error: ...`` line with exit status 2, through one
``errors.run_command``, and not as a traceback."""

from __future__ import annotations

import pytest

from hlserve import cli
from hlserve.cli import simulate as sim_cli


@pytest.mark.parametrize("main", [cli.main, sim_cli.main], ids=["hlserve", "sim"])
def test_a_bad_argument_is_one_error_line_and_status_2(main, capsys) -> None:
    rc = main(["cost", "--hardware", "NOPE", "--model", "Qwen2.5-32B", "--prefill", "10"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("hlserve: error: unknown hardware 'NOPE'"), err
    assert "Traceback" not in err


def test_success_is_status_0(capsys) -> None:
    assert cli.main(["cost", "--hardware", "H20", "--model", "Qwen2.5-32B", "--prefill",
                     "1024"]) == 0
