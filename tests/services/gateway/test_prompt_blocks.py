"""The gateway hashes a prompt as the engine's cache names its blocks, up to the first image placeholder."""

from services.engine.prefix.block_hash import ImageSpan, block_hashes
from services.gateway.prompt_blocks import PromptBlocks

PLACEHOLDER, IMAGE_TOKEN = 99, 98


def test_full_blocks_only_rooted_at_the_model_and_salt():
    blocks = PromptBlocks("m", 4, None)
    ids = list(range(10))
    assert blocks.hashes(ids) == block_hashes(ids, 4, model="m") and len(blocks.hashes(ids)) == 2
    assert blocks.hashes(ids, "s") == block_hashes(ids, 4, model="m", salt="s") != blocks.hashes(ids)
    assert PromptBlocks("other", 4, None).hashes(ids) != blocks.hashes(ids)
    assert blocks.num_blocks(10) == 3 and blocks.num_blocks(8) == 2 and blocks.num_blocks(0) == 0


def test_blocks_before_the_first_image_match_the_engines_expanded_prompt():
    """The engine expands the placeholder at position 9 into a 6-position span and hashes with the image's
    digest; the gateway's chain (blocks 0 and 1, which end before position 9) is a prefix of the engine's."""
    blocks = PromptBlocks("m", 4, PLACEHOLDER)
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 9, PLACEHOLDER, 10, 11, 12, 13]
    expanded = ids[:9] + [IMAGE_TOKEN] * 6 + ids[10:]
    engine = block_hashes(expanded, 4, model="m", images=[ImageSpan(9, 6, b"digest")])
    gateway = blocks.hashes(ids)
    assert len(gateway) == 2 and engine[:2] == gateway
    assert PromptBlocks("m", 4, PLACEHOLDER).hashes([PLACEHOLDER] + ids) == []
