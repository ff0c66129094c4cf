"""Model and activation names are defined once, in the models package."""
from __future__ import annotations

import pytest

import fullgraph.models as models
from fullgraph.config import ModelConfig
from fullgraph.errors import ConfigError
from fullgraph.models import layers


def test_config_accepts_a_model_registered_in_models(monkeypatch):
    monkeypatch.setitem(models.MODELS, "toy", models.GCN)
    assert ModelConfig(name="toy").name == "toy"


def test_config_accepts_an_activation_registered_in_layers(monkeypatch):
    monkeypatch.setitem(layers.ACTIVATIONS, "toy", layers.ACTIVATIONS["relu"])
    assert ModelConfig(activation="toy").activation == "toy"


def test_unknown_names_are_refused_listing_the_registered_ones():
    with pytest.raises(ConfigError) as err:
        ModelConfig(name="mlp")
    assert str(err.value).endswith("model.name: got 'mlp'; expected gcn | sage | gat | gin | "
                                   "tagcn, or module:Class or path/to/file.py:Class (a "
                                   "fullgraph.models.GNN subclass)")
    expected = " | ".join(layers.ACTIVATIONS)
    with pytest.raises(ConfigError) as err:
        ModelConfig(activation="swish")
    assert str(err.value).endswith(f"expected {expected}")
