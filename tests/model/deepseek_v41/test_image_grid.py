"""Image sizing: the released config's image-token counts equal deepseek-recipe's placeholder expansion,
and every plan fits its budget in whole patches."""

from __future__ import annotations

import random

import deepseek_recipe
import pytest

from model.deepseek_v41.image_grid import plan_image_grid
from model.deepseek_v41.presets import TINY
from model.deepseek_v41.vision import span_length
from model.deepseek_v41.vision_config import VisionConfig

FLASH = VisionConfig()


def recipe_tokens(width: int, height: int) -> int:
    """deepseek-recipe's image tokens for one image: one placeholder plus its adjustment."""
    info = deepseek_recipe.ImageInfo(b"", width, height)
    return deepseek_recipe.MultiModalData([info]).image_token_adjustment() + 1


def sizes(seed: int, num: int, max_aspect: float) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    out = []
    while len(out) < num:
        w, h = rng.randint(1, 6000), rng.randint(1, 6000)
        if max(w / h, h / w) <= max_aspect:
            out.append((w, h))
    return out


@pytest.mark.parametrize(
    "size",
    [
        (100, 80),
        (640, 480),
        (4000, 3000),
        (544, 544),
        (1, 1),
        (1000, 10),
        (14, 14),
        (1920, 1080),
        (1080, 1920),
        (10000, 10000),
    ],
)
def test_released_counts_equal_the_recipes(size):
    assert plan_image_grid(*size, FLASH).num_tokens == recipe_tokens(*size)


def test_released_counts_equal_the_recipes_on_random_sizes():
    # Slivers beyond 40:1 are left out: there the recipe's sizing differs from the released processor's by a
    # few tokens (22 of 20,000 random sizes up to 6000 px, all beyond 41:1; 35×1438 gives it 254 tokens, the
    # processor 251). The services use plan_image_grid for both the expansion and the tower, so they agree.
    for w, h in sizes(0, 400, 40.0):
        assert plan_image_grid(w, h, FLASH).num_tokens == recipe_tokens(w, h), (w, h)


@pytest.mark.parametrize("vcfg", [FLASH, TINY.vision], ids=["flash", "tiny"])
def test_plans_fit_the_budget_in_whole_patches(vcfg):
    for w, h in sizes(1, 300, 400.0) + [(1, 1), (1, 6000), (6000, 1)]:
        g = plan_image_grid(w, h, vcfg)
        assert g.num_tokens <= vcfg.max_image_tokens
        assert g.width == g.patch_cols * vcfg.patch_size and g.height == g.patch_rows * vcfg.patch_size
        assert g.rows == -(-g.patch_rows // vcfg.downsample_ratio) and g.cols == -(
            -g.patch_cols // vcfg.downsample_ratio
        )
        pw, ph = -(-w // vcfg.patch_size), -(-h // vcfg.patch_size)  # whole patches, rounded up
        r = vcfg.downsample_ratio
        if w * h >= vcfg.min_pixels and span_length(-(-ph // r), -(-pw // r)) <= vcfg.max_image_tokens:
            assert (g.patch_cols, g.patch_rows) == (pw, ph)  # fits as it is: only rounded up to whole patches


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="positive"):
        plan_image_grid(0, 10, FLASH)
