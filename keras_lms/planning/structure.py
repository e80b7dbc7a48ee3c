"""Which layer calls a model makes: the offload units of a model.

An *offload unit* is an operation whose calls keras-lms intercepts: every layer that is not itself a model,
reached by walking through nested models (a Functional model used as a layer, Sequential blocks, subclassed
models' tracked sublayers), plus the ``keras.ops`` nodes of functional graphs. Models are walked into, not
intercepted, so offloading happens at the leaf layers. A custom non-model layer with sublayers (say an
attention block) is one unit: its inputs are offloaded and it is recomputed as a whole in the backward pass.
"""

from __future__ import annotations

import dataclasses

import keras

from keras_lms import _keras_adapter as adapter


@dataclasses.dataclass
class ModelStructure:
    """The units of a model, and the names a user may refer to in include/exclude."""

    units: list  # unique ops in discovery order
    models: list  # the model itself and every nested model
    unit_models: dict  # id(unit) -> list of enclosing model names (outermost first)

    @property
    def names(self) -> set:
        return {u.name for u in self.units} | {m.name for m in self.models}


def model_structure(model: keras.Model) -> ModelStructure:
    units, models, unit_models = [], [], {}
    seen_units, seen_models = set(), set()

    def walk(m, path):
        if id(m) in seen_models:
            return
        seen_models.add(id(m))
        models.append(m)
        children = adapter.functional_operations(m)
        if children is None:
            children = list(m.layers)
        for child in children:
            if isinstance(child, keras.Model):
                walk(child, path + [m.name])
            elif isinstance(child, keras.layers.InputLayer):
                continue
            elif id(child) not in seen_units:
                seen_units.add(id(child))
                units.append(child)
                unit_models[id(child)] = path + [m.name]

    walk(model, [])
    return ModelStructure(units=units, models=models, unit_models=unit_models)
