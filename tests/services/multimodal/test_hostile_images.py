"""Hostile image bytes (tests/services/multimodal/hostile_images.py) are refused with an ImageInputError naming
the problem, by the header check (``peek_grid``) and the decode (``prepare_image``): never another exception."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from PIL import Image

from model.deepseek_v41.presets import TINY
from services.multimodal.preprocess import ImageInputError, ImageLimits, peek_grid, prepare_image
from tests.services.multimodal.hostile_images import HOSTILE, VALID, damaged_images


@pytest.mark.parametrize("name", list(HOSTILE))
@pytest.mark.parametrize("step", [peek_grid, prepare_image], ids=["header", "decode"])
def test_a_hostile_image_is_refused_by_name(name, step):
    data, phrase, in_header = HOSTILE[name]
    if step is peek_grid and not in_header:
        peek_grid(data, TINY.vision, ImageLimits())  # damage past the header: the decode finds it
        return
    with pytest.raises(ImageInputError, match=phrase):
        step(data, TINY.vision, ImageLimits())


def test_a_mode_without_an_rgb_conversion_is_refused_by_name(monkeypatch):
    def no_rgb(self, mode=None, *args, **kwargs):
        raise ValueError(f"conversion from {self.mode} to {mode} not supported")

    monkeypatch.setattr(Image.Image, "convert", no_rgb)
    with pytest.raises(ImageInputError, match="mode RGB is not supported"):
        prepare_image(VALID[0], TINY.vision, ImageLimits())


@given(data=damaged_images())
@settings(max_examples=300, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
def test_damaged_images_decode_or_are_refused(data):
    for step in (peek_grid, prepare_image):
        try:
            step(data, TINY.vision, ImageLimits())
        except ImageInputError:
            pass
