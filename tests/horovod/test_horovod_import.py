"""Importing keras_lms.horovod without a working Horovod must say how to install it (no Horovod needed)."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_import_without_horovod_names_the_installer():
    code = (
        "import sys\n"
        "sys.modules['horovod'] = None\n"  # makes `import horovod...` raise ImportError
        "sys.modules['horovod.tensorflow'] = None\n"
        "try:\n"
        "    import keras_lms.horovod\n"
        "except ImportError as e:\n"
        "    print('IMPORTERROR:', e)\n"
        "else:\n"
        "    print('NO ERROR')\n"
    )
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith(("IMPORTERROR", "NO ERROR"))][-1]
    assert line.startswith("IMPORTERROR")
    assert "make install" in line and "scripts/install_horovod.sh" in line
