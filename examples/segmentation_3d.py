"""3D U-Net segmentation of volumes (MRI/CT-like) with activations offloaded to host memory by keras-lms.

    python examples/segmentation_3d.py --volume 96 --batch-size 2 --epochs 5 --lms --out runs/seg3d
    horovodrun -np 4 -H host1:2,host2:2 python examples/segmentation_3d.py --horovod --volume 128 ...
    python examples/segmentation_3d.py --data-dir /data/brats --volume 128      # *_image.nii.gz / *_label.nii.gz

Default data: the embedded synthetic generator (noisy volumes, smooth bias field, ellipsoid lesions; the label is
the lesion mask). Writes to --out: checkpoint.keras (+ checkpoint.json for --resume), training_log.csv,
training_curves.png, activation_report.png/.txt, sample_prediction.png, summary.json. See docs/examples.md.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

if __package__:  # python -m examples.segmentation_3d (or imported as examples.segmentation_3d)
    from .cli import Task
    from .train import run
else:  # python examples/segmentation_3d.py: examples/ is on sys.path
    from cli import Task
    from train import run

TASK = Task(
    name="segmentation_3d", kind="3d", size_flag="--volume", default_size=96, default_depth=3,
    what="3D U-Net lesion segmentation on volumes (synthetic by default, or NIfTI pairs) with keras-lms.")


def main(argv=None):
    return run(TASK, argv)


if __name__ == "__main__":
    main()
