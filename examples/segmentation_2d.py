"""2D U-Net segmentation of large images (satellite / pathology tiles) with activations offloaded by keras-lms.

    python examples/segmentation_2d.py --image-size 2048 --batch-size 2 --epochs 5 --lms --out runs/seg2d
    horovodrun -np 4 -H host1:2,host2:2 python examples/segmentation_2d.py --horovod --image-size 4096 ...
    python examples/segmentation_2d.py --data-dir /data/tiles      # NAME_image.png|tif / NAME_label.png|tif

Default data: the embedded synthetic generator (RGB tiles with a smooth illumination field, faint structure and
coloured elliptical lesions; the label is the lesion mask). Same flags and artefacts as segmentation_3d.py.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

if __package__:  # python -m examples.segmentation_2d (or imported as examples.segmentation_2d)
    from .cli import Task
    from .train import run
else:  # python examples/segmentation_2d.py: examples/ is on sys.path
    from cli import Task
    from train import run

TASK = Task(
    name="segmentation_2d", kind="2d", size_flag="--image-size", default_size=2048, default_depth=4,
    what="2D U-Net lesion segmentation on large RGB images (synthetic by default, or PNG/TIFF pairs) with keras-lms.")


def main(argv=None):
    return run(TASK, argv)


if __name__ == "__main__":
    main()
