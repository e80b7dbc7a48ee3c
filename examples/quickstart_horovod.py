"""examples/quickstart.py on several Horovod ranks: the same model, wrapped, trained data-parallel.

    horovodrun -np 2 -H localhost:2 --gloo python examples/quickstart_horovod.py     # 2 ranks on one machine
    python examples/quickstart_horovod.py                                            # 1 rank, no launcher

Each rank trains on its own shard with the same number of batches; `DistributedOptimizer` averages the
gradients, the callbacks start all ranks from rank 0's weights and average the logged metrics. Rank 0 prints.
"""

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")  # Horovod is TensorFlow-only
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")  # TensorFlow on CPU: allocator peaks for peak_device_mib

import keras

import keras_lms
import keras_lms.horovod as lhvd

if __package__:  # python -m examples.quickstart_horovod (or imported as examples.quickstart_horovod)
    from .quickstart import build_model, make_data
else:  # python examples/quickstart_horovod.py: examples/ is on sys.path
    from quickstart import build_model, make_data


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--min-bytes", default="256KiB", help="smaller layer inputs stay on the device")
    args = parser.parse_args(argv)

    lhvd.init()  # first: pins this rank's GPU and its share of host memory before TensorFlow starts
    x, y = make_data(n=64 * lhvd.size())
    x, y = x[lhvd.rank()::lhvd.size()], y[lhvd.rank()::lhvd.size()]  # this rank's shard, same size on every rank

    wrapped = keras_lms.wrap(build_model(), min_bytes=args.min_bytes)
    optimizer = lhvd.DistributedOptimizer(keras.optimizers.Adam(1e-3 * lhvd.size()))
    wrapped.compile(optimizer=optimizer, loss="binary_crossentropy", metrics=["accuracy"], jit_compile=False)
    callbacks = [lhvd.BroadcastGlobalVariablesCallback(0), lhvd.MetricAverageCallback(),
                 keras_lms.MemoryHighWaterMark()]
    wrapped.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, callbacks=callbacks,
                verbose=lhvd.fit_verbose(2))

    if lhvd.is_root():
        print(f"\n{lhvd.size()} rank(s). Offload plan of each rank's training step:")
        for entry in wrapped.lms_plan:
            print("  ", entry)
        print(keras_lms.report(wrapped, batch_size=args.batch_size).to_text())
    return wrapped


if __name__ == "__main__":
    main()
