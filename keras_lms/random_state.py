"""The random state an exact resume restores, as named NumPy arrays (what `BackupAndRestore` writes to state.npz).

`capture` reads it; `restore_model` and `restore_process` put it back, each at its moment (see `restore_process`).

`model.save_weights` leaves out every random-number generator, yet a model with Dropout draws its masks from one:
on TensorFlow from the layer's `SeedGenerator` (a state variable in `model.variables`, not in `model.weights`), on
torch from torch's global generator (Keras' fast path for Dropout without an explicit seed). A resumed run draws
the masks the uninterrupted run would have drawn only if all of them continue where they were:

* the state variables of the model's seed generators (Dropout, random augmentation layers, ...);
* Keras' global seed generator (`keras.random` calls without `seed=`), if the program has used it;
* Python's `random`, NumPy's global generator and, when torch is imported, torch's CPU and CUDA generators
  (which `keras.utils.set_random_seed` seeds, and data pipelines and torch layers draw from).

Not captured: TensorFlow's stateful random ops without a seed (`tf.random.uniform(shape)`), and generators a
program makes itself (`np.random.default_rng()`).
"""

from __future__ import annotations

import math
import random
import sys

import keras
import numpy as np

from keras_lms import _keras_adapter as adapter


def seed_state_variables(model) -> list:
    """The state variables of `model`'s random-seed generators (Dropout's, ...), which `save_weights` leaves out.

    `model.variables` is `model.weights` plus exactly these (Keras' `Layer.variables`: "including random seeds").
    """
    weights = {id(v) for v in model.weights}
    return [v for v in model.variables if id(v) not in weights]


def capture(model) -> dict:
    """The current random state of `model` and of the process, as named arrays (see the module docstring)."""
    arrays = {f"seed_{i}": _numpy(v) for i, v in enumerate(seed_state_variables(model))}
    generator = adapter.global_seed_generator()
    if generator is not None:
        arrays["keras_global_seed"] = _numpy(generator.state)
    version, words, gauss = random.getstate()
    arrays["python_random"] = np.asarray(words, dtype=np.int64)
    arrays["python_random_version"] = np.asarray(version, dtype=np.int64)
    arrays["python_random_gauss"] = np.asarray(math.nan if gauss is None else gauss, dtype=np.float64)
    _, keys, pos, has_gauss, cached = np.random.get_state()
    arrays["numpy_random"] = np.asarray(keys, dtype=np.uint32)
    arrays["numpy_random_pos"] = np.asarray([pos, has_gauss], dtype=np.int64)
    arrays["numpy_random_gauss"] = np.asarray(cached, dtype=np.float64)
    torch = sys.modules.get("torch")
    if torch is not None:
        arrays["torch_cpu"] = torch.get_rng_state().numpy()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for i, state in enumerate(torch.cuda.get_rng_state_all()):
                arrays[f"torch_cuda_{i}"] = state.numpy()
    return arrays


def restore_model(model, arrays, where: str = "the backup") -> None:
    """Put back the seed-generator states of `model` and Keras' global one, from what `capture` returned.

    Args:
        model: the model `capture` read (a rebuilt copy of it).
        arrays: a mapping of name to array (e.g. the arrays of an opened .npz file).
        where: names the backup in the error message.

    Raises:
        ValueError: `arrays` holds another number or shape of seed states than `model` has (another model wrote
            it).
    """
    variables = seed_state_variables(model)
    seeds = [arrays[f"seed_{i}"] for i in range(sum(name.startswith("seed_") for name in arrays))]
    if [tuple(v.shape) for v in variables] != [tuple(s.shape) for s in seeds]:
        raise ValueError(
            f"BackupAndRestore: {where} holds {len(seeds)} random-seed states, model {model.name!r} has "
            f"{len(variables)}. It was written for another model; use that model, or another backup_dir."
        )
    for variable, value in zip(variables, seeds):
        variable.assign(value)
    if "keras_global_seed" in arrays:  # made here if need be (drawing from Python's generator: restore that later)
        adapter.global_seed_generator(create=True).state.assign(arrays["keras_global_seed"])


def restore_process(arrays) -> None:
    """Put back the states of Python's, NumPy's and torch's generators from what `capture` returned.

    Call it where the interrupted run took the backup: a resumed epoch makes a new data iterator, and torch's
    `DataLoader` draws from torch's generator when it does, so for a backup taken mid-epoch this comes after the
    resumed epoch has started and read the batches trained before the backup.
    """
    np.random.set_state(("MT19937", arrays["numpy_random"], *(int(v) for v in arrays["numpy_random_pos"]),
                         float(arrays["numpy_random_gauss"])))
    torch = sys.modules.get("torch")
    if torch is not None and "torch_cpu" in arrays:
        torch.set_rng_state(torch.from_numpy(np.array(arrays["torch_cpu"])))
        cuda = [arrays[f"torch_cuda_{i}"] for i in range(sum(name.startswith("torch_cuda_") for name in arrays))]
        if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([torch.from_numpy(np.array(state)) for state in cuda])
    gauss = float(arrays["python_random_gauss"])
    random.setstate((int(arrays["python_random_version"]), tuple(int(w) for w in arrays["python_random"]),
                     None if math.isnan(gauss) else gauss))


def _numpy(variable) -> np.ndarray:
    return keras.ops.convert_to_numpy(variable.value)
