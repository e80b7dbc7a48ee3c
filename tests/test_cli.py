"""The `keras-lms` command (keras_lms/cli.py): `report` and `info` in a real subprocess, quiet about TensorFlow's
start-up unless `--verbose`; a bad flag or a damaged file is one line on stderr, exit status 2."""

import json
import os
import pathlib
import re
import subprocess
import sys

import keras
import pytest
from PIL import Image

from tests import models

# TensorFlow's start-up lines that the command hides (keras_lms/__init__.py sets TF_CPP_MIN_LOG_LEVEL before
# TensorFlow is imported); tests/conftest.py sets the level for the test process, so the subprocesses drop it.
NOISE = ("cpu_feature_guard", "absl::InitializeLog", "oneDNN")
QUIET_ENV = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}


def _noise(stderr: str) -> list:
    return [line for line in stderr.splitlines() if any(n in line for n in NOISE)]


def test_cli_report_and_info(tmp_path):
    """`python -m keras_lms.cli report/info`: the answers, a PNG, JSON, and no TensorFlow start-up lines."""
    path = tmp_path / "m.keras"
    models.unet2d().save(path)
    png = tmp_path / "out.png"
    cmd = [sys.executable, "-m", "keras_lms.cli"]
    out = subprocess.run(cmd + ["report", str(path), "--batch-size", "4", "--budget", "6GiB", "--plot", str(png)],
                         capture_output=True, text=True, timeout=300, env=QUIET_ENV)
    assert out.returncode == 0, out.stderr
    assert "predicted device peak" in out.stdout and "LMS not needed" in out.stdout
    assert not _noise(out.stderr), out.stderr
    with Image.open(png) as img:
        assert img.size == (900, 450)
    js = subprocess.run(cmd + ["report", str(path), "--batch-size", "2", "--json"], capture_output=True, text=True,
                        timeout=300)
    assert js.returncode == 0, js.stderr
    assert json.loads(js.stdout)["batch_size"] == 2
    info = subprocess.run(cmd + ["info", "--json"], capture_output=True, text=True, timeout=300, env=QUIET_ENV)
    data = json.loads(info.stdout)
    assert data["keras"] == keras.__version__ and data["host_ram_total_gib"] > 0
    assert data["keras_backend"] == keras.backend.backend()
    assert data["keras_devices"] is None or len(data["keras_devices"]) >= 1  # (torch's Keras lists none)
    assert not _noise(info.stderr), info.stderr
    bad = subprocess.run(cmd + ["report", str(tmp_path / "missing.keras"), "--batch-size", "1"], capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and "no such model file" in bad.stderr


def test_cli_prints_no_tensorflow_start_up_logs_unless_verbose():
    """The installed `keras-lms` command: `info` without TensorFlow's start-up lines on stderr under the test
    run's back end; under TensorFlow's, with `--verbose` they are there (the control: the lines exist to be
    hidden). The control runs in the TensorFlow run of the suite only: under JAX's back end (and torch's Keras,
    which imports JAX when it is installed) jaxlib initialises absl's logging before TensorFlow is imported, and
    TensorFlow then writes no start-up lines at all, so there is nothing to show there, and a TensorFlow
    subprocess started from those runs would only repeat the TensorFlow run's. `python -m keras_lms.cli` is
    checked above."""
    cmd = [str(pathlib.Path(sys.executable).parent / "keras-lms")]
    quiet = subprocess.run(cmd + ["info", "--json"], capture_output=True, text=True, timeout=300, env=QUIET_ENV)
    assert quiet.returncode == 0, quiet.stderr
    assert not _noise(quiet.stderr), quiet.stderr
    if keras.backend.backend() != "tensorflow":
        return
    loud = subprocess.run(cmd + ["--verbose", "info", "--json"], capture_output=True, text=True, timeout=300,
                          env=QUIET_ENV)
    assert loud.returncode == 0 and _noise(loud.stderr), loud.stderr


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "m.keras"
    models.conv_chain().save(path)
    return path


@pytest.mark.parametrize("extra,pattern", [
    (["--link-gbps", "0"], "--link-gbps must be a positive"),
    (["--device", "h100-pcie9"], "'h100-pcie9' is neither a built-in profile.*h100-pcie5"),
    (["--profile", "/nonexistent/p.json"], "neither a built-in profile .* nor a profile file"),
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


def test_cli_report_on_a_device_profile(saved_model, capsys):
    from keras_lms import cli

    assert cli.main(["report", str(saved_model), "--batch-size", "2", "--device", "gh200"]) == 0
    out = capsys.readouterr().out
    assert "predicted step time (ms) on gh200" in out and "offload-only" in out


def test_cli_calibrate_smoke_writes_a_profile_report_reads(tmp_path, saved_model, capsys):
    pytest.importorskip("torch")
    from keras_lms import cli
    from keras_lms.planning.device_profile import load_profile

    path = tmp_path / "cpu.json"
    assert cli.main(["calibrate", "--smoke", "--device", "cpu", "--out", str(path)]) == 0
    measured = load_profile(str(path))
    assert measured.name == "smoke-cpu" and measured.host_to_device_bytes_per_second > 0
    assert "measured by keras-lms calibrate" in measured.sources["flops_per_second"]
    # the convolution rate per channel count and the layout-copy rate, each with its source
    assert sorted(measured.convolution_flops_per_second["float32"], key=int) == ["16", "32", "64"]
    assert measured.layout_copy_bytes_per_second > 0 and "layout_copy_bytes_per_second" in measured.sources
    assert cli.main(["report", str(saved_model), "--batch-size", "2", "--profile", str(path)]) == 0
    assert "predicted step time (ms) on smoke-cpu" in capsys.readouterr().out
    # calibrating leaves the process's torch settings as they were (it switches on TF32 and cuDNN's autotuner)
    import torch

    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)
    assert before != (True, True, True), "the control: calibrate must have something to change"
    cli.main(["calibrate", "--smoke", "--device", "cpu", "--out", str(path)])
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
            torch.backends.cudnn.benchmark) == before
    # without --smoke a CPU is refused: calibrate measures a GPU
    assert cli.main(["calibrate", "--device", "cpu", "--out", str(path)]) == 2
    assert "is not one" in capsys.readouterr().err
