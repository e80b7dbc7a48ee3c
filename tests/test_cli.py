"""The `keras-lms` command (keras_lms/cli.py): a bad flag or a damaged file is one line on stderr, exit status 2."""

import re

import pytest

from tests import models


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "m.keras"
    models.conv_chain().save(path)
    return path


@pytest.mark.parametrize("extra,pattern", [
    (["--link-gbps", "0"], "--link-gbps must be a positive"),
    (["--input-shape", "a,b"], "--input-shape 'a,b' is not a shape.*128,128,128,1"),
    (["--plot", "/nonexistent/dir/r.png"], "--plot '/nonexistent/dir/r.png' cannot be written"),
])
def test_cli_errors_are_one_line(saved_model, capsys, extra, pattern):
    from keras_lms import cli

    assert cli.main(["report", str(saved_model), "--batch-size", "2", *extra]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert re.search(pattern, err)


def test_cli_corrupt_keras_file(tmp_path, saved_model, capsys):
    from keras_lms import cli

    corrupt = tmp_path / "c.keras"
    corrupt.write_bytes(saved_model.read_bytes()[:200])
    assert cli.main(["report", str(corrupt), "--batch-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "not a readable .keras file (damaged" in err and "File not found" not in err
